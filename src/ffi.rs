//! Load-time registration and every `extern "C"` entry point the C++ glue calls.
//!
//! Each entry point catches panics: a bug in torchfuse makes the call go to stock (with one
//! warning), never unwinds into PyTorch.

use crate::attention::AttentionCallC;
use crate::config::Config;
use crate::jit::Launch;
use crate::norm::{BackwardCall, ForwardCall, NormKind};
use crate::ops::{Entry, Toggle};
use crate::registry::StockReason;
use crate::stats::{self, Outcome};
use crate::tensor::{borrow, describe, into_raw, kind_name};
use once_cell::sync::OnceCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tch::Tensor;

const FUSED: i32 = 1;
const STOCK: i32 = 0;
/// Bad input refused with an error (stock would crash on it).
const ERROR: i32 = 2;

extern "C" {
    fn torchfuse_cxx_register(entry: u32, err: *mut c_char, err_len: usize) -> i32;
    fn torchfuse_cxx_define_control_ops(err: *mut c_char, err_len: usize) -> i32;
}

static CONFIG: OnceCell<Config> = OnceCell::new();

pub fn config() -> &'static Config {
    CONFIG.get_or_init(Config::from_env)
}

/// Overrides registered with the dispatcher, per toggle.
static REGISTERED: [AtomicBool; Toggle::ALL.len()] =
    [const { AtomicBool::new(false) }; Toggle::ALL.len()];
/// Run-time switch (`torch.ops.torchfuse.set_enabled`), per toggle.
static RUNTIME_ENABLED: [AtomicBool; Toggle::ALL.len()] =
    [const { AtomicBool::new(true) }; Toggle::ALL.len()];
/// One internal-error warning per entry.
static PANIC_WARNED: [AtomicBool; Entry::ALL.len()] =
    [const { AtomicBool::new(false) }; Entry::ALL.len()];

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// Where the last panic happened (the panic hook records it; no thread-locals involved).
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

fn warn_internal_error(entry: Entry, payload: &(dyn std::any::Any + Send)) {
    if !PANIC_WARNED[entry as usize].swap(true, Ordering::Relaxed) {
        let location = LAST_PANIC.lock().map(|l| l.clone()).unwrap_or_default();
        tracing::warn!(
            "internal error in {} ({} at {location}); stock PyTorch serves this call (warned once)",
            entry.aten_name(),
            panic_message(payload)
        );
    }
}

pub fn warn_once_launch_failure(kernel: &str, error: &str) {
    static WARNED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    if !warned.iter().any(|k| k == kernel) {
        warned.push(kernel.to_string());
        tracing::warn!("launching {kernel} failed: {error}; stock serves its calls");
    }
}

fn active(toggle: Toggle) -> bool {
    RUNTIME_ENABLED[toggle.index()].load(Ordering::Relaxed)
}

// ------------------------------------------------------------------ registration

/// Reads the config, sets up logging and registers the enabled overrides. Idempotent.
pub fn init() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        if let Err(payload) = catch_unwind(register_all) {
            eprintln!(
                "torchfuse: initialisation failed ({}); PyTorch runs unchanged",
                panic_message(&*payload)
            );
        }
    });
}

fn cxx_error(buf: &[u8]) -> String {
    CStr::from_bytes_until_nul(buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn register_all() {
    let config = config();
    crate::logging::init(config);
    // Panics are caught at every entry point and reported once through the log; the default
    // hook would also print them to the user's stderr.
    std::panic::set_hook(Box::new(|info| {
        let location = info.location().map(|l| l.to_string()).unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()) = location;
    }));
    let mut err = [0u8; 1024];
    // SAFETY: err is a writable buffer of the given length.
    if unsafe { torchfuse_cxx_define_control_ops(err.as_mut_ptr().cast(), err.len()) } != 0 {
        tracing::warn!(
            "torch.ops.torchfuse control ops unavailable: {}",
            cxx_error(&err)
        );
    }
    if !config.active {
        tracing::info!("TORCHFUSE=0: loaded, nothing registered");
        return;
    }
    if let Err(e) = crate::registry::REGISTRY.as_ref() {
        tracing::warn!("kernel registry is invalid ({e}); every call goes to stock");
    }
    let mut registered = Vec::new();
    for toggle in Toggle::ALL.into_iter().filter(|t| config.op_enabled(*t)) {
        let mut ok = true;
        for entry in toggle.entries() {
            // SAFETY: as above.
            if unsafe { torchfuse_cxx_register(entry as u32, err.as_mut_ptr().cast(), err.len()) }
                != 0
            {
                ok = false;
                tracing::warn!(
                    "could not override {}: {}; stock serves it",
                    entry.aten_name(),
                    cxx_error(&err)
                );
            }
        }
        if ok {
            REGISTERED[toggle.index()].store(true, Ordering::Relaxed);
            registered.push(toggle.name());
        }
    }
    tracing::info!(
        "overrides registered for: {}",
        if registered.is_empty() {
            "none".to_string()
        } else {
            registered.join(", ")
        }
    );
    // SAFETY: registering a plain extern "C" fn; this library is never unloaded.
    unsafe {
        libc::atexit(at_exit);
    }
}

extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        if crate::logging::info_enabled() {
            if let Some(table) = stats::summary_table() {
                crate::logging::write_at_exit(config(), &table);
            }
        }
    });
}

