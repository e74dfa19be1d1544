//! The op families users toggle (aten overrides, and the rewrites of Python compositions the
//! `torchfuse` package makes, which call torchfuse's own ops), the entries each one owns, and
//! their state in this process: registered with the dispatcher (at load), enabled at run time
//! (`torch.ops.torchfuse.set_enabled`). Their names come from the op catalog, src/catalog.toml.

use std::sync::atomic::{AtomicBool, Ordering};

// Toggle, Entry and OpFamily, generated from src/catalog.toml (the one place an op's identity
// is written): names, numbering, each entry's toggle and family.
include!(concat!(env!("OUT_DIR"), "/catalog.rs"));

impl Toggle {
    /// Every toggle name, comma-separated (for messages listing the valid ones).
    pub fn names() -> String {
        Toggle::ALL.map(Toggle::name).join(", ")
    }

    pub fn from_name(name: &str) -> Option<Toggle> {
        Toggle::ALL.into_iter().find(|t| t.name() == name)
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn entries(self) -> impl Iterator<Item = Entry> {
        Entry::ALL.into_iter().filter(move |e| e.toggle() == self)
    }
}

impl Entry {
    pub fn from_u32(v: u32) -> Option<Entry> {
        Entry::ALL.get(v as usize).copied()
    }
}

/// Overrides registered with the dispatcher, per toggle.
static REGISTERED: [AtomicBool; Toggle::ALL.len()] =
    [const { AtomicBool::new(false) }; Toggle::ALL.len()];
/// Run-time switch (`torch.ops.torchfuse.set_enabled`), per toggle.
static RUNTIME_ENABLED: [AtomicBool; Toggle::ALL.len()] =
    [const { AtomicBool::new(true) }; Toggle::ALL.len()];

impl Toggle {
    /// Its overrides are registered with the dispatcher.
    pub fn mark_registered(self) {
        REGISTERED[self.index()].store(true, Ordering::Relaxed);
    }

    pub fn registered(self) -> bool {
        REGISTERED[self.index()].load(Ordering::Relaxed)
    }

    /// Switched on at run time (the default).
    pub fn active(self) -> bool {
        RUNTIME_ENABLED[self.index()].load(Ordering::Relaxed)
    }

    pub fn set_active(self, enabled: bool) {
        RUNTIME_ENABLED[self.index()].store(enabled, Ordering::Relaxed);
    }
}

/// Each toggle's name and whether torchfuse serves it now (registered and switched on).
pub fn enabled_map() -> Vec<(&'static str, bool)> {
    Toggle::ALL
        .iter()
        .map(|t| (t.name(), t.registered() && t.active()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_numbering_round_trips() {
        for (i, e) in Entry::ALL.iter().enumerate() {
            assert_eq!(*e as u32, i as u32);
            assert_eq!(Entry::from_u32(i as u32), Some(*e));
        }
        assert_eq!(Entry::from_u32(Entry::ALL.len() as u32), None);
    }

    #[test]
    fn every_entry_has_one_toggle_and_only_a_no_op_rewrite_switches_none() {
        let mut owned = 0;
        for t in Toggle::ALL {
            let n = t.entries().count();
            // An aten op's override comes with its backward's (unless autograd makes its
            // gradient of other ops: forward_only, sum's and add's); a toggle of torchfuse's own
            // ops may own one (hf_rms_norm routes to aten's; kv_copy's backward is its
            // autograd's); only a rewrite that calls no op of its own (no_op: shared_cast) owns
            // none.
            let overrides_aten = !t.forward_only()
                && t.entries()
                    .any(|e| !e.aten_name().starts_with("torchfuse::"));
            let least = if overrides_aten { 2 } else { 1 };
            assert_eq!(n == 0, t.no_op(), "{} switches {n} entries", t.name());
            assert!(t.no_op() || n >= least, "{} has {n} entries", t.name());
            owned += n;
            assert_eq!(Toggle::from_name(t.name()), Some(t));
        }
        assert_eq!(owned, Entry::ALL.len());
        assert_eq!(Toggle::from_name("layernorm"), None);
    }

    #[test]
    fn the_readme_names_every_toggle_of_the_catalog() {
        let readme = include_str!("../../README.md");
        let names = readme
            .lines()
            .find(|l| l.starts_with("Op names:"))
            .expect("README.md has its `Op names:` paragraph");
        for t in Toggle::ALL {
            assert!(
                names.contains(&format!("`{}`", t.name())),
                "README.md: {} missing",
                t.name()
            );
        }
    }
}
