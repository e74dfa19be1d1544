//! `aten::add.Tensor` of an fp32 tensor and a 16-bit one of the same shape, alpha 1: the residual
//! add of a layer's bf16 output to an fp32 residual stream under autocast, through
//! kernels/mixed_add.cu (one vectorized pass), or why stock's add runs a call; and `aten::copy_`
//! of a 16-bit tensor into an fp32 one of the same layout (autocast's casts back in the
//! backward), the same way.

use super::elementwise;
use super::{Family, KernelOp, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty};
use crate::abi::types::{TfMixedAddCall, TfTensor};
use crate::gpu::args::{kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use tch::Kind;

/// The kernels of kernels/mixed_add.cu, by name.
const KERNEL: &str = "mixed_add";
const COPY_KERNEL: &str = "mixed_copy";

kernel_args! {
    /// mixed_add's arguments (kernels/mixed_add.cu): n contiguous elements.
    struct MixedAddArgs {
        a: u64,
        b: u64,
        out: u64,
        n: i64,
        vectorized: i32,
    }
}

kernel_args! {
    /// mixed_copy's arguments (kernels/mixed_add.cu): n elements of one dense layout.
    struct MixedCopyArgs {
        b: u64,
        out: u64,
        n: i64,
        vectorized: i32,
    }
}

/// Which of two dtypes is the fp32 operand's: `Some(true)` when self is fp32 and other 16-bit,
/// `Some(false)` for the other way round, None for any other pair (one dtype, fp64, integers,
/// bf16 with fp16: promotions stock keeps).
pub fn fp32_first(self_kind: Kind, other_kind: Kind) -> Option<bool> {
    let half = |k: Kind| matches!(k, Kind::BFloat16 | Kind::Half);
    match (self_kind, other_kind) {
        (Kind::Float, k) if half(k) => Some(true),
        (k, Kind::Float) if half(k) => Some(false),
        _ => None,
    }
}

pub struct MixedAdd;

impl Family for MixedAdd {
    type Call = TfMixedAddCall;

    const FAMILY: OpFamily = OpFamily::MixedAdd;

    unsafe fn unreadable(_entry: Entry, call: &TfMixedAddCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(&[&call.self_, &call.other], true)
    }

    unsafe fn describe(_entry: Entry, call: &TfMixedAddCall) -> Option<(&'static str, Vec<i64>)> {
        Some(describe(call.self_.given()?))
    }

    /// self + other, fp32; for copy_, other written into self (no outputs).
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfMixedAddCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        if entry == Entry::MixedCopy {
            return mixed_copy(launch, call);
        }
        let self_ = call.self_.given().ok_or(StockReason::InvalidInput)?;
        let other = call.other.given().ok_or(StockReason::InvalidInput)?;
        let self_kind = self_.kind().ok_or(StockReason::UnsupportedDtype)?;
        let other_kind = other.kind().ok_or(StockReason::UnsupportedDtype)?;
        let first = fp32_first(self_kind, other_kind).ok_or(StockReason::MixedDtypes)?;
        // Broadcasting, or an alpha other than 1 (stock's multiply-add): forms not served.
        if other.sizes() != shape || call.alpha_is_one == 0 {
            return Err(StockReason::FormNotServed);
        }
        // a: the fp32 tensor, b: the 16-bit one (the kernel's dtype).
        let (a, b, b_kind) = if first {
            (self_, other, other_kind)
        } else {
            (other, self_, self_kind)
        };
        let device = gpu::torch_device(launch)?;
        if a.device() != device || b.device() != device {
            return Err(StockReason::InvalidInput);
        }
        if !a.is_contiguous() || !b.is_contiguous() {
            return Err(StockReason::NotContiguous);
        }
        let n = a.numel();
        if n == 0 {
            return Err(StockReason::EmptyInput);
        }
        let dtype = dtype_of(b_kind).ok_or(StockReason::UnsupportedDtype)?;
        let mut out = None;
        // SAFETY: a, b and the output are contiguous with n elements (fp32, the 16-bit dtype,
        // fp32), and live until the stream is done with them (PyTorch's allocator orders reuse
        // on it).
        let kernel = unsafe {
            elementwise::launch_pass::<MixedAdd, _>(launch, KernelOp::MixedAdd, dtype, n, || {
                let made = empty(shape, Kind::Float, device)?;
                let addr = device_addr(&made);
                out = Some(made);
                Ok(MixedAddArgs {
                    a: a.addr(),
                    b: b.addr(),
                    out: addr,
                    n,
                    vectorized: i32::from(aligned16([a.addr(), b.addr(), addr])),
                })
            })
        }?;
        Ok(Served::new(kernel, [out, None, None]))
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if op == KernelOp::MixedCopy {
            &[COPY_KERNEL]
        } else {
            &[KERNEL]
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            KERNEL => Some(MixedAddArgs::FIELDS),
            COPY_KERNEL => Some(MixedCopyArgs::FIELDS),
            _ => None,
        }
    }

    fn defines(_op: KernelOp) -> Vec<String> {
        vec![elementwise::define()]
    }

    type Params = elementwise::Params;

    fn prepare(v: &Variant) -> Result<elementwise::Params, String> {
        elementwise::prepare(v)
    }
}

