//! The gated MLPs' pointwise part, forward and backward (`torchfuse::silu_mul[_backward]`, what
//! the rewrite layer sends HF's gated MLP to between its matmuls; `silu_mul_packed[_backward]`,
//! the same of the two halves of one tensor: Phi-3's gate_up_proj output;
//! `gelu_tanh_mul[_backward]`, GeGLU: Gemma's, a tanh-GELU gate), through kernels/swiglu.cu, or
//! why stock (PyTorch's `act(gate) * up` and its autograd ops, in the glue) runs a call.

use super::elementwise;
use super::{Family, KernelOp, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty};
use crate::abi::types::{TfSwigluCall, TfTensor};
use crate::gpu::args::{kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};

/// The kernels of kernels/swiglu.cu, by name: SwiGLU's, then GeGLU's (TF_GATE_GELU).
const FWD_KERNEL: &str = "silu_mul_fwd";
const BWD_KERNEL: &str = "silu_mul_bwd";
const GELU_FWD_KERNEL: &str = "gelu_tanh_mul_fwd";
const GELU_BWD_KERNEL: &str = "gelu_tanh_mul_bwd";

kernel_args! {
    /// silu_mul_fwd's and gelu_tanh_mul_fwd's arguments (kernels/swiglu.cu): n output
    /// elements, rows of `width` `stride` apart in gate and up.
    struct GatedFwdArgs {
        gate: u64,
        up: u64,
        y: u64,
        n: i64,
        vectorized: i32,
        width: i64,
        stride: i64,
    }
}

kernel_args! {
    /// silu_mul_bwd's and gelu_tanh_mul_bwd's arguments (kernels/swiglu.cu).
    struct GatedBwdArgs {
        dy: u64,
        gate: u64,
        up: u64,
        dgate: u64,
        dup: u64,
        n: i64,
        vectorized: i32,
        width: i64,
        stride: i64,
    }
}

pub struct Swiglu;

impl Family for Swiglu {
    type Call = TfSwigluCall;

    const FAMILY: OpFamily = OpFamily::Swiglu;

    unsafe fn unreadable(_entry: Entry, call: &TfSwigluCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(&[&call.gate, &call.up, &call.grad_out], true)
    }

    unsafe fn describe(_entry: Entry, call: &TfSwigluCall) -> Option<(&'static str, Vec<i64>)> {
        Some(describe(call.gate.given()?))
    }

