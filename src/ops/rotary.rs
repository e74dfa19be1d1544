//! Rotary position embedding in HF's rotate-half form, q and k in one launch, forward and
//! backward (`torchfuse::rotary[_backward]`, what the rewrite layer sends HF's
//! apply_rotary_pos_emb to), through kernels/rotary.cu, or why stock (HF's composition, in the
//! glue) runs a call.

use super::{elementwise, params};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr};
use crate::abi::types::{TfRotaryCall, TfTensor};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// The kernel of kernels/rotary.cu (one per direction, by TF_ROPE_BWD).
const KERNEL: &str = "rope";

/// Grid CTAs at most; they stride over the rest of the rows.
const MAX_GRID: i64 = 1 << 16;

/// Element strides of a [n0, n1, n2, d] view (`RopeStrides` in rotary.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RopeStrides {
    s0: i64,
    s1: i64,
    s2: i64,
}

// SAFETY: plain old data, laid out as the kernel's struct.
unsafe impl DeviceRepr for RopeStrides {}

/// One of q, k (`RopeOperand` in rotary.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RopeOperand {
    input: u64,
    output: u64,
    n1: i64,
    n2: i64,
    /// n0 * n1 * n2: the (batch, head, position) rows, each of head-dim elements.
    rows: i64,
    in_s: RopeStrides,
    out_s: RopeStrides,
    trig_s: RopeStrides,
}

// SAFETY: plain old data, laid out as the kernel's struct.
unsafe impl DeviceRepr for RopeOperand {}

pub struct Rotary;

/// A 4-D tensor's leading strides, if its last dim is contiguous.
fn strides(t: &Tensor) -> Option<RopeStrides> {
    match t.stride()[..] {
        [s0, s1, s2, 1] => Some(RopeStrides { s0, s1, s2 }),
        _ => None,
    }
}

/// cos or sin unsqueezed at `dim` and broadcast to `shape`: its strides (0 where broadcast),
/// or None when HF's code would not broadcast it so (stock raises or computes it its way).
fn trig_strides(trig: &Tensor, dim: i64, shape: &[i64]) -> Option<RopeStrides> {
    let view = trig.f_unsqueeze(dim).ok()?.f_expand(shape, false).ok()?;
    strides(&view)
}

/// Lanes a row for the kernel's chunked path (a power of two: the chunks of a half, or the
/// largest power of two that divides them, at most a warp), or 0 for element by element: chunks
/// need a half of whole chunks and every row of every operand 16-byte aligned.
fn lanes_per_row(half: i64, ops: &[&RopeOperand], tensors: &[&Tensor]) -> i32 {
    let chunk = elementwise::CHUNK;
    // A dim of one element never steps: its stride does not matter.
    let whole = |o: &RopeOperand, s: &RopeStrides| {
        let n0 = o.rows / (o.n1 * o.n2).max(1);
        [(n0, s.s0), (o.n1, s.s1), (o.n2, s.s2)]
            .iter()
            .all(|&(n, stride)| n <= 1 || stride % chunk == 0)
    };
    let rows_aligned = ops
        .iter()
        .all(|o| whole(o, &o.in_s) && whole(o, &o.out_s) && whole(o, &o.trig_s));
    if half % chunk != 0 || !rows_aligned || !aligned16(tensors.iter().copied()) {
        return 0;
    }
    let chunks = half / chunk;
    (chunks & -chunks).min(32) as i32
}

/// Whether two elements of the view share memory: walking its dims of more than one element
/// from the smallest stride up, each must step past all of the ones before it.
fn overlapping(t: &Tensor) -> bool {
    let mut dims: Vec<(i64, i64)> = t
        .stride()
        .into_iter()
        .zip(t.size())
        .filter(|&(_, n)| n > 1)
        .collect();
    dims.sort_unstable();
    let mut span = 1;
    for (stride, n) in dims {
        if stride < span {
            return true;
        }
        span = stride * n;
    }
    false
}