/// copy_ of `call.other` (bf16/fp16) into `call.self_` (fp32): the glue sends only CUDA tensors
/// of one device, sizes and strides, self dense and not sharing memory with other, so that both
/// are the same permutation of n consecutive elements.
fn mixed_copy(launch: Launch, call: &TfMixedAddCall) -> Result<Served, StockReason> {
    let out = call.self_.given().ok_or(StockReason::InvalidInput)?;
    let src = call.other.given().ok_or(StockReason::InvalidInput)?;
    let src_kind = src.kind().ok_or(StockReason::UnsupportedDtype)?;
    if fp32_first(out.kind().ok_or(StockReason::UnsupportedDtype)?, src_kind) != Some(true) {
        return Err(StockReason::MixedDtypes);
    }
    let device = gpu::torch_device(launch)?;
    if out.device() != device || src.device() != device {
        return Err(StockReason::InvalidInput);
    }
    if out.sizes() != src.sizes() || out.strides() != src.strides() {
        return Err(StockReason::FormNotServed);
    }
    if out.dense == 0 || src.dense == 0 {
        return Err(StockReason::NotContiguous);
    }
    let n = out.numel();
    if n == 0 {
        return Err(StockReason::EmptyInput);
    }
    let dtype = dtype_of(src_kind).ok_or(StockReason::UnsupportedDtype)?;
    // SAFETY: src and out are dense with the same sizes and strides, so each spans n
    // consecutive elements from its data pointer (the 16-bit dtype, fp32), in separate
    // storages; both live until the stream is done with them (the caller's, held across the
    // call).
    let kernel = unsafe {
        elementwise::launch_pass::<MixedAdd, _>(launch, KernelOp::MixedCopy, dtype, n, || {
            Ok(MixedCopyArgs {
                b: src.addr(),
                out: out.addr(),
                n,
                vectorized: i32::from(aligned16([src.addr(), out.addr()])),
            })
        })
    }?;
    Ok(Served::new(kernel, [None, None, None]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_fp32_with_a_16_bit_tensor_either_way_round_is_served() {
        assert_eq!(fp32_first(Kind::Float, Kind::BFloat16), Some(true));
        assert_eq!(fp32_first(Kind::Half, Kind::Float), Some(false));
        for (a, b) in [
            (Kind::Float, Kind::Float),
            (Kind::BFloat16, Kind::BFloat16),
            (Kind::BFloat16, Kind::Half),
            (Kind::Double, Kind::BFloat16),
            (Kind::Float, Kind::Double),
            (Kind::Float, Kind::Int64),
            (Kind::Bool, Kind::Float),
        ] {
            assert_eq!(fp32_first(a, b), None, "{a:?} + {b:?}");
        }
    }
}