    /// silu_mul, gelu_tanh_mul: forward y; backward dgate, dup, every tensor of the gate's
    /// dtype and shape. silu_mul_packed (gate and up the halves of one [.., 2 w] tensor):
    /// forward y [.., w]; backward the gradient of the packed tensor, whole.
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfSwigluCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        let packed = matches!(entry, Entry::SiluMulPacked | Entry::SiluMulPackedBackward);
        let backward = matches!(
            entry,
            Entry::SiluMulBackward | Entry::SiluMulPackedBackward | Entry::GeluTanhMulBackward
        );
        let gelu = matches!(entry, Entry::GeluTanhMul | Entry::GeluTanhMulBackward);
        let gate = call.gate.given().ok_or(StockReason::InvalidInput)?;
        let up = call.up.given();
        let grad_out = call.grad_out.given();
        if (backward && grad_out.is_none()) || (!packed && up.is_none()) {
            return Err(StockReason::InvalidInput);
        }
        let kind = gate.kind().ok_or(StockReason::UnsupportedDtype)?;
        let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
        let device = gpu::torch_device(launch)?;
        let layout = Layout::of(packed, shape)?;
        let out_shape = layout.out_shape(shape);
        let others = [(up, shape), (grad_out, &out_shape[..])];
        let present = others.into_iter().filter_map(|(t, want)| Some((t?, want)));
        for (t, want) in std::iter::once((gate, shape)).chain(present) {
            if t.sizes() != want || t.device() != device {
                return Err(StockReason::InvalidInput); // broadcasting: stock's
            }
            if t.kind() != Some(kind) {
                return Err(StockReason::MixedDtypes);
            }
            if !t.is_contiguous() {
                return Err(StockReason::NotContiguous);
            }
        }
        if layout.n == 0 {
            return Err(StockReason::EmptyInput);
        }
        let op = match (gelu, backward) {
            (false, false) => KernelOp::SiluMulFwd,
            (false, true) => KernelOp::SiluMulBwd,
            (true, false) => KernelOp::GeluTanhMulFwd,
            (true, true) => KernelOp::GeluTanhMulBwd,
        };
        let up_offset = layout.up_offset * kind.elt_size_in_bytes() as u64;
        let gate_ptr = gate.addr();
        let up_ptr = up.map_or(gate_ptr + up_offset, TfTensor::addr);
        let (n, width, stride) = (layout.n, layout.width, layout.stride);
        if let Some(dy) = grad_out {
            // silu_mul: dgate and dup; silu_mul_packed: one tensor of gate_up's shape, both.
            let (mut dgate, mut dup) = (None, None);
            // SAFETY: dy is contiguous with n elements, gate, up, dgate and dup hold n / width
            // rows of width elements stride apart inside their tensors (the layout checked
            // above), all of the op's dtype, and live until the stream is done with them
            // (PyTorch's allocator orders reuse on it).
            let kernel = unsafe {
                elementwise::launch_pass::<Swiglu, _>(launch, op, dtype, n, || {
                    let dgate_t = empty(shape, kind, device)?;
                    let dup_t = if packed {
                        None
                    } else {
                        Some(empty(shape, kind, device)?)
                    };
                    let dgate_ptr = device_addr(&dgate_t);
                    let dup_ptr = dup_t.as_ref().map_or(dgate_ptr + up_offset, device_addr);
                    // Packed, up's and dup's place inside their tensors is the layout's to align.
                    let dense = [gate_ptr, up.map_or(0, TfTensor::addr), dy.addr(), dgate_ptr];
                    let dense = dense.into_iter().chain(dup_t.as_ref().map(device_addr));
                    let vectorized = i32::from(layout.vectorizable() && aligned16(dense));
                    (dgate, dup) = (Some(dgate_t), dup_t);
                    Ok(GatedBwdArgs {
                        dy: dy.addr(),
                        gate: gate_ptr,
                        up: up_ptr,
                        dgate: dgate_ptr,
                        dup: dup_ptr,
                        n,
                        vectorized,
                        width,
                        stride,
                    })
                })
            }?;
            return Ok(Served::new(kernel, [dgate, dup, None]));
        }
        let mut y = None;
        // SAFETY: as the backward's: gate and up hold their rows inside their tensors, y is
        // contiguous with n elements.
        let kernel = unsafe {
            elementwise::launch_pass::<Swiglu, _>(launch, op, dtype, n, || {
                let y_t = empty(&out_shape, kind, device)?;
                let y_ptr = device_addr(&y_t);
                let dense = [gate_ptr, up.map_or(0, TfTensor::addr), y_ptr];
                let vectorized = i32::from(layout.vectorizable() && aligned16(dense));
                y = Some(y_t);
                Ok(GatedFwdArgs {
                    gate: gate_ptr,
                    up: up_ptr,
                    y: y_ptr,
                    n,
                    vectorized,
                    width,
                    stride,
                })
            })
        }?;
        Ok(Served::new(kernel, [y, None, None]))
    }

    /// The op's one kernel.
    fn kernels(op: KernelOp) -> &'static [&'static str] {
        match op {
            KernelOp::SiluMulFwd => &[FWD_KERNEL],
            KernelOp::SiluMulBwd => &[BWD_KERNEL],
            KernelOp::GeluTanhMulFwd => &[GELU_FWD_KERNEL],
            _ => &[GELU_BWD_KERNEL],
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            FWD_KERNEL | GELU_FWD_KERNEL => Some(GatedFwdArgs::FIELDS),
            BWD_KERNEL | GELU_BWD_KERNEL => Some(GatedBwdArgs::FIELDS),
            _ => None,
        }
    }

    /// Which kernel kernels/swiglu.cu compiles, and its gate's activation.
    fn defines(op: KernelOp) -> Vec<String> {
        let backward = matches!(op, KernelOp::SiluMulBwd | KernelOp::GeluTanhMulBwd);
        let gelu = matches!(op, KernelOp::GeluTanhMulFwd | KernelOp::GeluTanhMulBwd);
        vec![
            format!("-DTF_SWIGLU_FWD={}", i32::from(!backward)),
            format!("-DTF_SWIGLU_BWD={}", i32::from(backward)),
            format!("-DTF_GATE_GELU={}", i32::from(gelu)),
            elementwise::define(),
        ]
    }

    type Params = elementwise::Params;

    fn prepare(v: &Variant) -> Result<elementwise::Params, String> {
        elementwise::prepare(v)
    }
}