#[cfg(not(test))]
#[ctor::ctor]
fn on_load() {
    init();
}

// ------------------------------------------------------------------ op entry points

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
        let outcome = if active(entry.toggle()) {
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
            warn_internal_error(entry, &*payload);
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
        let fwd = crate::norm::forward(*launch, &call)?;
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
        let bwd = crate::norm::backward(*launch, &call)?;
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
    call: *mut crate::adam::AdamCallC,
) -> i32 {
    let Some(entry) = Entry::from_u32(entry) else {
        return STOCK;
    };
    let (Some(launch), Some(call_c)) = (launch.as_ref(), call.as_mut()) else {
        return STOCK;
    };
    let refused = catch_unwind(AssertUnwindSafe(|| {
        crate::adam::list_length_error(call_c, entry.aten_name())
    }));
    if let Ok(Some(message)) = refused {
        let bytes = message.as_bytes();
        let n = bytes.len().min(call_c.error.len() - 1);
        call_c.error[..n].copy_from_slice(&bytes[..n]);
        call_c.error[n] = 0;
        return ERROR;
    }
    let call = crate::adam::AdamCall::from_c(call_c);
    serve_described(
        entry,
        || Some(call.describe()),
        std::ptr::null_mut(),
        |_| {
            let kernel = crate::adam::step(*launch, &call)?;
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
            let fwd = crate::embedding::forward(*launch, &weight, &indices)?;
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
            let call = crate::embedding::BackwardCall {
                grad: &grad,
                indices: &indices,
                num_weights,
                padding_idx,
                scale_grad_by_freq,
            };
            let bwd = crate::embedding::backward(*launch, &call)?;
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
        || crate::attention::describe(call),
        std::ptr::null_mut(),
        |_| {
            if !(1..=3).contains(&stock_choice) {
                return Err(StockReason::AttentionFeature);
            }
            let plan = crate::attention::plan(*launch, call)?;
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
        || crate::attention::describe(call),
        out,
        |_| {
            let plan = crate::attention::plan(*launch, call)?;
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
        || crate::attention::describe(call),
        out,
        |_| {
            let plan = crate::attention::plan(*launch, call)?;
            let [dq, dk, dv] = plan.backward(*launch, call, grad_out, output, lse)?;
            Ok(Served {
                outputs: [Some(dq), Some(dk), Some(dv)],
                kernel: plan.kernel(),
            })
        },
    )
}

// ------------------------------------------------------------------ control

/// # Safety
/// `msg` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_torch_warning(msg: *const c_char, len: usize) {
    let _ = catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(msg.cast::<u8>(), len);
        tracing::debug!("torch: {}", String::from_utf8_lossy(bytes));
    });
}

/// A substitution made outside the dispatcher (the launcher's Python hook), logged at info.
///
/// # Safety
/// `msg` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_note(msg: *const c_char, len: usize) {
    let _ = catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(msg.cast::<u8>(), len);
        tracing::info!("{}", String::from_utf8_lossy(bytes));
    });
}

/// 1: the op now runs through torchfuse; 0: it does not (disabled, or never registered);
/// -1: unknown name.
///
/// # Safety
/// `name` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn torchfuse_rs_set_enabled(
    name: *const c_char,
    len: usize,
    enabled: bool,
) -> i32 {
    catch_unwind(|| {
        let bytes = std::slice::from_raw_parts(name.cast::<u8>(), len);
        let Some(toggle) = std::str::from_utf8(bytes).ok().and_then(Toggle::from_name) else {
            return -1;
        };
        RUNTIME_ENABLED[toggle.index()].store(enabled, Ordering::Relaxed);
        let registered = REGISTERED[toggle.index()].load(Ordering::Relaxed);
        if enabled && !registered {
            tracing::warn!(
                "set_enabled({}, True): not registered in this process (TORCHFUSE / TORCHFUSE_OPS), stock keeps serving it",
                toggle.name()
            );
        }
        tracing::info!("{} {}", toggle.name(), if enabled && registered { "enabled" } else { "disabled" });
        i32::from(enabled && registered)
    })
    .unwrap_or(-1)
}

fn enabled_map() -> Vec<(&'static str, bool)> {
    Toggle::ALL
        .iter()
        .map(|t| {
            (
                t.name(),
                REGISTERED[t.index()].load(Ordering::Relaxed) && active(*t),
            )
        })
        .collect()
}

/// JSON of the calls so far; free with `torchfuse_rs_free_string`.
#[no_mangle]
pub extern "C" fn torchfuse_rs_stats_json() -> *mut c_char {
    catch_unwind(|| {
        CString::new(stats::to_json(&enabled_map()))
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
        *crate::registry::FORCED_VARIANT
            .write()
            .unwrap_or_else(|p| p.into_inner()) = (!name.is_empty()).then_some(name);
    });
}

#[no_mangle]
pub extern "C" fn torchfuse_rs_serve_below_thresholds(serve: bool) {
    crate::registry::SERVE_BELOW_THRESHOLDS.store(serve, Ordering::Relaxed);
}

#[no_mangle]
pub extern "C" fn torchfuse_rs_reset_stats() {
    let _ = catch_unwind(stats::reset);
}
