//! Rotary position embedding in HF's rotate-half form or the interleaved one (GLM's, Cohere's,
//! GPT-J's rotate_every_two), q and k in one launch, forward and backward
//! (`torchfuse::rotary[_backward]`, what the rewrite layer sends HF's apply_rotary_pos_emb
//! to), through kernels/rotary.cu, or why stock (HF's composition, in the glue) runs a call;
//! and `torchfuse::kv_copy` (K and V copied into HF's KV cache, per-head rows as rotary's).

use super::{elementwise, params};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty, kind_of_scalar_type};
use crate::abi::types::{TfRotaryCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// The kernels of kernels/rotary.cu (one per direction, by TF_ROPE_BWD): the rotate-half
/// layout's, and the interleaved one's (pairs (2p, 2p+1)), each with its own registers.
const KERNEL: &str = "rope";
const PAIRS_KERNEL: &str = "rope_pairs";
/// torchfuse::kv_copy's kernel, in the same module.
const KV_KERNEL: &str = "kv_copy";

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

kernel_args! {
    /// rope's and rope_pairs' arguments (kernels/rotary.cu): q's rows then k's (the gradients'
    /// backward).
    struct RopeArgs {
        q: RopeOperand,
        k: RopeOperand,
        cos: u64,
        sin: u64,
        /// Half the rotated features (the head dim, or cos/sin's last dim in partial rotary).
        half: i32,
        /// The head dim: where it is more than 2 * half, the rest of the row passes through.
        d: i32,
        /// Lanes a row, 1 to 32 (kv_copy takes only rows of whole 16-byte chunks).
        group: i32,
    }
}

kernel_args! {
    /// kv_copy's arguments (kernels/rotary.cu): x's rows, copied row-major.
    struct KvCopyArgs {
        x: RopeOperand,
        /// The head dim.
        d: i32,
        /// Lanes a row, 1 to 32 (kv_copy takes only rows of whole 16-byte chunks).
        group: i32,
    }
}

pub struct Rotary;

/// A 4-D tensor's leading strides, if its last dim is contiguous.
fn strides(stride: &[i64]) -> Option<RopeStrides> {
    match *stride {
        [s0, s1, s2, 1] => Some(RopeStrides { s0, s1, s2 }),
        _ => None,
    }
}

/// cos or sin unsqueezed at `dim` and broadcast to `shape` (PyTorch's `unsqueeze`, then
/// `expand`): its strides (0 where broadcast), or None when HF's code would not broadcast it
/// so (stock raises or computes it its way).
fn trig_strides(trig: &TfTensor, dim: i64, shape: &[i64]) -> Option<RopeStrides> {
    let (size, stride) = (trig.sizes(), trig.strides());
    let dims = i64::try_from(size.len()).ok()? + 1;
    let at = usize::try_from(if dim < 0 { dim + dims } else { dim })
        .ok()
        .filter(|&at| at < size.len() + 1)?;
    // unsqueeze: the new dim's stride is PyTorch's (it never steps: one element).
    let new_stride = if at < size.len() {
        size[at] * stride[at]
    } else {
        1
    };
    let mut view: Vec<(i64, i64)> = size.iter().copied().zip(stride.iter().copied()).collect();
    view.insert(at, (1, new_stride));
    // expand, as PyTorch lays it out: dims aligned from the right; a new leading dim is one of
    // size 1 stepping over the dims after it; a size-1 dim broadcast has stride 0.
    let lead = shape.len().checked_sub(view.len())?;
    let mut expanded = vec![0; shape.len()];
    let mut inner = 1;
    for (i, &want) in shape.iter().enumerate().rev() {
        let (n, s) = i.checked_sub(lead).map_or((1, inner), |j| view[j]);
        expanded[i] = match n {
            _ if n == want => s,
            1 => 0,
            _ => return None,
        };
        inner = want * expanded[i];
    }
    strides(&expanded)
}

/// The grid of a kernel of rows (rope's and kv_copy's): `group` lanes a row (0: a warp a row),
/// CTAs of `threads`, a grid-stride loop past MAX_GRID CTAs.
fn row_launch(rows: i64, group: i32, threads: i64) -> Result<LaunchConfig, StockReason> {
    let rows_per_warp = if group > 0 { 32 / i64::from(group) } else { 1 };
    let blocks = gpu::ceil_div(rows, threads / 32 * rows_per_warp).min(MAX_GRID);
    Ok(LaunchConfig {
        grid_dim: (gpu::grid_dim(blocks, 1)?, 1, 1),
        block_dim: (
            u32::try_from(threads).map_err(|_| StockReason::InternalError)?,
            1,
            1,
        ),
        shared_mem_bytes: 0,
    })
}

/// Lanes a row for the kernel's chunked path (a power of two: the chunks of a half, or the
/// largest power of two that divides them, at most a warp), or 0 for element by element: chunks
/// need a half of whole chunks (and a head dim `d` of whole chunks, where the rest of the row
/// passes through) and every row of every operand 16-byte aligned. Where the rest of the row
/// passes through (partial rotary), the lanes are those of the whole row's chunks instead: the
/// rotated half's chunks alone would leave a row to one lane (Pythia's 8-element half), whose
/// strided accesses ran at a quarter of the copy roofline; the lanes past the half's chunks
/// take pass-through chunks only.
fn lanes_per_row(half: i64, d: i64, ops: &[&RopeOperand], addrs: &[u64]) -> i32 {
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
    if half % chunk != 0 || d % chunk != 0 || !rows_aligned || !aligned16(addrs.iter().copied()) {
        return 0;
    }
    let chunks = if d > 2 * half {
        d / chunk
    } else {
        half / chunk
    };
    (chunks & -chunks).min(32) as i32
}

/// Whether two elements of the view share memory: walking its dims of more than one element
/// from the smallest stride up, each must step past all of the ones before it.
fn overlapping(size: &[i64], stride: &[i64]) -> bool {
    let mut dims: Vec<(i64, i64)> = stride
        .iter()
        .copied()
        .zip(size.iter().copied())
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

/// Row-major strides of a 4-D size.
fn contiguous_strides(size: &[i64]) -> Vec<i64> {
    let mut out = vec![1; size.len()];
    for i in (0..size.len().saturating_sub(1)).rev() {
        out[i] = out[i + 1] * size[i + 1].max(1);
    }
    out
}

/// Whether PyTorch could suggest channels-last for a 4-D view with a contiguous last dim of more
/// than one element (`is_channels_last_strides_2d`): only where dim 1 holds one element at
/// stride 1. torch.cat keeps channels-last where all its inputs suggest it, so partial rotary's
/// output (the cat of the rotated features and the rest) is row-major but there: such views
/// go to stock.
fn may_suggest_channels_last(size: &[i64], stride: &[i64]) -> bool {
    size.get(1) == Some(&1) && stride.get(1) == Some(&1)
}

/// A new tensor for the output of `like`, laid out as HF's composition lays it out (row-major
/// where the rest of the row passes through: the original's cat makes it), and its strides
/// (what it was made with: not read back from libtorch).
fn empty_like(
    like: &TfTensor,
    dense: bool,
    passthrough: bool,
    kind: Kind,
    device: Device,
) -> Result<(Tensor, Vec<i64>), StockReason> {
    let size = like.sizes();
    let stride = if passthrough {
        contiguous_strides(size)
    } else {
        output_strides(size, like.strides(), dense)
    };
    let out = Tensor::f_empty_strided(size, &stride, (kind, device))
        .map_err(|_| StockReason::InternalError)?;
    Ok((out, stride))
}

impl Family for Rotary {
    type Call = TfRotaryCall;

    const FAMILY: OpFamily = OpFamily::Rotary;

    /// q (forward) or its gradient (backward: q itself is not passed).
    unsafe fn unreadable(_entry: Entry, call: &TfRotaryCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(
            &[
                &call.q,
                &call.k,
                &call.cos,
                &call.sin,
                &call.grad_q,
                &call.grad_k,
                &call.out,
            ],
            true,
        )
    }

    unsafe fn describe(entry: Entry, call: &TfRotaryCall) -> Option<(&'static str, Vec<i64>)> {
        let q = if entry == Entry::RotaryBackward {
            &call.grad_q
        } else {
            &call.q
        };
        Some(describe(q.given()?))
    }

    /// Forward: q_embed, k_embed (in the promoted dtype of q and cos). Backward: dq, dk (in
    /// `x_dtype`, q's and k's).
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfRotaryCall,
        _shape: &[i64],
    ) -> Result<Served, StockReason> {
        if entry == Entry::KvCopy {
            return kv_copy(launch, call);
        }
        let backward = entry == Entry::RotaryBackward;
        // The tensors the kernel reads in place of q and k: the incoming gradients backward.
        let (a, b) = if backward {
            (&call.grad_q, &call.grad_k)
        } else {
            (&call.q, &call.k)
        };
        let (a_dense, b_dense) = (a.dense != 0, b.dense != 0);
        let a = a.given().ok_or(StockReason::InvalidInput)?;
        let b = b.given().ok_or(StockReason::InvalidInput)?;
        // Strided views are served (HF's transposed projections; partial rotary's slices of the
        // head dim); one whose elements overlap (broadcast, unfold) is not: stock's output
        // layout for it is its own.
        if overlapping(a.sizes(), a.strides()) || overlapping(b.sizes(), b.strides()) {
            return Err(StockReason::NotContiguous);
        }
        let cos = call.cos.given().ok_or(StockReason::InvalidInput)?;
        let sin = call.sin.given().ok_or(StockReason::InvalidInput)?;
        let device = gpu::torch_device(launch)?;
        if [a, b, cos, sin].iter().any(|t| t.device() != device) {
            return Err(StockReason::InvalidInput);
        }
        let (a_size, b_size) = (a.sizes(), b.sizes());
        let (Some(&d), Some(&d_k)) = (a_size.last(), b_size.last()) else {
            return Err(StockReason::InvalidInput);
        };
        if a_size.len() != 4 || b_size.len() != 4 || cos.sizes() != sin.sizes() {
            return Err(StockReason::InvalidInput);
        }
        // The rotated features: the head dim, or in partial rotary cos/sin's last dim (even, and
        // less than the head dim; the rest passes through, of any width).
        let passthrough = call.passthrough != 0;
        if d != d_k || (d % 2 != 0 && !passthrough) {
            return Err(StockReason::NoVariantForShape);
        }
        let rotated = if passthrough {
            // cos's last dim as the original reads it, after the unsqueeze: one where the new
            // dim is the last (odd: not served).
            let trig_dims =
                i64::try_from(cos.sizes().len()).map_err(|_| StockReason::InvalidInput)?;
            let r = if call.unsqueeze_dim == trig_dims || call.unsqueeze_dim == -1 {
                1
            } else {
                *cos.sizes().last().ok_or(StockReason::InvalidInput)?
            };
            // r == d: all of the head rotates, nothing passes through; the outputs are still
            // the cat's (row-major), as the original's cat of an empty rest makes them.
            if r <= 0 || r > d || r % 2 != 0 {
                return Err(StockReason::InvalidInput);
            }
            // (The backward's gradient is row-major whatever the incoming one's layout.)
            if !backward
                && (may_suggest_channels_last(a_size, a.strides())
                    || may_suggest_channels_last(b_size, b.strides()))
            {
                return Err(StockReason::NotContiguous);
            }
            r
        } else {
            d
        };
        let a_kind = a.kind().ok_or(StockReason::UnsupportedDtype)?;
        let trig_kind = cos.kind().ok_or(StockReason::UnsupportedDtype)?;
        if b.kind() != Some(a_kind) || sin.kind() != Some(trig_kind) {
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
        let operand = |t: &TfTensor,
                       (out, out_stride): &(Tensor, Vec<i64>)|
         -> Result<RopeOperand, StockReason> {
            // cos/sin broadcast to the rotated features' view (the original's slice).
            let mut rotated_size = t.sizes().to_vec();
            rotated_size[3] = rotated;
            let size = t.sizes();
            let trig_s = trig_strides(cos, call.unsqueeze_dim, &rotated_size)
                .filter(|s| {
                    trig_strides(sin, call.unsqueeze_dim, &rotated_size)
                        .is_some_and(|t| (t.s0, t.s1, t.s2) == (s.s0, s.s1, s.s2))
                })
                .ok_or(StockReason::InvalidInput)?;
            Ok(RopeOperand {
                input: t.addr(),
                output: device_addr(out),
                n1: size[1],
                n2: size[2],
                rows: size[0] * size[1] * size[2],
                in_s: strides(t.strides()).ok_or(StockReason::NotContiguous)?,
                out_s: strides(out_stride).ok_or(StockReason::NotContiguous)?,
                trig_s,
            })
        };
        let out_kind = if backward { x_kind } else { other_kind };
        let (out_a, out_b) = (
            empty_like(a, a_dense, passthrough, out_kind, device)?,
            empty_like(b, b_dense, passthrough, out_kind, device)?,
        );
        let (op_a, op_b) = (operand(a, &out_a)?, operand(b, &out_b)?);
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
            narrowed: false,
        })?;
        let p = Rotary::params(params)?;
        let group = lanes_per_row(
            rotated / 2,
            d,
            &[&op_a, &op_b],
            &[
                a.addr(),
                b.addr(),
                op_a.output,
                op_b.output,
                cos.addr(),
                sin.addr(),
            ],
        );
        let config = row_launch(total, group, p.threads)?;
        let (cos_ptr, sin_ptr) = (cos.addr(), sin.addr());
        let half = i32::try_from(rotated / 2).map_err(|_| StockReason::NoVariantForShape)?;
        let row_len = i32::try_from(d).map_err(|_| StockReason::NoVariantForShape)?;
        let stream = gpu.stream(launch);
        let kernel = kernels.get(if call.interleaved != 0 {
            PAIRS_KERNEL
        } else {
            KERNEL
        })?;
        let mut args = stream.launch_builder(&kernel.function);
        let rope_args = RopeArgs {
            q: op_a,
            k: op_b,
            cos: cos_ptr,
            sin: sin_ptr,
            half,
            d: row_len,
            group,
        };
        args::push(&mut args, &rope_args);
        // SAFETY: rope's and rope_pairs' parameters are RopeArgs's fields (the compile test checks); group > 0
        // only where every row and half starts 16-byte aligned; every offset the kernel forms
        // is within its tensor (sizes and strides read from the tensors, cos/sin's
        // as broadcast views of themselves), the dtypes are the module's; all live until the
        // stream is done with them (PyTorch's allocator orders reuse on it).
        unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
        Ok(Served::new(
            variant.name.as_str(),
            [Some(out_a.0), Some(out_b.0), None],
        ))
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if is_kv_copy(op) {
            &[KV_KERNEL]
        } else {
            &[KERNEL, PAIRS_KERNEL]
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            KERNEL | PAIRS_KERNEL => Some(RopeArgs::FIELDS),
            KV_KERNEL => Some(KvCopyArgs::FIELDS),
            _ => None,
        }
    }

    /// Which direction kernels/rotary.cu compiles, and whether cos/sin/y are fp32 (kv_copy's
    /// output, wide).
    fn defines(op: KernelOp) -> Vec<String> {
        let backward = matches!(op, KernelOp::RotaryBwd | KernelOp::RotaryBwdWide);
        let wide = matches!(
            op,
            KernelOp::RotaryFwdWide | KernelOp::RotaryBwdWide | KernelOp::KvCopyWide
        );
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

fn is_kv_copy(op: KernelOp) -> bool {
    matches!(op, KernelOp::KvCopy | KernelOp::KvCopyWide)
}

/// torchfuse::kv_copy of one tensor (`call.q`; the glue makes one call per tensor) into a new
/// row-major tensor of `call.x_dtype`: its own dtype, or fp32 of a 16-bit x (wide). With
/// `call.out` given, into that view instead (x's sizes and the copy's dtype, no two elements
/// sharing memory): the linear node's gradient of the attention's heads written into the
/// columns its GEMM reads (`src/abi/glue/linear.cpp`), a copy as `copy_` makes it.
fn kv_copy(launch: Launch, call: &TfRotaryCall) -> Result<Served, StockReason> {
    let x = call.q.given().ok_or(StockReason::InvalidInput)?;
    let into = call.out.given();
    let x_kind = x.kind().ok_or(StockReason::UnsupportedDtype)?;
    let out_kind = kind_of_scalar_type(call.x_dtype).ok_or(StockReason::UnsupportedDtype)?;
    let wide = out_kind != x_kind;
    if wide && (out_kind != Kind::Float || x_kind == Kind::Float) {
        return Err(StockReason::MixedDtypes);
    }
    let dtype = dtype_of(x_kind).ok_or(StockReason::UnsupportedDtype)?;
    let device = gpu::torch_device(launch)?;
    let size = x.sizes();
    if size.len() != 4 || x.device() != device {
        return Err(StockReason::InvalidInput);
    }
    if let Some(o) = into {
        if o.sizes() != size || o.kind() != Some(out_kind) || o.device() != device {
            return Err(StockReason::InvalidInput);
        }
        if overlapping(o.sizes(), o.strides()) {
            return Err(StockReason::NotContiguous);
        }
    }
    let in_s = strides(x.strides()).ok_or(StockReason::NotContiguous)?;
    let (n1, n2, d) = (size[1], size[2], size[3]);
    let rows = size[0] * n1 * n2;
    if rows == 0 || d == 0 {
        return Err(StockReason::EmptyInput);
    }
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = super::select(launch, |sm| Request {
        op: if wide {
            KernelOp::KvCopyWide
        } else {
            KernelOp::KvCopy
        },
        dtype,
        hidden: d,
        rows,
        sm,
        deterministic: false,
        narrowed: false,
    })?;
    let p = Rotary::params(params)?;
    // The given view's strides, or row-major, as `empty` makes it.
    let out_s = match into {
        Some(o) => strides(o.strides()).ok_or(StockReason::NotContiguous)?,
        None => RopeStrides {
            s0: n1 * n2 * d,
            s1: n2 * d,
            s2: d,
        },
    };
    let mut op = RopeOperand {
        input: x.addr(),
        output: into.map_or(0, |o| o.addr()),
        n1,
        n2,
        rows,
        in_s,
        out_s,
        trig_s: out_s,
    };
    // The chunked path covers the whole row (d in place of rotary's half); rows it cannot take
    // (a head dim of no whole number of 16-byte chunks, an unaligned view) were not measured
    // against the glue's copy, which keeps them. Asked before a new output exists, its address
    // standing as 0: PyTorch's allocator starts every block 16-byte aligned (512 on CUDA).
    let group = lanes_per_row(d, d, &[&op], &[op.input, op.output]);
    if group == 0 {
        return Err(StockReason::NoVariantForShape);
    }
    let out = match into {
        Some(_) => None,
        None => {
            let out = empty(size, out_kind, device)?;
            op.output = device_addr(&out);
            if !aligned16([op.output]) {
                return Err(StockReason::NoVariantForShape);
            }
            Some(out)
        }
    };
    let config = row_launch(rows, group, p.threads)?;
    let kv_args = KvCopyArgs {
        x: op,
        d: i32::try_from(d).map_err(|_| StockReason::NoVariantForShape)?,
        group,
    };
    let stream = gpu.stream(launch);
    let kernel = kernels.get(KV_KERNEL)?;
    let mut args = stream.launch_builder(&kernel.function);
    args::push(&mut args, &kv_args);
    // SAFETY: kv_copy's parameters are KvCopyArgs's fields (the compile test checks); group > 0,
    // so every row starts 16-byte aligned in x and the output; every offset is within its
    // tensor (x's sizes and strides; the output of the same sizes, row-major or the given
    // view's strides, whose elements do not overlap); the dtypes are the module's; both live
    // until the stream is done with them (a given view is the caller's, held across the call).
    unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
    Ok(Served::new(variant.name.as_str(), [out, None, None]))
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
        let tensors = [0x7000_0000_u64];
        let aligned = operand(64);
        // Head dims 64, 128, 96, 512: halves of 4, 8, 6 and 32 chunks.
        assert_eq!(lanes_per_row(32, 64, &[&aligned], &tensors), 4);
        assert_eq!(lanes_per_row(64, 128, &[&aligned], &tensors), 8);
        assert_eq!(lanes_per_row(48, 96, &[&aligned], &tensors), 2);
        assert_eq!(lanes_per_row(256, 512, &[&aligned], &tensors), 32);
        // Partial rotary: Pythia's 16 of 64 features rotate (a half of one chunk), the rest
        // pass through by chunks too, the row's 8 chunks a lane each; a head dim of no whole
        // chunks takes the element path.
        assert_eq!(lanes_per_row(8, 64, &[&aligned], &tensors), 8);
        assert_eq!(lanes_per_row(32, 128, &[&aligned], &tensors), 16);
        assert_eq!(lanes_per_row(8, 60, &[&aligned], &tensors), 0);
        // A half not of whole chunks, a row stride off the chunk, a misaligned pointer.
        assert_eq!(lanes_per_row(36, 72, &[&aligned], &tensors), 0);
        assert_eq!(
            lanes_per_row(32, 64, &[&aligned, &operand(68)], &tensors),
            0
        );
        // ... unless that dim has one element (it never steps).
        let one_head = RopeOperand {
            n1: 1,
            rows: 4,
            ..operand(68)
        };
        assert_eq!(lanes_per_row(32, 64, &[&aligned, &one_head], &tensors), 4);
        assert_eq!(lanes_per_row(32, 64, &[&aligned], &[0x7000_0004]), 0);
    }

    #[test]
    fn cos_and_sin_broadcast_as_pytorch_broadcasts_them() {
        // [b, s, d] tables (contiguous, a slice, HF's cat of halves' view) against q shapes,
        // unsqueezed at HF's dims (1: [b, h, s, d] heads; 2: [b, s, h, d]).
        let table = Tensor::zeros([2, 5, 64], (Kind::Float, Device::Cpu));
        let tables = [
            table.shallow_clone(),
            table.narrow(2, 0, 32),
            table.narrow(0, 0, 1),
            table.narrow(0, 0, 1).squeeze_dim(0),
            table.transpose(0, 1),
        ];
        let shapes: [&[i64]; 7] = [
            &[1, 1, 5, 64],
            &[2, 3, 5, 64],
            &[2, 3, 5, 32],
            &[2, 5, 3, 64],
            &[1, 3, 5, 64],
            &[2, 3, 7, 64],
            &[3, 5, 64],
        ];
        for trig in &tables {
            let (size, stride) = (trig.size(), trig.stride());
            let facts = crate::abi::tensor::described(trig);
            for dim in [-4, -3, -2, -1, 0, 1, 2, 3, 4] {
                for shape in shapes {
                    let want = trig
                        .f_unsqueeze(dim)
                        .and_then(|t| t.f_expand(shape, false))
                        .ok()
                        .and_then(|t| strides(&t.stride()));
                    let got = trig_strides(&facts, dim, shape);
                    assert_eq!(
                        got.map(|s| (s.s0, s.s1, s.s2)),
                        want.map(|s| (s.s0, s.s1, s.s2)),
                        "{size:?} {stride:?} at {dim} to {shape:?}"
                    );
                }
            }
        }
    }

    fn overlaps(t: &Tensor) -> bool {
        overlapping(&t.size(), &t.stride())
    }

    #[test]
    fn overlapping_views_are_told_apart_from_strided_ones() {
        let x = Tensor::zeros([2, 3, 40], (Kind::Float, Device::Cpu));
        let transposed = Tensor::zeros([2, 5, 3, 80], (Kind::Float, Device::Cpu)).transpose(1, 2);
        assert!(!overlaps(&transposed.narrow(3, 0, 32))); // partial rotary's slice
        assert!(!overlaps(&x.unsqueeze(1))); // a size-1 dim's stride is no step
        assert!(overlaps(&x.unfold(-1, 16, 1).narrow(2, 0, 4))); // rows share elements
        assert!(overlaps(&x.unsqueeze(1).expand([2, 4, 3, 40], false))); // broadcast
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
