//! The `extern "C"` entry points the C++ glue calls for each overridden aten op.
//!
//! Each entry point catches panics: a bug in torchfuse makes the call go to stock (with one
//! warning), never unwinds into PyTorch.

use super::tensor::{borrow, describe, into_raw};
use crate::gpu::Launch;
use crate::ops::attention::AttentionCallC;
use crate::ops::norm::{BackwardCall, ForwardCall, NormKind};
use crate::runtime::stats::{self, Outcome};
use crate::runtime::Entry;
use crate::select::{kind_name, StockReason};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tch::Tensor;

const FUSED: i32 = 1;
const STOCK: i32 = 0;
/// Bad input refused with an error (stock would crash on it).
const ERROR: i32 = 2;

/// What a fused call hands back: up to three outputs (None = an undefined tensor).
struct Served {
    outputs: [Option<Tensor>; 3],
    kernel: &'static str,
}

/// Runs `body` for one call of `entry` unless the op is switched off, records the outcome,
/// and writes the outputs to `out` (three slots) when a kernel served the call.
///
/// # Safety
/// `primary` is a valid `at::Tensor`; `out` has room for three pointers.
unsafe fn serve(
    entry: Entry,
    primary: *const c_void,
    out: *mut *mut c_void,
    body: impl FnOnce(&Tensor, &[i64]) -> Result<Served, StockReason>,
) -> i32 {
    let Some(tensor) = borrow(primary) else {
        return STOCK;
    };
    serve_described(
        entry,
        || Some(describe(Some(&tensor))),
        out,
        |shape| body(&tensor, shape),
    )
}

/// `serve` for calls whose log line is not one tensor's: `describe` gives the dtype name and
/// shape the stats and logs show (None: not a call to serve). `out` may be null when the op
/// has no outputs (in-place ops).
///
/// # Safety
/// `out` is null or has room for three pointers.
unsafe fn serve_described(
    entry: Entry,
    describe: impl FnOnce() -> Option<(&'static str, Vec<i64>)>,
    out: *mut *mut c_void,
    body: impl FnOnce(&[i64]) -> Result<Served, StockReason>,
) -> i32 {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let (dtype, shape) = describe()?;
        let outcome = if entry.toggle().active() {
            body(&shape)
        } else {
            Err(StockReason::DisabledAtRuntime)
        };
        Some((dtype, shape, outcome))
    }));
    match result {
        Ok(Some((dtype, shape, Ok(served)))) => {
            stats::record(entry, Outcome::Fused(served.kernel), dtype, &shape);
            if !out.is_null() {
                for (i, t) in served.outputs.into_iter().enumerate() {
                    *out.add(i) = t.map_or(std::ptr::null_mut(), into_raw);
                }
            }
            FUSED
        }
        Ok(Some((dtype, shape, Err(reason)))) => {
            stats::record(entry, Outcome::Stock(reason), dtype, &shape);
            STOCK
        }
        Ok(None) => STOCK,
        Err(payload) => {
            super::lifecycle::warn_internal_error(entry, &*payload);
            STOCK
        }
    }
}

fn norm_kind(rms: bool) -> NormKind {
    if rms {
        NormKind::Rms
    } else {
        NormKind::Layer
    }
}

/// `native_layer_norm` (rms = false: outputs y, mean, rstd) or `_fused_rms_norm` (rms = true:
/// outputs y, rstd).
///
/// # Safety
/// Pointers are as shim.cpp passes them: valid `at::Tensor`s (or null for absent optional
/// ones), `normalized_shape` with `normalized_ndim` elements, `out` with room for 3.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_norm_fwd(
    rms: bool,
    launch: *const Launch,
    input: *const c_void,
    normalized_shape: *const i64,
    normalized_ndim: usize,
    weight: *const c_void,
    bias: *const c_void,
    eps: f64,
    has_eps: bool,
    out: *mut *mut c_void,
) -> i32 {
    let kind = norm_kind(rms);
    let entry = if rms {
        Entry::FusedRmsNorm
    } else {
        Entry::NativeLayerNorm
    };
    serve(entry, input, out, |input, shape| {
        let (weight, bias) = (borrow(weight), borrow(bias));
        let call = ForwardCall {
            kind,
            input,
            shape,
            normalized_shape: std::slice::from_raw_parts(normalized_shape, normalized_ndim),
            weight: weight.as_deref(),
            bias: bias.as_deref(),
            eps: has_eps.then_some(eps),
        };
        let fwd = crate::ops::norm::forward(*launch, &call)?;
        Ok(Served {
            outputs: match kind {
                NormKind::Layer => [Some(fwd.y), fwd.mean, Some(fwd.rstd)],
                NormKind::Rms => [Some(fwd.y), Some(fwd.rstd), None],
            },
            kernel: fwd.kernel,
        })
    })
}

