//! `tracing` set-up: every line carries the process id and, under torchrun, the rank, so
//! the logs of ranks and DataLoader workers can be told apart.

use super::config::Config;
use std::fmt;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

struct ProcessTagged {
    rank: Option<String>,
}

fn tag(config: &Config) -> String {
    match &config.rank {
        Some(rank) => format!("torchfuse[pid={} rank={rank}]", std::process::id()),
        None => format!("torchfuse[pid={}]", std::process::id()),
    }
}

static INFO_ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether the filter lets info lines through (read once at init: `tracing` itself is not
/// usable at process exit, when thread-locals are already gone).
pub fn info_enabled() -> bool {
    INFO_ENABLED.load(Ordering::Relaxed)
}

/// Writes an info line to the log sink without `tracing`, for use at process exit.
pub fn write_at_exit(config: &Config, text: &str) {
    let line = format!("{} INFO {text}\n", tag(config));
    let written = config.log_file.as_ref().is_some_and(|path| {
        OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .is_ok()
    });
    if !written {
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
}

impl<S, N> FormatEvent<S, N> for ProcessTagged
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        // The pid is read per line: forked DataLoader workers must not inherit the parent's.
        write!(writer, "torchfuse[pid={}", std::process::id())?;
        if let Some(rank) = &self.rank {
            write!(writer, " rank={rank}")?;
        }
        write!(writer, "] {} ", event.metadata().level())?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Installs the subscriber; returns false if another one was already installed (then the
/// existing one keeps working and this is harmless).
pub fn init(config: &Config) -> bool {
    let filter = EnvFilter::try_new(&config.log_filter)
        .unwrap_or_else(|_| EnvFilter::new(super::config::DEFAULT_LOG_FILTER));
    let format = ProcessTagged {
        rank: config.rank.clone(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .event_format(format);
    let file = config.log_file.as_ref().and_then(|path| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| {
                eprintln!(
                    "torchfuse: cannot open TORCHFUSE_LOG_FILE {path:?}: {e}; logging to stderr"
                )
            })
            .ok()
    });
    let installed = match file {
        Some(f) => builder.with_writer(Mutex::new(f)).try_init().is_ok(),
        None => builder.with_writer(std::io::stderr).try_init().is_ok(),
    };
    for w in &config.warnings {
        tracing::warn!("{w}");
    }
    INFO_ENABLED.store(tracing::enabled!(tracing::Level::INFO), Ordering::Relaxed);
    installed
}

/// A warning given once per `key` in the process (`message` made only then).
pub fn warn_once(key: &str, message: impl FnOnce() -> String) {
    static WARNED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    if !warned.iter().any(|k| k == key) {
        warned.push(key.to_string());
        tracing::warn!("{}", message());
    }
}

/// A kernel that failed to launch: warned once per kernel; stock serves its calls.
pub fn warn_once_launch_failure(kernel: &str, error: &str) {
    warn_once(&format!("launch {kernel}"), || {
        format!("launching {kernel} failed: {error}; stock serves its calls")
    });
}
