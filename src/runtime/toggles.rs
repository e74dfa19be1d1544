//! The op families users toggle, the aten entries each one overrides, and their state in this
//! process: registered with the dispatcher (at load), enabled at run time
//! (`torch.ops.torchfuse.set_enabled`). The one place toggle names are written.

use std::sync::atomic::{AtomicBool, Ordering};

/// A user-facing toggle name (`TORCHFUSE_OPS`, `torch.ops.torchfuse.set_enabled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Toggle {
    LayerNorm,
    RmsNorm,
    Embedding,
    Adam,
    Sdpa,
}

impl Toggle {
    pub const ALL: [Toggle; 5] = [
        Toggle::LayerNorm,
        Toggle::RmsNorm,
        Toggle::Embedding,
        Toggle::Adam,
        Toggle::Sdpa,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Toggle::LayerNorm => "layer_norm",
            Toggle::RmsNorm => "rms_norm",
            Toggle::Embedding => "embedding",
            Toggle::Adam => "adam",
            Toggle::Sdpa => "sdpa",
        }
    }

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

/// One aten override point. The numbering is `TfEntry` of `src/abi/torchfuse_abi.h`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Entry {
    NativeLayerNorm = 0,
    NativeLayerNormBackward = 1,
    FusedRmsNorm = 2,
    FusedRmsNormBackward = 3,
    Embedding = 4,
    EmbeddingDenseBackward = 5,
    FusedAdam = 6,
    FusedAdamTensorLr = 7,
    FusedAdamw = 8,
    FusedAdamwTensorLr = 9,
    SdpChoice = 10,
    FlashAttention = 11,
    FlashAttentionBackward = 12,
}

impl Entry {
    pub const ALL: [Entry; 13] = [
        Entry::NativeLayerNorm,
        Entry::NativeLayerNormBackward,
        Entry::FusedRmsNorm,
        Entry::FusedRmsNormBackward,
        Entry::Embedding,
        Entry::EmbeddingDenseBackward,
        Entry::FusedAdam,
        Entry::FusedAdamTensorLr,
        Entry::FusedAdamw,
        Entry::FusedAdamwTensorLr,
        Entry::SdpChoice,
        Entry::FlashAttention,
        Entry::FlashAttentionBackward,
    ];

    pub fn from_u32(v: u32) -> Option<Entry> {
        Entry::ALL.get(v as usize).copied()
    }

    /// The aten op name (with overload) as `_dispatch_dump` and the logs show it.
    pub fn aten_name(self) -> &'static str {
        match self {
            Entry::NativeLayerNorm => "native_layer_norm",
            Entry::NativeLayerNormBackward => "native_layer_norm_backward",
            Entry::FusedRmsNorm => "_fused_rms_norm",
            Entry::FusedRmsNormBackward => "_fused_rms_norm_backward",
            Entry::Embedding => "embedding",
            Entry::EmbeddingDenseBackward => "embedding_dense_backward",
            Entry::FusedAdam => "_fused_adam_",
            Entry::FusedAdamTensorLr => "_fused_adam_.tensor_lr",
            Entry::FusedAdamw => "_fused_adamw_",
            Entry::FusedAdamwTensorLr => "_fused_adamw_.tensor_lr",
            Entry::SdpChoice => "sdpa backend choice",
            Entry::FlashAttention => "_scaled_dot_product_flash_attention",
            Entry::FlashAttentionBackward => "_scaled_dot_product_flash_attention_backward",
        }
    }

    pub fn toggle(self) -> Toggle {
        match self {
            Entry::NativeLayerNorm | Entry::NativeLayerNormBackward => Toggle::LayerNorm,
            Entry::FusedRmsNorm | Entry::FusedRmsNormBackward => Toggle::RmsNorm,
            Entry::Embedding | Entry::EmbeddingDenseBackward => Toggle::Embedding,
            Entry::FusedAdam
            | Entry::FusedAdamTensorLr
            | Entry::FusedAdamw
            | Entry::FusedAdamwTensorLr => Toggle::Adam,
            Entry::SdpChoice | Entry::FlashAttention | Entry::FlashAttentionBackward => {
                Toggle::Sdpa
            }
        }
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
    fn every_toggle_owns_entries_and_every_entry_one_toggle() {
        let mut owned = 0;
        for t in Toggle::ALL {
            let n = t.entries().count();
            assert!(n >= 2, "{} has {n} entries", t.name());
            owned += n;
            assert_eq!(Toggle::from_name(t.name()), Some(t));
        }
        assert_eq!(owned, Entry::ALL.len());
        assert_eq!(Toggle::from_name("layernorm"), None);
    }
}