/// `native_layer_norm_backward` (outputs dx, dweight, dbias) or `_fused_rms_norm_backward`
/// (outputs dx, dweight). `output_mask` bit i asks for output i. Outputs not asked for are
/// null (undefined tensors).
///
/// # Safety
/// As `torchfuse_rs_norm_fwd`; `mean` is null for RMSNorm.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_norm_bwd(
    rms: bool,
    launch: *const Launch,
    grad_out: *const c_void,
    input: *const c_void,
    normalized_shape: *const i64,
    normalized_ndim: usize,
    mean: *const c_void,
    rstd: *const c_void,
    weight: *const c_void,
    bias: *const c_void,
    output_mask: u32,
    out: *mut *mut c_void,
) -> i32 {
    let kind = norm_kind(rms);
    let entry = if rms {
        Entry::FusedRmsNormBackward
    } else {
        Entry::NativeLayerNormBackward
    };
    serve(entry, input, out, |input, shape| {
        let (grad_out, mean, weight, bias) =
            (borrow(grad_out), borrow(mean), borrow(weight), borrow(bias));
        let rstd = borrow(rstd).ok_or(StockReason::InvalidInput)?;
        let grad_out = grad_out.ok_or(StockReason::InvalidInput)?;
        let call = BackwardCall {
            kind,
            grad_out: &grad_out,
            input,
            shape,
            normalized_shape: std::slice::from_raw_parts(normalized_shape, normalized_ndim),
            mean: mean.as_deref(),
            rstd: &rstd,
            weight: weight.as_deref(),
            bias: bias.as_deref(),
            output_mask: [0, 1, 2].map(|bit| output_mask & (1 << bit) != 0),
        };
        let bwd = crate::ops::norm::backward(*launch, &call)?;
        Ok(Served {
            outputs: [bwd.dx, bwd.dweight, bwd.dbias],
            kernel: bwd.kernel,
        })
    })
}

/// `_fused_adam_` / `_fused_adamw_` (either lr overload, `entry` says which): updates the
/// params and moments in place. 1: done; 0: stock must run the call; 2: refused as bad input
/// (`call.error` says why; shim.cpp raises it).
///
/// # Safety
/// `launch` and `call` are valid; `call`'s lists are as `AdamCall::from_c` requires.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_adam(
    entry: u32,
    launch: *const Launch,
    call: *mut crate::ops::adam::AdamCallC,
) -> i32 {
    let Some(entry) = Entry::from_u32(entry) else {
        return STOCK;
    };
    let (Some(launch), Some(call_c)) = (launch.as_ref(), call.as_mut()) else {
        return STOCK;
    };
    let refused = catch_unwind(AssertUnwindSafe(|| {
        crate::ops::adam::list_length_error(call_c, entry.aten_name())
    }));
    if let Ok(Some(message)) = refused {
        let bytes = message.as_bytes();
        let n = bytes.len().min(call_c.error.len() - 1);
        call_c.error[..n].copy_from_slice(&bytes[..n]);
        call_c.error[n] = 0;
        return ERROR;
    }
    let call = crate::ops::adam::AdamCall::from_c(call_c);
    serve_described(
        entry,
        || Some(call.describe()),
        std::ptr::null_mut(),
        |_| {
            let kernel = crate::ops::adam::step(*launch, &call)?;
            Ok(Served {
                outputs: [None, None, None],
                kernel,
            })
        },
    )
}

/// The dtype name and shape a call is logged and counted under.
fn described(dtype_of: &Tensor, shape: Vec<i64>) -> Option<(&'static str, Vec<i64>)> {
    Some((kind_name(dtype_of.f_kind().ok()), shape))
}

/// `embedding(weight, indices, ...)`: out[0] = the gathered rows, shape indices + [D].
///
/// # Safety
/// `launch` is valid; `weight` and `indices` are valid `at::Tensor`s; `out` has room for 3.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_embedding(
    launch: *const Launch,
    weight: *const c_void,
    indices: *const c_void,
    out: *mut *mut c_void,
) -> i32 {
    let (Some(launch), Some(weight), Some(indices)) =
        (launch.as_ref(), borrow(weight), borrow(indices))
    else {
        return STOCK;
    };
    serve_described(
        Entry::Embedding,
        || {
            let mut shape = indices.size();
            shape.extend(weight.size().get(1));
            described(&weight, shape)
        },
        out,
        |_| {
            let fwd = crate::ops::embedding::forward(*launch, &weight, &indices)?;
            Ok(Served {
                outputs: [Some(fwd.output), None, None],
                kernel: fwd.kernel,
            })
        },
    )
}

