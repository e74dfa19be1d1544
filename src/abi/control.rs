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
        // `all` as in TORCHFUSE_OPS: every op TORCHFUSE / TORCHFUSE_OPS registered (the others
        // need no warning), served where any one is.
        let name = name.trim().to_ascii_lowercase();
        let every = name == "all";
        let toggles = if every {
            Toggle::ALL.to_vec()
        } else {
            vec![Toggle::from_name(&name)?]
        };
        let mut unregistered = Vec::new();
        for toggle in toggles {
            toggle.set_active(enabled);
            if !toggle.registered() {
                unregistered.push(toggle.name());
            }
        }
        let served = enabled
            && if every {
                unregistered.len() < Toggle::ALL.len()
            } else {
                unregistered.is_empty()
            };
        if enabled && !every && !unregistered.is_empty() {
            tracing::warn!(
                "set_enabled({name}, True): {} not registered in this process (TORCHFUSE / TORCHFUSE_OPS), stock keeps serving it",
                unregistered.join(", ")
            );
        }
        tracing::info!("{name} {}", if served { "enabled" } else { "disabled" });
        Some(served)
    });
    match answer {
        Ok(Some(true)) => status.code = TF_FUSED,
        Ok(Some(false)) => status.code = TF_STOCK,
        _ => status.fail(&format!(
            "torchfuse.set_enabled: unknown op '{name}' (valid: all, {})",
            Toggle::names()
        )),
    }
}

/// TF_FUSED: the toggle `name` runs through torchfuse now (registered and switched on);
/// TF_STOCK: it does not; TF_ERROR: unknown name. For rewrites that call no op of their own
/// (shared_cast): their Python code asks before each substitution.
///
/// # Safety
/// `name` points to `len` bytes; `status` is valid.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_enabled(
    name: *const c_char,
    len: usize,
    status: *mut TfStatus,
) {
    let Some(status) = status.as_mut() else {
        return;
    };
    let bytes = std::slice::from_raw_parts(name.cast::<u8>(), len);
    let name = String::from_utf8_lossy(bytes);
    // Names in any case, as TORCHFUSE_OPS and set_enabled take them.
    let toggle = catch_unwind(|| Toggle::from_name(&name.trim().to_ascii_lowercase()));
    match toggle {
        Ok(Some(t)) if t.registered() && t.active() => status.code = TF_FUSED,
        Ok(Some(_)) => status.code = TF_STOCK,
        _ => status.fail(&format!(
            "torchfuse.enabled: unknown op '{name}' (valid: {})",
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

/// `torch.ops.torchfuse.doctor()`: what `torchfuse doctor` reports from inside the library, as
/// JSON: the versions, the kernel cache, NVRTC, the registry, the toggles, and one kernel of
/// every family compiled for `arch` (the GPU's; empty: sm_90a). Each check is
/// `{"ok": bool, "detail": str}`.
///
/// # Safety
/// `arch` points to `len` readable bytes (the glue passes a string view's).
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_doctor_json(arch: *const c_char, len: usize) -> *mut c_char {
    catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(arch.cast::<u8>(), len);
        let arch = match String::from_utf8_lossy(bytes).into_owned() {
            a if a.is_empty() => "sm_90a".to_string(),
            a => a,
        };
        CString::new(doctor_report(&arch))
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut())
    })
    .unwrap_or(std::ptr::null_mut())
}

fn check(result: Result<String, String>) -> serde_json::Value {
    match result {
        Ok(detail) => serde_json::json!({"ok": true, "detail": detail}),
        Err(detail) => serde_json::json!({"ok": false, "detail": detail}),
    }
}

fn doctor_report(arch: &str) -> String {
    let config = crate::runtime::config::get();
    let cache = &config.cache_dir;
    let probe = cache.join(format!(".doctor-{}", std::process::id()));
    let writable = std::fs::create_dir_all(cache)
        .and_then(|()| std::fs::write(&probe, b"ok"))
        .and_then(|()| std::fs::remove_file(&probe))
        .map(|()| cache.display().to_string())
        .map_err(|e| {
            format!(
                "{}: {e} (set TORCHFUSE_CACHE_DIR to a writable folder)",
                cache.display()
            )
        });
    let nvrtc = crate::gpu::nvrtc::nvrtc_ready().map(|()| {
        let (major, minor) = crate::gpu::nvrtc::nvrtc_version();
        format!("NVRTC {major}.{minor}")
    });
    let registry = crate::ops::REGISTRY.as_ref();
    let mut kernels = serde_json::Map::new();
    if let (Ok(registry), Ok(())) = (registry, &nvrtc.as_ref().map(|_| ())) {
        let mut seen = std::collections::BTreeSet::new();
        for (i, v) in registry.variants().iter().enumerate() {
            let Some(&dtype) = v.dtypes.first() else {
                continue;
            };
            if !seen.insert(v.source.clone()) {
                continue;
            }
            let options = crate::ops::compile_options(registry.params(i), dtype, arch);
            let compiled = crate::gpu::nvrtc::nvrtc_compile(&v.source, &options).map(|cubin| {
                format!(
                    "{} ({}, {arch}): {} bytes",
                    v.name,
                    dtype.name(),
                    cubin.len()
                )
            });
            kernels.insert(v.source.clone(), check(compiled));
        }
    }
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "torch_built_against": env!("TORCHFUSE_TORCH_VERSION"),
        "cache": check(writable),
        "nvrtc": check(nvrtc),
        "registry": check(registry.map(|r| format!("{} variants", r.variants().len())).map_err(Clone::clone)),
        "enabled": crate::runtime::toggles::enabled_map()
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(),
        "kernels": kernels,
    })
    .to_string()
}