/// The strides HF's composition gives its output for a 4-D input with a contiguous last dim:
/// the input's own where it is dense (PyTorch's elementwise ops keep their first operand's
/// dense layout), else dense strides in the input's stride order (a slice of the head dim, as
/// partial rotary takes it, gives a dense output in the same dim order).
fn output_strides(size: &[i64], stride: &[i64], dense: bool) -> Vec<i64> {
    if dense {
        return stride.to_vec();
    }
    let mut order = [0, 1, 2];
    order.sort_by_key(|&i| stride[i]); // the fastest-moving dim first, after the last
    let mut out = vec![0, 0, 0, 1];
    let mut step = size[3];
    for i in order {
        out[i] = step;
        step *= size[i];
    }
    out
}

/// A new tensor for the output of `like`, laid out as HF's composition lays it out.
fn empty_like(
    like: &Tensor,
    dense: bool,
    kind: Kind,
    device: Device,
) -> Result<Tensor, StockReason> {
    let size = like.size();
    let stride = output_strides(&size, &like.stride(), dense);
    Tensor::f_empty_strided(&size, &stride, (kind, device)).map_err(|_| StockReason::InternalError)
}

impl Family for Rotary {
    type Call = TfRotaryCall;

    const FAMILY: OpFamily = OpFamily::Rotary;

    /// q (forward) or its gradient (backward: q itself is not passed).
    unsafe fn symbolic(call: &TfRotaryCall) -> Option<&TfTensor> {
        TfTensor::first_symbolic(&[
            &call.q,
            &call.k,
            &call.cos,
            &call.sin,
            &call.grad_q,
            &call.grad_k,
        ])
    }

    unsafe fn describe(entry: Entry, call: &TfRotaryCall) -> Option<(&'static str, Vec<i64>)> {
        let q = if entry == Entry::RotaryBackward {
            call.grad_q.borrow()?
        } else {
            call.q.borrow()?
        };
        Some(describe(Some(&q)))
    }

