//! SwiGLU's pointwise part, forward and backward (`torchfuse::silu_mul[_backward]`, what the
//! rewrite layer sends HF's gated MLP to between its matmuls), through kernels/swiglu.cu, or
//! why stock (PyTorch's `silu(gate) * up` and its autograd ops, in the glue) runs a call.

use super::{elementwise, params};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty};
use crate::abi::types::{TfSwigluCall, TfTensor};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use cudarc::driver::PushKernelArg;
use serde::{Deserialize, Serialize};

/// The kernels of kernels/swiglu.cu, by name.
const FWD_KERNEL: &str = "silu_mul_fwd";
const BWD_KERNEL: &str = "silu_mul_bwd";

pub struct Swiglu;

impl Family for Swiglu {
    type Call = TfSwigluCall;

    const FAMILY: OpFamily = OpFamily::Swiglu;

    unsafe fn symbolic(call: &TfSwigluCall) -> Option<&TfTensor> {
        TfTensor::first_symbolic(&[&call.gate, &call.up, &call.grad_out])
    }

    unsafe fn describe(_entry: Entry, call: &TfSwigluCall) -> Option<(&'static str, Vec<i64>)> {
        let gate = call.gate.borrow()?;
        Some(describe(Some(&gate)))
    }

    /// Forward: y. Backward: dgate, dup. Every tensor has the gate's dtype and shape.
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfSwigluCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        let gate = call.gate.borrow().ok_or(StockReason::InvalidInput)?;
        let up = call.up.borrow().ok_or(StockReason::InvalidInput)?;
        let backward = entry == Entry::SiluMulBackward;
        let grad_out = call.grad_out.borrow();
        if backward && grad_out.is_none() {
            return Err(StockReason::InvalidInput);
        }
        let kind = gate.f_kind().map_err(|_| StockReason::UnsupportedDtype)?;
        let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
        let device = gpu::torch_device(launch)?;
        let mut others = vec![&*up];
        if let Some(dy) = &grad_out {
            others.push(dy);
        }
        for t in std::iter::once(&*gate).chain(others.iter().copied()) {
            if t.size() != shape || t.device() != device {
                return Err(StockReason::InvalidInput); // broadcasting: stock's
            }
            if t.f_kind().ok() != Some(kind) {
                return Err(StockReason::MixedDtypes);
            }
            if !t.is_contiguous() {
                return Err(StockReason::NotContiguous);
            }
        }
        let n = gate.numel() as i64;
        if n == 0 {
            return Err(StockReason::EmptyInput);
        }
        let op = if backward {
            KernelOp::SiluMulBwd
        } else {
            KernelOp::SiluMulFwd
        };
        let Selected {
            gpu,
            variant,
            kernels,
            params,
        } = super::select(launch, |sm| Request {
            op,
            dtype,
            hidden: 1,
            rows: n,
            sm,
            deterministic: false,
        })?;
        let p = Swiglu::params(params)?;
        let config = elementwise::launch_config(n, p.threads, p.chunks)?;
        let stream = gpu.stream(launch);
        let (gate_ptr, up_ptr) = (device_addr(&gate), device_addr(&up));
        if let Some(dy) = &grad_out {
            let dgate = empty(shape, kind, device)?;
            let dup = empty(shape, kind, device)?;
            let vectorized = i32::from(aligned16([&*gate, &*up, &**dy, &dgate, &dup]));
            let ptrs = [
                device_addr(dy),
                gate_ptr,
                up_ptr,
                device_addr(&dgate),
                device_addr(&dup),
            ];
            let kernel = kernels.get(BWD_KERNEL)?;
            let mut args = stream.launch_builder(&kernel.function);
            for ptr in &ptrs {
                args.arg(ptr);
            }
            args.arg(&n).arg(&vectorized);
            // SAFETY: argument types and order match silu_mul_bwd (dy, gate, up, dgate, dup, n,
            // vectorized); every tensor is contiguous with n elements of the module's dtype and
            // lives until the stream is done with it (PyTorch's allocator orders reuse on it).
            unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
            return Ok(Served::new(
                variant.name.as_str(),
                [Some(dgate), Some(dup), None],
            ));
        }
        let y = empty(shape, kind, device)?;
        let vectorized = i32::from(aligned16([&*gate, &*up, &y]));
        let y_ptr = device_addr(&y);
        let kernel = kernels.get(FWD_KERNEL)?;
        let mut args = stream.launch_builder(&kernel.function);
        args.arg(&gate_ptr)
            .arg(&up_ptr)
            .arg(&y_ptr)
            .arg(&n)
            .arg(&vectorized);
        // SAFETY: argument types and order match silu_mul_fwd (gate, up, y, n, vectorized);
        // as the backward's.
        unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
        Ok(Served::new(variant.name.as_str(), [Some(y), None, None]))
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if op == KernelOp::SiluMulBwd {
            &[BWD_KERNEL]
        } else {
            &[FWD_KERNEL]
        }
    }

    /// Which kernel kernels/swiglu.cu compiles.
    fn defines(op: KernelOp) -> Vec<String> {
        let backward = op == KernelOp::SiluMulBwd;
        vec![
            format!("-DTF_SWIGLU_FWD={}", i32::from(!backward)),
            format!("-DTF_SWIGLU_BWD={}", i32::from(backward)),
            elementwise::define(),
        ]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        let p: Params = params::parse(v)?;
        params::one_of(v, "THREADS", p.threads, &[128, 256, 512, 1024])?;
        params::in_range(v, "CHUNKS", p.chunks, 1..=8)?;
        Ok(p)
    }
}

/// A swiglu variant's compile-time params (`registry/swiglu.toml`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Threads per CTA.
    threads: i64,
    /// Chunks of 8 elements per thread.
    chunks: i64,
}