/// `embedding_dense_backward`: out[0] = grad_weight [num_weights, D].
///
/// # Safety
/// As `torchfuse_rs_embedding`, with `grad` and `indices`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_embedding_backward(
    launch: *const Launch,
    grad: *const c_void,
    indices: *const c_void,
    num_weights: i64,
    padding_idx: i64,
    scale_grad_by_freq: bool,
    out: *mut *mut c_void,
) -> i32 {
    let (Some(launch), Some(grad), Some(indices)) =
        (launch.as_ref(), borrow(grad), borrow(indices))
    else {
        return STOCK;
    };
    serve_described(
        Entry::EmbeddingDenseBackward,
        || described(&grad, grad.size()),
        out,
        |_| {
            let call = crate::ops::embedding::BackwardCall {
                grad: &grad,
                indices: &indices,
                num_weights,
                padding_idx,
                scale_grad_by_freq,
            };
            let bwd = crate::ops::embedding::backward(*launch, &call)?;
            Ok(Served {
                outputs: [Some(bwd.output), None, None],
                kernel: bwd.kernel,
            })
        },
    )
}

/// The SDPA backend choice: 1 (flash, which torchfuse serves) for the calls `plan` takes,
/// stock's answer otherwise. Only a fused backend of stock's (1 flash, 2 efficient, 3 cuDNN)
/// is replaced: an error (-1) or a math fallback (0) stays stock's.
///
/// # Safety
/// `launch` and `call` are valid, with valid tensor pointers.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_sdp_choice(
    launch: *const Launch,
    call: *const AttentionCallC,
    stock_choice: i64,
) -> i64 {
    const FLASH: i64 = 1;
    let (Some(launch), Some(call)) = (launch.as_ref(), call.as_ref()) else {
        return stock_choice;
    };
    let answer = serve_described(
        Entry::SdpChoice,
        || crate::ops::attention::describe(call),
        std::ptr::null_mut(),
        |_| {
            if !(1..=3).contains(&stock_choice) {
                return Err(StockReason::AttentionFeature);
            }
            let plan = crate::ops::attention::plan(*launch, call)?;
            Ok(Served {
                outputs: [None, None, None],
                kernel: plan.kernel(),
            })
        },
    );
    if answer == FUSED {
        FLASH
    } else {
        stock_choice
    }
}

/// `_scaled_dot_product_flash_attention`: out[0] = output, out[1] = logsumexp.
///
/// # Safety
/// As `torchfuse_rs_sdp_choice`; `out` has room for 3.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_flash_fwd(
    launch: *const Launch,
    call: *const AttentionCallC,
    out: *mut *mut c_void,
) -> i32 {
    let (Some(launch), Some(call)) = (launch.as_ref(), call.as_ref()) else {
        return STOCK;
    };
    serve_described(
        Entry::FlashAttention,
        || crate::ops::attention::describe(call),
        out,
        |_| {
            let plan = crate::ops::attention::plan(*launch, call)?;
            let (output, lse) = plan.forward(*launch, call)?;
            Ok(Served {
                outputs: [Some(output), Some(lse), None],
                kernel: plan.kernel(),
            })
        },
    )
}

/// `_scaled_dot_product_flash_attention_backward`: out = dq, dk, dv.
///
/// # Safety
/// As `torchfuse_rs_flash_fwd`; `grad_out`, `output`, `lse` are valid `at::Tensor`s.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_flash_bwd(
    launch: *const Launch,
    call: *const AttentionCallC,
    grad_out: *const c_void,
    output: *const c_void,
    lse: *const c_void,
    out: *mut *mut c_void,
) -> i32 {
    let (Some(launch), Some(call)) = (launch.as_ref(), call.as_ref()) else {
        return STOCK;
    };
    serve_described(
        Entry::FlashAttentionBackward,
        || crate::ops::attention::describe(call),
        out,
        |_| {
            let plan = crate::ops::attention::plan(*launch, call)?;
            let [dq, dk, dv] = plan.backward(*launch, call, grad_out, output, lse)?;
            Ok(Served {
                outputs: [Some(dq), Some(dk), Some(dv)],
                kernel: plan.kernel(),
            })
        },
    )
}