    /// Forward: q_embed, k_embed (in the promoted dtype of q and cos). Backward: dq, dk (in
    /// `x_dtype`, q's and k's).
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfRotaryCall,
        _shape: &[i64],
    ) -> Result<Served, StockReason> {
        let backward = entry == Entry::RotaryBackward;
        // The tensors the kernel reads in place of q and k: the incoming gradients backward.
        let (a, b) = if backward {
            (&call.grad_q, &call.grad_k)
        } else {
            (&call.q, &call.k)
        };
        let (a_dense, b_dense) = (a.dense != 0, b.dense != 0);
        let a = a.borrow().ok_or(StockReason::InvalidInput)?;
        let b = b.borrow().ok_or(StockReason::InvalidInput)?;
        // Strided views are served (HF's transposed projections; partial rotary's slices of the
        // head dim); one whose elements overlap (broadcast, unfold) is not: stock's output
        // layout for it is its own.
        if overlapping(&a) || overlapping(&b) {
            return Err(StockReason::NotContiguous);
        }
        let cos = call.cos.borrow().ok_or(StockReason::InvalidInput)?;
        let sin = call.sin.borrow().ok_or(StockReason::InvalidInput)?;
        let device = gpu::torch_device(launch)?;
        if [&*a, &*b, &*cos, &*sin]
            .iter()
            .any(|t| t.device() != device)
        {
            return Err(StockReason::InvalidInput);
        }
        let (a_size, b_size) = (a.size(), b.size());
        let (Some(&d), Some(&d_k)) = (a_size.last(), b_size.last()) else {
            return Err(StockReason::InvalidInput);
        };
        if a_size.len() != 4
            || b_size.len() != 4
            || d != d_k
            || d % 2 != 0
            || cos.size() != sin.size()
        {
            return Err(StockReason::InvalidInput);
        }
        let a_kind = a.f_kind().map_err(|_| StockReason::UnsupportedDtype)?;
        let trig_kind = cos.f_kind().map_err(|_| StockReason::UnsupportedDtype)?;
        if b.f_kind().ok() != Some(a_kind) || sin.f_kind().ok() != Some(trig_kind) {
            return Err(StockReason::MixedDtypes);
        }
        // x: q and k's dtype; the other (cos, sin, y / dy) is x's or, wide, fp32.
        let x_kind = if backward {
            crate::abi::tensor::kind_of_scalar_type(call.x_dtype)
                .ok_or(StockReason::UnsupportedDtype)?
        } else {
            a_kind
        };
        let other_kind = if backward { a_kind } else { trig_kind };
        if trig_kind != other_kind {
            return Err(StockReason::MixedDtypes);
        }
        let wide = other_kind != x_kind;
        if wide && (other_kind != Kind::Float || x_kind == Kind::Float) {
            return Err(StockReason::MixedDtypes);
        }
        let dtype = dtype_of(x_kind).ok_or(StockReason::UnsupportedDtype)?;
        let operand = |t: &Tensor, out: &Tensor| -> Result<RopeOperand, StockReason> {
            let size = t.size();
            let trig_s = trig_strides(&cos, call.unsqueeze_dim, &size)
                .filter(|s| {
                    trig_strides(&sin, call.unsqueeze_dim, &size)
                        .is_some_and(|t| (t.s0, t.s1, t.s2) == (s.s0, s.s1, s.s2))
                })
                .ok_or(StockReason::InvalidInput)?;
            Ok(RopeOperand {
                input: device_addr(t),
                output: device_addr(out),
                n1: size[1],
                n2: size[2],
                rows: size[0] * size[1] * size[2],
                in_s: strides(t).ok_or(StockReason::NotContiguous)?,
                out_s: strides(out).ok_or(StockReason::NotContiguous)?,
                trig_s,
            })
        };
        let out_kind = if backward { x_kind } else { other_kind };
        let (out_a, out_b) = (
            empty_like(&a, a_dense, out_kind, device)?,
            empty_like(&b, b_dense, out_kind, device)?,
        );
        let (op_a, op_b) = (operand(&a, &out_a)?, operand(&b, &out_b)?);
        let total = op_a.rows + op_b.rows;
        if total == 0 || d == 0 {
            return Err(StockReason::EmptyInput);
        }
        let kernel_op = match (backward, wide) {
            (false, false) => KernelOp::RotaryFwd,
            (false, true) => KernelOp::RotaryFwdWide,
            (true, false) => KernelOp::RotaryBwd,
            (true, true) => KernelOp::RotaryBwdWide,
        };
        let Selected {
            gpu,
            variant,
            kernels,
            params,
        } = super::select(launch, |sm| Request {
            op: kernel_op,
            dtype,
            hidden: d,
            rows: total,
            sm,
            deterministic: false,
        })?;
        let p = Rotary::params(params)?;
        let group = lanes_per_row(
            d / 2,
            &[&op_a, &op_b],
            &[&a, &b, &out_a, &out_b, &cos, &sin],
        );
        let rows_per_warp = if group > 0 { 32 / i64::from(group) } else { 1 };
        let blocks = gpu::ceil_div(total, p.threads / 32 * rows_per_warp).min(MAX_GRID);
        let config = LaunchConfig {
            grid_dim: (gpu::grid_dim(blocks, 1)?, 1, 1),
            block_dim: (
                u32::try_from(p.threads).map_err(|_| StockReason::InternalError)?,
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        let (cos_ptr, sin_ptr) = (device_addr(&cos), device_addr(&sin));
        let half = i32::try_from(d / 2).map_err(|_| StockReason::NoVariantForShape)?;
        let stream = gpu.stream(launch);
        let kernel = kernels.get(KERNEL)?;
        let mut args = stream.launch_builder(&kernel.function);
        args.arg(&op_a)
            .arg(&op_b)
            .arg(&cos_ptr)
            .arg(&sin_ptr)
            .arg(&half)
            .arg(&group);
        // SAFETY: argument types and order match rope (q, k, cos, sin, half, group); group > 0
        // only where every row and half starts 16-byte aligned; every offset the kernel forms
        // is within its tensor (sizes and strides read from the tensors, cos/sin's
        // as broadcast views of themselves), the dtypes are the module's; all live until the
        // stream is done with them (PyTorch's allocator orders reuse on it).
        unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
        Ok(Served::new(
            variant.name.as_str(),
            [Some(out_a), Some(out_b), None],
        ))
    }

    fn kernels(_op: KernelOp) -> &'static [&'static str] {
        &[KERNEL]
    }

    /// Which direction kernels/rotary.cu compiles, and whether cos/sin/y are fp32.
    fn defines(op: KernelOp) -> Vec<String> {
        let backward = matches!(op, KernelOp::RotaryBwd | KernelOp::RotaryBwdWide);
        let wide = matches!(op, KernelOp::RotaryFwdWide | KernelOp::RotaryBwdWide);
        vec![
            format!("-DTF_ROPE_BWD={}", i32::from(backward)),
            format!("-DTF_WIDE={}", i32::from(wide)),
            elementwise::define(),
        ]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        let p: Params = params::parse(v)?;
        params::one_of(v, "THREADS", p.threads, &[128, 256, 512, 1024])?;
        Ok(p)
    }
}

