//! The `torch.ops.torchfuse` control ops' Rust side: toggles at run time, stats, notes from
//! the Python hook, and the test and benchmark hooks.

use super::types::{TfStatus, TF_FUSED, TF_STOCK};
use crate::runtime::stats;
use crate::runtime::Toggle;
use std::ffi::{c_char, CString};
use std::panic::catch_unwind;
use std::sync::atomic::Ordering;

/// # Safety
/// `msg` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_torch_warning(msg: *const c_char, len: usize) {
    let _ = catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(msg.cast::<u8>(), len);
        tracing::debug!("torch: {}", String::from_utf8_lossy(bytes));
    });
}

/// What the Python side did or left alone (a substitution, a rewrite, a composition not
/// recognised), logged at info, or at debug when `debug` is set.
///
/// # Safety
/// `msg` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_note(msg: *const c_char, len: usize, debug: u8) {
    let _ = catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(msg.cast::<u8>(), len);
        let text = String::from_utf8_lossy(bytes);
        if debug != 0 {
            tracing::debug!("{text}");
        } else {
            tracing::info!("{text}");
        }
    });
}

/// TF_FUSED: the op now runs through torchfuse; TF_STOCK: it does not (disabled, or never
/// registered); TF_ERROR: unknown name.
///
/// # Safety
/// `name` points to `len` bytes; `status` is valid.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_set_enabled(
    name: *const c_char,
    len: usize,
    enabled: u8,
    status: *mut TfStatus,
) {
    let Some(status) = status.as_mut() else {
        return;
    };
    let bytes = std::slice::from_raw_parts(name.cast::<u8>(), len);
    let name = String::from_utf8_lossy(bytes);
    let enabled = enabled != 0;
    let answer = catch_unwind(|| {
        let toggle = Toggle::from_name(&name)?;
        toggle.set_active(enabled);
        let registered = toggle.registered();
        if enabled && !registered {
            tracing::warn!(
                "set_enabled({}, True): not registered in this process (TORCHFUSE / TORCHFUSE_OPS), stock keeps serving it",
                toggle.name()
            );
        }
        tracing::info!(
            "{} {}",
            toggle.name(),
            if enabled && registered {
                "enabled"
            } else {
                "disabled"
            }
        );
        Some(enabled && registered)
    });
    match answer {
        Ok(Some(true)) => status.code = TF_FUSED,
        Ok(Some(false)) => status.code = TF_STOCK,
        _ => status.fail(&format!(
            "torchfuse.set_enabled: unknown op '{name}' (valid: {})",
            Toggle::names()
        )),
    }
}

/// JSON of the calls so far; free with `torchfuse_rs_free_string`.
#[no_mangle]
pub extern "C" fn torchfuse_rs_stats_json() -> *mut c_char {
    catch_unwind(|| {
        CString::new(stats::to_json(&crate::runtime::toggles::enabled_map()))
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut())
    })
    .unwrap_or(std::ptr::null_mut())
}

/// # Safety
/// `s` came from `torchfuse_rs_stats_json` and is freed once.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_free_string(s: *mut c_char) {
    if !s.is_null() {
        drop(CString::from_raw(s));
    }
}

/// Benchmark hook: an empty name clears the forced variant.
///
/// # Safety
/// `name` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_force_variant(name: *const c_char, len: usize) {
    let _ = catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(name.cast::<u8>(), len);
        let name = String::from_utf8_lossy(bytes).into_owned();
        *crate::select::registry::FORCED_VARIANT
            .write()
            .unwrap_or_else(|p| p.into_inner()) = (!name.is_empty()).then_some(name);
    });
}

#[no_mangle]
pub extern "C" fn torchfuse_rs_serve_below_thresholds(serve: u8) {
    crate::select::registry::SERVE_BELOW_THRESHOLDS.store(serve != 0, Ordering::Relaxed);
}

#[no_mangle]
pub extern "C" fn torchfuse_rs_reset_stats() {
    let _ = catch_unwind(stats::reset);
}
