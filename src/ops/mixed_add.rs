//! `aten::add.Tensor` of an fp32 tensor and a 16-bit one of the same shape, alpha 1: the residual
//! add of a layer's bf16 output to an fp32 residual stream under autocast, through
//! kernels/mixed_add.cu (one vectorized pass), or why stock's add runs a call.

use super::elementwise;
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty};
use crate::abi::types::{TfMixedAddCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use tch::Kind;

/// The kernel of kernels/mixed_add.cu, by name.
const KERNEL: &str = "mixed_add";

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

    /// self + other, fp32.
    unsafe fn serve(
        _entry: Entry,
        launch: Launch,
        call: &TfMixedAddCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
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
        let Selected {
            gpu,
            variant,
            kernels,
            params,
        } = super::select(launch, |sm| Request {
            op: KernelOp::MixedAdd,
            dtype,
            hidden: 1,
            rows: n,
            sm,
            deterministic: false,
            narrowed: false,
        })?;
        let p = MixedAdd::params(params)?;
        let out = empty(shape, Kind::Float, device)?;
        let add_args = MixedAddArgs {
            a: a.addr(),
            b: b.addr(),
            out: device_addr(&out),
            n,
            vectorized: i32::from(aligned16([a.addr(), b.addr(), device_addr(&out)])),
        };
        let config = elementwise::launch_config(n, p)?;
        let stream = gpu.stream(launch);
        let mut args = stream.launch_builder(&kernels.get(KERNEL)?.function);
        args::push(&mut args, &add_args);
        // SAFETY: mixed_add's parameters are MixedAddArgs's fields (the compile test checks);
        // a, b and out are contiguous with n elements (fp32, the module's dtype, fp32), and live
        // until the stream is done with them (PyTorch's allocator orders reuse on it).
        unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
        Ok(Served::new(variant.name.as_str(), [Some(out), None, None]))
    }

    fn kernels(_op: KernelOp) -> &'static [&'static str] {
        &[KERNEL]
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        (kernel == KERNEL).then_some(MixedAddArgs::FIELDS)
    }

    fn defines(_op: KernelOp) -> Vec<String> {
        vec![elementwise::define()]
    }

    type Params = elementwise::Params;

    fn prepare(v: &Variant) -> Result<elementwise::Params, String> {
        elementwise::prepare(v)
    }
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