/// A rotary variant's compile-time params (`registry/rotary.toml`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Threads per CTA.
    threads: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operand(stride: i64) -> RopeOperand {
        let s = RopeStrides {
            s0: stride * 4,
            s1: stride,
            s2: 0,
        };
        RopeOperand {
            input: 0,
            output: 0,
            n1: 2,
            n2: 2,
            rows: 8,
            in_s: s,
            out_s: s,
            trig_s: s,
        }
    }

    #[test]
    fn chunked_rows_take_a_power_of_two_of_lanes_where_every_row_is_aligned() {
        let t = Tensor::zeros([64], (Kind::Float, Device::Cpu));
        let tensors = [&t];
        let aligned = operand(64);
        // Head dims 64, 128, 96, 512: halves of 4, 8, 6 and 32 chunks.
        assert_eq!(lanes_per_row(32, &[&aligned], &tensors), 4);
        assert_eq!(lanes_per_row(64, &[&aligned], &tensors), 8);
        assert_eq!(lanes_per_row(48, &[&aligned], &tensors), 2);
        assert_eq!(lanes_per_row(256, &[&aligned], &tensors), 32);
        // A half not of whole chunks, a row stride off the chunk, a misaligned pointer.
        assert_eq!(lanes_per_row(36, &[&aligned], &tensors), 0);
        assert_eq!(lanes_per_row(32, &[&aligned, &operand(68)], &tensors), 0);
        // ... unless that dim has one element (it never steps).
        let one_head = RopeOperand {
            n1: 1,
            rows: 4,
            ..operand(68)
        };
        assert_eq!(lanes_per_row(32, &[&aligned, &one_head], &tensors), 4);
        let offset = t.narrow(0, 1, 32);
        assert_eq!(lanes_per_row(32, &[&aligned], &[&offset]), 0);
    }

    #[test]
    fn overlapping_views_are_told_apart_from_strided_ones() {
        let x = Tensor::zeros([2, 3, 40], (Kind::Float, Device::Cpu));
        let transposed = Tensor::zeros([2, 5, 3, 80], (Kind::Float, Device::Cpu)).transpose(1, 2);
        assert!(!overlapping(&transposed.narrow(3, 0, 32))); // partial rotary's slice
        assert!(!overlapping(&x.unsqueeze(1))); // a size-1 dim's stride is no step
        assert!(overlapping(&x.unfold(-1, 16, 1).narrow(2, 0, 4))); // rows share elements
        assert!(overlapping(&x.unsqueeze(1).expand([2, 4, 3, 40], false))); // broadcast
    }

    #[test]
    fn a_strided_input_gets_a_dense_output_in_its_dim_order() {
        // [b, h, s, 32] slices of [b, s, h, 80] (transposed) and of [b, h, s, 80]; numbers as
        // PyTorch gives HF's composition (b 2, s 5, h 3).
        let size = [2, 3, 5, 32];
        assert_eq!(
            output_strides(&size, &[1200, 80, 240, 1], false),
            [480, 32, 96, 1]
        );
        assert_eq!(
            output_strides(&size, &[1200, 400, 80, 1], false),
            [480, 160, 32, 1]
        );
        assert_eq!(
            output_strides(&size, &[1200, 80, 240, 1], true),
            [1200, 80, 240, 1]
        );
    }
}
