//! Load time: reads the config, sets up logging and the panic hook, defines the control ops and
//! registers the enabled overrides through the C++ glue; at exit, the summary.

use super::types::{torchfuse_cxx_define_control_ops, torchfuse_cxx_register, TfStatus, TF_FUSED};
use crate::runtime::stats;
use crate::runtime::{Entry, Toggle};
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// One internal-error warning per entry.
static PANIC_WARNED: [AtomicBool; Entry::ALL.len()] =
    [const { AtomicBool::new(false) }; Entry::ALL.len()];

pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// Where the last panic happened (the panic hook records it; no thread-locals involved).
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

pub(super) fn warn_internal_error(entry: Entry, payload: &(dyn std::any::Any + Send)) {
    if !PANIC_WARNED[entry as usize].swap(true, Ordering::Relaxed) {
        let location = LAST_PANIC.lock().map(|l| l.clone()).unwrap_or_default();
        tracing::warn!(
            "internal error in {} ({} at {location}); stock PyTorch serves this call (warned once)",
            entry.aten_name(),
            panic_message(payload)
        );
    }
}

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

fn register_all() {
    let config = crate::runtime::config::get();
    crate::runtime::logging::init(config);
    // Panics are caught at every entry point and reported once through the log; the default
    // hook would also print them to the user's stderr.
    std::panic::set_hook(Box::new(|info| {
        let location = info.location().map(|l| l.to_string()).unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()) = location;
    }));
    // Before anything is registered with a torch whose ABI may not be the one compiled against.
    if let Some(running) = running_torch_version() {
        let built = env!("TORCHFUSE_TORCH_VERSION");
        if !same_release(&running, built) {
            tracing::warn!(
                "built against torch {built}, running torch {running}: nothing registered, \
                 PyTorch runs unchanged (install the torchfuse built for this torch)"
            );
            return;
        }
    }
    let mut status = TfStatus::new();
    // SAFETY: status is valid and writable.
    unsafe { torchfuse_cxx_define_control_ops(&mut status) };
    if status.code != TF_FUSED {
        tracing::warn!(
            "torch.ops.torchfuse control ops unavailable: {}",
            status.message()
        );
    }
    // SAFETY: registering a plain extern "C" fn; this library is never unloaded.
    unsafe {
        libc::atexit(at_exit);
    }
    if !config.active {
        match &config.rank {
            // One rank switched off is a misconfiguration the job survives (same steps, PyTorch's
            // kernels, slower): say so where the user will look.
            Some(rank) => tracing::warn!(
                "TORCHFUSE=0 in rank {rank}: loaded, nothing registered; if other ranks run \
                 torchfuse, this one runs PyTorch's kernels: slower, and equal to theirs within \
                 rounding"
            ),
            None => tracing::info!("TORCHFUSE=0: loaded, nothing registered"),
        }
        return;
    }
    if let Err(e) = crate::ops::REGISTRY.as_ref() {
        tracing::warn!("kernel registry is invalid ({e}); every call goes to stock");
    }
    let mut registered = Vec::new();
    for toggle in Toggle::ALL.into_iter().filter(|t| config.op_enabled(*t)) {
        let mut ok = true;
        for entry in toggle.entries() {
            let mut status = TfStatus::new();
            // SAFETY: as above.
            unsafe { torchfuse_cxx_register(entry as u32, &mut status) };
            if status.code != TF_FUSED {
                ok = false;
                tracing::warn!(
                    "could not override {}: {}; stock serves it",
                    entry.aten_name(),
                    status.message()
                );
            }
        }
        if ok {
            toggle.mark_registered();
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
}

extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        let config = crate::runtime::config::get();
        if crate::runtime::logging::info_enabled() {
            // A process where nothing reached torchfuse says so: on a machine without a GPU, or
            // a job on CPU tensors, torchfuse is idle and the user should know.
            let table = stats::summary_table().or_else(|| {
                config.active.then(|| {
                    "nothing served in this process: no call reached an enabled op (the overrides \
                     take CUDA tensors only)"
                        .to_string()
                })
            });
            if let Some(table) = table {
                crate::runtime::logging::write_at_exit(config, &table);
            }
        }
        if let Some(dir) = &config.stats_dir {
            write_stats_file(dir, config.rank.as_deref(), config.active);
        }
    });
}