/// Where an op's gate and up lie, for the kernels: `n` elements of y, in rows of `width`
/// elements `stride` apart in gate and up (and dgate and dup); up starts `up_offset` elements
/// after gate (silu_mul: separate dense tensors, one row of n; silu_mul_packed: the halves of
/// each row of one [.., 2 w] tensor).
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    n: i64,
    width: i64,
    stride: i64,
    up_offset: u64,
}

impl Layout {
    /// `shape`: the gate's (silu_mul) or the packed tensor's (silu_mul_packed).
    fn of(packed: bool, shape: &[i64]) -> Result<Layout, StockReason> {
        let numel: i64 = shape.iter().product();
        if !packed {
            return Ok(Layout {
                n: numel,
                width: numel.max(1),
                stride: numel.max(1),
                up_offset: 0,
            });
        }
        // An odd last dim is chunked unevenly: the composition's (and its error) then.
        match shape.last() {
            Some(&last) if last % 2 == 0 && last > 0 => Ok(Layout {
                n: numel / 2,
                width: last / 2,
                stride: last,
                up_offset: (last / 2) as u64,
            }),
            _ => Err(StockReason::InvalidInput),
        }
    }

    /// y's (and dy's) shape: the gate's, or the packed tensor's with half its last dim.
    fn out_shape(&self, shape: &[i64]) -> Vec<i64> {
        let mut out = shape.to_vec();
        if let (true, Some(last)) = (self.up_offset > 0, out.last_mut()) {
            *last = self.width;
        }
        out
    }

    /// 16-byte accesses need chunks of 8 that stay in a row, and up's start aligned like gate's.
    fn vectorizable(&self) -> bool {
        self.stride == self.width || self.width % 8 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_tensor_is_two_halves_of_each_row() {
        let packed = Layout::of(true, &[4, 3, 16]).expect("even last dim");
        assert_eq!(
            packed,
            Layout {
                n: 96,
                width: 8,
                stride: 16,
                up_offset: 8
            }
        );
        assert_eq!(packed.out_shape(&[4, 3, 16]), vec![4, 3, 8]);
        assert!(packed.vectorizable());
        // Halves of 7: element by element (a chunk of 8 would cross into up).
        assert!(!Layout::of(true, &[2, 14]).expect("even").vectorizable());
        // Chunked unevenly, or nothing to chunk: the composition's.
        assert_eq!(Layout::of(true, &[2, 5]), Err(StockReason::InvalidInput));
        assert_eq!(Layout::of(true, &[]), Err(StockReason::InvalidInput));
        assert_eq!(Layout::of(true, &[3, 0]), Err(StockReason::InvalidInput));
    }

    #[test]
    fn separate_tensors_are_one_dense_row() {
        let dense = Layout::of(false, &[4, 5]).expect("any shape");
        assert_eq!(
            (dense.n, dense.width, dense.stride, dense.up_offset),
            (20, 20, 20, 0)
        );
        assert_eq!(dense.out_shape(&[4, 5]), vec![4, 5]);
        assert!(dense.vectorizable());
    }
}
