//! The tanh GELU, forward and backward (`torchfuse::gelu_tanh[_backward]`, what the rewrite
//! layer sends HF's tanh-GELU compositions to), through kernels/gelu.cu, or why stock
//! (PyTorch's `gelu(approximate="tanh")`, in the glue) runs a call.

use super::elementwise;
use super::{Family, KernelOp, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty, kind_of_scalar_type};
use crate::abi::types::{TfGeluCall, TfTensor};
use crate::gpu::args::{kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use tch::Kind;

/// The kernels of kernels/gelu.cu, by name.
const FWD_KERNEL: &str = "gelu_tanh_fwd";
const BWD_KERNEL: &str = "gelu_tanh_bwd";

kernel_args! {
    /// gelu_tanh_fwd's arguments (kernels/gelu.cu): n contiguous elements.
    struct GeluFwdArgs {
        x: u64,
        y: u64,
        n: i64,
        vectorized: i32,
    }
}

kernel_args! {
    /// gelu_tanh_bwd's arguments (kernels/gelu.cu).
    struct GeluBwdArgs {
        dy: u64,
        x: u64,
        dx: u64,
        n: i64,
        vectorized: i32,
    }
}

pub struct Gelu;

impl Family for Gelu {
    type Call = TfGeluCall;

    const FAMILY: OpFamily = OpFamily::Gelu;

    unsafe fn unreadable(_entry: Entry, call: &TfGeluCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(&[&call.input, &call.grad_out], true)
    }

    unsafe fn describe(_entry: Entry, call: &TfGeluCall) -> Option<(&'static str, Vec<i64>)> {
        Some(describe(call.input.given()?))
    }

    /// Forward: y (in `out_dtype`). Backward: dx (in the input's dtype).
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfGeluCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        let input = call.input.given().ok_or(StockReason::InvalidInput)?;
        let x_kind = input.kind().ok_or(StockReason::UnsupportedDtype)?;
        // The other tensor's dtype: the forward's output, the backward's incoming gradient.
        let grad_out = call.grad_out.given();
        let other_kind = match (entry, grad_out) {
            (Entry::GeluTanh, _) => {
                kind_of_scalar_type(call.out_dtype).ok_or(StockReason::UnsupportedDtype)?
            }
            (_, Some(dy)) => dy.kind().ok_or(StockReason::UnsupportedDtype)?,
            (_, None) => return Err(StockReason::InvalidInput),
        };
        let dtype = dtype_of(x_kind).ok_or(StockReason::UnsupportedDtype)?;
        // The other tensor is in the input's dtype, or fp32 (autocast's form of HF's code).
        let wide = other_kind != x_kind;
        if wide && other_kind != Kind::Float {
            return Err(StockReason::MixedDtypes);
        }
        let backward = entry == Entry::GeluTanhBackward;
        let op = match (backward, wide) {
            (false, false) => KernelOp::GeluTanhFwd,
            (false, true) => KernelOp::GeluTanhFwdWide,
            (true, false) => KernelOp::GeluTanhBwd,
            (true, true) => KernelOp::GeluTanhBwdWide,
        };
        let device = gpu::torch_device(launch)?;
        if input.device() != device || !input.is_contiguous() {
            return Err(StockReason::NotContiguous);
        }
        if let Some(dy) = grad_out {
            if dy.sizes() != shape || dy.device() != device {
                return Err(StockReason::InvalidInput);
            }
            if !dy.is_contiguous() {
                return Err(StockReason::NotContiguous);
            }
        }
        let n = input.numel();
        if n == 0 {
            return Err(StockReason::EmptyInput);
        }
        let out_kind = if backward { x_kind } else { other_kind };
        let x_ptr = input.addr();
        let mut out = None;
        let mut made = || -> Result<u64, StockReason> {
            let t = empty(shape, out_kind, device)?;
            let ptr = device_addr(&t);
            out = Some(t);
            Ok(ptr)
        };
        // SAFETY: every tensor is contiguous with n elements of the dtype the module was compiled
        // for, and lives until the stream is done with it (PyTorch's allocator orders reuse on
        // it).
        let kernel = unsafe {
            // A backward call has its incoming gradient (checked above).
            match grad_out.map(TfTensor::addr) {
                Some(dy) if backward => {
                    elementwise::launch_pass::<Gelu, _>(launch, op, dtype, n, || {
                        let dx = made()?;
                        Ok(GeluBwdArgs {
                            dy,
                            x: x_ptr,
                            dx,
                            n,
                            vectorized: i32::from(aligned16([x_ptr, dx, dy])),
                        })
                    })
                }
                _ => elementwise::launch_pass::<Gelu, _>(launch, op, dtype, n, || {
                    let y = made()?;
                    Ok(GeluFwdArgs {
                        x: x_ptr,
                        y,
                        n,
                        vectorized: i32::from(aligned16([x_ptr, y, 0])),
                    })
                }),
            }
        }?;
        Ok(Served::new(kernel, [out, None, None]))
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if is_backward(op) {
            &[BWD_KERNEL]
        } else {
            &[FWD_KERNEL]
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            FWD_KERNEL => Some(GeluFwdArgs::FIELDS),
            BWD_KERNEL => Some(GeluBwdArgs::FIELDS),
            _ => None,
        }
    }

    /// Which kernel kernels/gelu.cu compiles, and whether the other tensor is fp32.
    fn defines(op: KernelOp) -> Vec<String> {
        let wide = matches!(op, KernelOp::GeluTanhFwdWide | KernelOp::GeluTanhBwdWide);
        vec![
            format!("-DTF_GELU_FWD={}", i32::from(!is_backward(op))),
            format!("-DTF_GELU_BWD={}", i32::from(is_backward(op))),
            format!("-DTF_WIDE={}", i32::from(wide)),
            elementwise::define(),
        ]
    }

    type Params = elementwise::Params;

    fn prepare(v: &Variant) -> Result<elementwise::Params, String> {
        elementwise::prepare(v)
    }
}

fn is_backward(op: KernelOp) -> bool {
    matches!(op, KernelOp::GeluTanhBwd | KernelOp::GeluTanhBwdWide)
}