/// `DIR/stats-rank{R}-pid{P}.json` (`stats-pid{P}.json` in a process without a rank): this
/// process's stats, rank and world size, for `torchfuse stats DIR` to set a job's ranks side by
/// side and name the ranks that left none. Written where ops were called, and by a process of a
/// rank with TORCHFUSE=0 (its empty stats are the fact to see); not by processes that called
/// nothing with torchfuse on (torchrun's own, compile or DataLoader workers, which inherit the
/// rank). Written whole or not at all (a temporary file renamed).
/// A failure is one line on stderr (logging is gone at exit); the job's exit status is not
/// touched.
fn write_stats_file(dir: &std::path::Path, rank: Option<&str>, active: bool) {
    let mut map = stats::to_map(&crate::runtime::toggles::enabled_map());
    let no_calls = map
        .get("ops")
        .and_then(|o| o.as_object())
        .is_none_or(|o| o.is_empty());
    if no_calls && (active || rank.is_none()) {
        return;
    }
    map.insert("rank".to_string(), rank.into());
    let world_size = std::env::var("WORLD_SIZE").ok();
    map.insert("world_size".to_string(), world_size.into());
    let pid = std::process::id();
    let name = match rank {
        Some(r) => format!("stats-rank{r}-pid{pid}.json"),
        None => format!("stats-pid{pid}.json"),
    };
    let (path, partial) = (dir.join(&name), dir.join(format!(".{name}.tmp")));
    let text = serde_json::Value::Object(map).to_string();
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&partial, text))
        .and_then(|()| std::fs::rename(&partial, &path));
    if let Err(e) = written {
        eprintln!("torchfuse: cannot write {path:?} (TORCHFUSE_STATS_DIR): {e}");
    }
}

#[cfg(not(test))]
#[ctor::ctor]
fn on_load() {
    init();
}

/// The torch this library was built against, as a marker in its file: the Python side
/// (`torchfuse.enable`, the start-up hook, `torchfuse doctor`) reads it before loading the
/// library, and refuses another torch with one error naming both versions (the job continues
/// stock).
#[used]
static BUILT_AGAINST: &str = concat!(
    "torchfuse-built-against-torch=",
    env!("TORCHFUSE_TORCH_VERSION"),
    "\0"
);

/// The running torch's version, from the `version.py` beside the libc10 this process loaded
/// (`torch/lib/libc10.so` -> `torch/version.py`); None when it cannot be read.
fn running_torch_version() -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is writable for its length; the glue NUL-terminates within it.
    let len =
        unsafe { super::types::torchfuse_cxx_libtorch_file(buf.as_mut_ptr().cast(), buf.len()) };
    if len == 0 || len >= buf.len() {
        return None;
    }
    let lib = std::path::PathBuf::from(String::from_utf8_lossy(&buf[..len]).into_owned());
    let text = std::fs::read_to_string(lib.parent()?.parent()?.join("version.py")).ok()?;
    parse_torch_version(&text)
}

/// `__version__ = '2.11.0+cu130'` from torch's version.py.
fn parse_torch_version(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("__version__")?.trim_start();
        let value = rest.strip_prefix('=')?.trim();
        let quote = value.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        Some(value[1..].split(quote).next()?.to_string())
    })
}

/// Two torch versions of one release (`2.11.0+cu130` and `2.11.0`).
fn same_release(a: &str, b: &str) -> bool {
    a.split('+').next() == b.split('+').next()
}

#[cfg(test)]
mod version_tests {
    use super::*;

    #[test]
    fn torch_versions_are_read_and_compared_by_release() {
        let text =
            "from typing import Optional\n__version__ = '2.11.0+cu130'\ngit_version = 'abc'\n";
        assert_eq!(parse_torch_version(text).as_deref(), Some("2.11.0+cu130"));
        assert_eq!(
            parse_torch_version("__version__ = \"2.12.1\"\n").as_deref(),
            Some("2.12.1")
        );
        assert_eq!(parse_torch_version("version = '1'\n"), None);
        assert!(same_release("2.11.0+cu130", "2.11.0"));
        assert!(!same_release("2.12.0+cu130", "2.11.0+cu130"));
    }

    #[test]
    fn the_running_torch_is_the_one_built_against() {
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu)); // libc10 mapped
        let running = running_torch_version().expect("torch's version.py beside libc10");
        assert!(
            same_release(&running, env!("TORCHFUSE_TORCH_VERSION")),
            "{running}"
        );
    }
}
