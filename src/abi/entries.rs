//! The `extern "C"` entry points the C++ glue calls for the overridden aten ops: one per op
//! family, all the same (`torchfuse_abi.h` says what they take and answer).
//!
//! Each entry point catches panics: a bug in torchfuse makes the call go to stock (with one
//! warning), never unwinds into PyTorch.

use super::tensor::into_raw;
use super::types::{
    TfAdamCall, TfAttentionCall, TfColumnSumCall, TfCrossEntropyCall, TfEmbeddingCall, TfGeluCall,
    TfLaunch, TfLinearCall, TfMixedAddCall, TfNormCall, TfOutputs, TfRotaryCall, TfStatus,
    TfSwigluCall, TF_FUSED, TF_STOCK,
};
use crate::ops::adam::Adam;
use crate::ops::attention::Attention;
use crate::ops::column_sum::ColumnSum;
use crate::ops::cross_entropy::CrossEntropy;
use crate::ops::embedding::Embedding;
use crate::ops::gelu::Gelu;
use crate::ops::linear::Linear;
use crate::ops::mixed_add::MixedAdd;
use crate::ops::norm::Norm;
use crate::ops::rotary::Rotary;
use crate::ops::swiglu::Swiglu;
use crate::ops::Family;
use crate::runtime::stats::{self, Outcome};
use crate::runtime::Entry;
use crate::select::StockReason;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// One call of family `F`: unless the entry is switched off, the family describes it (for
/// the stats and logs), may refuse it as bad input, and serves it or says why stock must.
/// The answer goes to `status`; a served call's outputs to `out`.
///
/// # Safety
/// The pointers are as the glue passes them: `launch`, `call` and `status` valid, `out` null
/// or valid; `call`'s tensors valid for the call.
unsafe fn answer<F: Family>(
    entry: u32,
    launch: *const TfLaunch,
    call: *const F::Call,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    let Some(status) = status.as_mut() else {
        return;
    };
    status.code = TF_STOCK;
    let (Some(entry), Some(launch), Some(call)) = (
        Entry::from_u32(entry).filter(|e| F::serves(*e)),
        launch.as_ref(),
        call.as_ref(),
    ) else {
        return;
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        if let Some(t) = F::unreadable(entry, call) {
            // Nothing of its sizes (or its data) can be read; stock's kernels and meta
            // functions take them.
            let reason = if t.symbolic != 0 {
                StockReason::SymbolicSizes
            } else {
                StockReason::OpaqueTensor
            };
            return Ok(Some((t.kind_name(), Vec::new(), Err(reason))));
        }
        if let Some(message) = F::refuse(entry, call) {
            return Err(message);
        }
        let Some((dtype, shape)) = F::describe(entry, call) else {
            return Ok(None);
        };
        let outcome = if entry.toggle().active() {
            F::serve(entry, *launch, call, &shape)
        } else {
            Err(StockReason::DisabledAtRuntime)
        };
        Ok(Some((dtype, shape, outcome)))
    }));
    match result {
        Ok(Err(message)) => status.fail(&message),
        Ok(Ok(Some((dtype, shape, outcome)))) => {
            // A routed call is counted once, by the override of the op it is routed to.
            if F::counted(call) && !outcome.as_ref().is_ok_and(|served| served.routed) {
                let counted = match &outcome {
                    Ok(served) => Outcome::Fused(served.kernel),
                    Err(reason) => Outcome::Stock(*reason),
                };
                stats::record(entry, counted, dtype, &shape);
            }
            if let Ok(served) = outcome {
                if let Some(out) = out.as_mut() {
                    for (slot, t) in out.tensors.iter_mut().zip(served.outputs) {
                        *slot = t.map_or(std::ptr::null_mut(), into_raw);
                    }
                }
                status.code = TF_FUSED;
            }
        }
        Ok(Ok(None)) => {}
        Err(payload) => super::lifecycle::warn_internal_error(entry, &*payload),
    }
}

/// `native_layer_norm[_backward]`, `_fused_rms_norm[_backward]`, `torchfuse::hf_rms_norm`.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_norm(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfNormCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Norm>(entry, launch, call, out, status)
}

/// `embedding`, `embedding_dense_backward`.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_embedding(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfEmbeddingCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Embedding>(entry, launch, call, out, status)
}

/// `_fused_adam_` / `_fused_adamw_`, either lr overload.
///
/// # Safety
/// As `answer`; the call's lists hold as many tensors as their lengths say.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_adam(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfAdamCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Adam>(entry, launch, call, out, status)
}

/// The SDPA backend choice, `_scaled_dot_product_flash_attention` and its backward.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_attention(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfAttentionCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Attention>(entry, launch, call, out, status)
}

/// `torchfuse::gelu_tanh` and its backward.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_gelu(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfGeluCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Gelu>(entry, launch, call, out, status)
}

/// `aten::sum.dim_IntList`.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_column_sum(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfColumnSumCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<ColumnSum>(entry, launch, call, out, status)
}

/// `aten::add.Tensor`.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_mixed_add(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfMixedAddCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<MixedAdd>(entry, launch, call, out, status)
}

/// `torchfuse::cross_entropy`'s forward and backward.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_cross_entropy(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfCrossEntropyCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<CrossEntropy>(entry, launch, call, out, status)
}

/// `torchfuse::silu_mul` and its backward.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_swiglu(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfSwigluCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Swiglu>(entry, launch, call, out, status)
}

/// `torchfuse::rotary` and its backward.
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_rotary(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfRotaryCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Rotary>(entry, launch, call, out, status)
}

/// `torchfuse::linear_cast`: TF_FUSED where its one autograd node runs (no outputs).
///
/// # Safety
/// As `answer`.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_linear(
    entry: u32,
    launch: *const TfLaunch,
    call: *const TfLinearCall,
    out: *mut TfOutputs,
    status: *mut TfStatus,
) {
    answer::<Linear>(entry, launch, call, out, status)
}
