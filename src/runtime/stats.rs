//! What ran, per call: counters for the exit summary and `torch.ops.torchfuse.stats()`, one
//! info line the first time each (op, outcome, dtype, shape) is seen, a debug line every call.

use super::toggles::Entry;
use crate::select::StockReason;
use once_cell::sync::Lazy;
use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::sync::Mutex;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    Fused(&'static str),
    Stock(StockReason),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Fused(kernel) => write!(f, "kernel {kernel}"),
            Outcome::Stock(reason) => write!(f, "stock ({reason})"),
        }
    }
}

#[derive(Default)]
struct Stats {
    counts: BTreeMap<Entry, BTreeMap<Outcome, u64>>,
    seen: HashSet<(Entry, Outcome, &'static str, Vec<i64>)>,
}

static STATS: Lazy<Mutex<Stats>> = Lazy::new(|| Mutex::new(Stats::default()));

fn lock() -> std::sync::MutexGuard<'static, Stats> {
    // A panic while holding the lock leaves plain counters behind: still usable.
    STATS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records one call. `shape` is the primary input's shape (for list ops: `[len]`).
pub fn record(entry: Entry, outcome: Outcome, dtype: &'static str, shape: &[i64]) {
    let first = {
        let mut s = lock();
        *s.counts
            .entry(entry)
            .or_default()
            .entry(outcome)
            .or_insert(0) += 1;
        tracing::enabled!(tracing::Level::INFO)
            && s.seen.insert((entry, outcome, dtype, shape.to_vec()))
    };
    if first {
        tracing::info!("{} {dtype} {shape:?} -> {outcome}", entry.aten_name());
    } else {
        tracing::debug!("{} {dtype} {shape:?} -> {outcome}", entry.aten_name());
    }
}

pub fn reset() {
    let mut s = lock();
    s.counts.clear();
    s.seen.clear();
}

/// Calls per entry and outcome, as JSON for `torch.ops.torchfuse.stats()`.
pub fn to_json(enabled: &[(&'static str, bool)]) -> String {
    serde_json::Value::Object(to_map(enabled)).to_string()
}

/// The JSON object of [`to_json`]: `pid`, `enabled` and `ops` (empty where no op was called).
pub fn to_map(enabled: &[(&'static str, bool)]) -> serde_json::Map<String, serde_json::Value> {
    let s = lock();
    let mut ops = serde_json::Map::new();
    for (entry, outcomes) in &s.counts {
        let mut kernels = serde_json::Map::new();
        let mut reasons = serde_json::Map::new();
        let (mut fused, mut stock) = (0u64, 0u64);
        for (outcome, n) in outcomes {
            match outcome {
                Outcome::Fused(k) => {
                    fused += n;
                    kernels.insert(k.to_string(), (*n).into());
                }
                Outcome::Stock(r) => {
                    stock += n;
                    reasons.insert(r.to_string(), (*n).into());
                }
            }
        }
        ops.insert(
            entry.aten_name().to_string(),
            serde_json::json!({"fused": fused, "stock": stock, "kernels": kernels, "stock_reasons": reasons}),
        );
    }
    let enabled: serde_json::Map<String, serde_json::Value> = enabled
        .iter()
        .map(|(k, v)| (k.to_string(), (*v).into()))
        .collect();
    let mut map = serde_json::Map::new();
    map.insert("pid".to_string(), std::process::id().into());
    map.insert("enabled".to_string(), enabled.into());
    map.insert("ops".to_string(), ops.into());
    map
}

/// The exit summary: per op, calls fused vs stock, grouped by kernel and by reason.
pub fn summary_table() -> Option<String> {
    let s = lock();
    if s.counts.is_empty() {
        return None;
    }
    let mut out = String::from("substitution summary\n");
    let _ = writeln!(out, "  {:<46} {:>9} {:>9}  detail", "op", "fused", "stock");
    for (entry, outcomes) in &s.counts {
        let fused: u64 = outcomes
            .iter()
            .filter(|(o, _)| matches!(o, Outcome::Fused(_)))
            .map(|(_, n)| n)
            .sum();
        let stock: u64 = outcomes.values().sum::<u64>() - fused;
        let detail: Vec<String> = outcomes.iter().map(|(o, n)| format!("{o} x{n}")).collect();
        let _ = writeln!(
            out,
            "  {:<46} {:>9} {:>9}  {}",
            entry.aten_name(),
            fused,
            stock,
            detail.join(", ")
        );
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_group_by_kernel_and_reason() {
        reset();
        record(
            Entry::NativeLayerNorm,
            Outcome::Fused("ln_a"),
            "bf16",
            &[4, 8],
        );
        record(
            Entry::NativeLayerNorm,
            Outcome::Fused("ln_a"),
            "bf16",
            &[4, 8],
        );
        record(
            Entry::NativeLayerNorm,
            Outcome::Stock(StockReason::UnsupportedDtype),
            "f64",
            &[4, 8],
        );
        record(
            Entry::FusedAdam,
            Outcome::Stock(StockReason::NotFasterHere),
            "f32",
            &[3],
        );
        let json: serde_json::Value = serde_json::from_str(&to_json(&[("adam", true)])).unwrap();
        let ln = &json["ops"]["native_layer_norm"];
        assert_eq!(ln["fused"], 2);
        assert_eq!(ln["stock"], 1);
        assert_eq!(ln["kernels"]["ln_a"], 2);
        assert_eq!(ln["stock_reasons"]["unsupported dtype"], 1);
        assert_eq!(
            json["ops"]["_fused_adam_"]["stock_reasons"]["stock is faster at this shape"],
            1
        );
        assert_eq!(json["enabled"]["adam"], true);
        let table = summary_table().unwrap();
        assert!(table.contains("native_layer_norm"));
        assert!(table.contains("kernel ln_a x2"));
        reset();
        assert!(summary_table().is_none());
    }
}
