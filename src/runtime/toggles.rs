//! The op families users toggle (aten overrides, and the rewrites of Python compositions the
//! `torchfuse` package makes, which call torchfuse's own ops), the entries each one owns, and
//! their state in this process: registered with the dispatcher (at load), enabled at run time
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
    /// Rewrite: HF's tanh GELU compositions -> torchfuse::gelu_tanh.
    GeluTanh,
    /// Rewrite: HF's RMSNorm composition (LlamaRMSNorm and its copies) -> torchfuse::hf_rms_norm.
    HfRmsNorm,
    /// aten::cross_entropy_loss (any caller), and the rewrite of HF's causal-LM loss ->
    /// torchfuse::cross_entropy (bf16 logits read as they are).
    CrossEntropy,
    /// Rewrite: HF's gated MLP (LlamaMLP and its copies) -> torchfuse::silu_mul between its
    /// matmuls.
    Swiglu,
    /// Rewrite: HF's apply_rotary_pos_emb (rotate-half form) -> torchfuse::rotary.
    Rotary,
}

impl Toggle {
    pub const ALL: [Toggle; 10] = [
        Toggle::LayerNorm,
        Toggle::RmsNorm,
        Toggle::Embedding,
        Toggle::Adam,
        Toggle::Sdpa,
        Toggle::GeluTanh,
        Toggle::HfRmsNorm,
        Toggle::CrossEntropy,
        Toggle::Swiglu,
        Toggle::Rotary,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Toggle::LayerNorm => "layer_norm",
            Toggle::RmsNorm => "rms_norm",
            Toggle::Embedding => "embedding",
            Toggle::Adam => "adam",
            Toggle::Sdpa => "sdpa",
            Toggle::GeluTanh => "gelu_tanh",
            Toggle::HfRmsNorm => "hf_rms_norm",
            Toggle::CrossEntropy => "cross_entropy",
            Toggle::Swiglu => "swiglu",
            Toggle::Rotary => "rotary",
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

/// One override point: an aten op at the CUDA key, or one of torchfuse's own ops. The
/// numbering is `TfEntry` of `src/abi/torchfuse_abi.h`.
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
    GeluTanh = 13,
    GeluTanhBackward = 14,
    HfRmsNorm = 15,
    CrossEntropy = 16,
    CrossEntropyBackward = 17,
    CrossEntropyLoss = 18,
    SiluMul = 19,
    SiluMulBackward = 20,
    Rotary = 21,
    RotaryBackward = 22,
}

impl Entry {
    pub const ALL: [Entry; 23] = [
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
        Entry::GeluTanh,
        Entry::GeluTanhBackward,
        Entry::HfRmsNorm,
        Entry::CrossEntropy,
        Entry::CrossEntropyBackward,
        Entry::CrossEntropyLoss,
        Entry::SiluMul,
        Entry::SiluMulBackward,
        Entry::Rotary,
        Entry::RotaryBackward,
    ];

    pub fn from_u32(v: u32) -> Option<Entry> {
        Entry::ALL.get(v as usize).copied()
    }

    /// The op's name (aten's with overload, or `torchfuse::name`) as the logs show it.
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
            Entry::GeluTanh => "torchfuse::gelu_tanh",
            Entry::GeluTanhBackward => "torchfuse::gelu_tanh_backward",
            Entry::HfRmsNorm => "torchfuse::hf_rms_norm",
            Entry::CrossEntropy => "torchfuse::cross_entropy",
            Entry::CrossEntropyBackward => "torchfuse::cross_entropy (backward)",
            Entry::CrossEntropyLoss => "cross_entropy_loss",
            Entry::SiluMul => "torchfuse::silu_mul",
            Entry::SiluMulBackward => "torchfuse::silu_mul_backward",
            Entry::Rotary => "torchfuse::rotary",
            Entry::RotaryBackward => "torchfuse::rotary_backward",
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
            Entry::GeluTanh | Entry::GeluTanhBackward => Toggle::GeluTanh,
            Entry::HfRmsNorm => Toggle::HfRmsNorm,
            Entry::CrossEntropy | Entry::CrossEntropyBackward | Entry::CrossEntropyLoss => {
                Toggle::CrossEntropy
            }
            Entry::SiluMul | Entry::SiluMulBackward => Toggle::Swiglu,
            Entry::Rotary | Entry::RotaryBackward => Toggle::Rotary,
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
            // An aten op's override comes with its backward's; hf_rms_norm's backward is
            // aten's (it serves the composition with aten::rms_norm).
            let least = if t == Toggle::HfRmsNorm { 1 } else { 2 };
            assert!(n >= least, "{} has {n} entries", t.name());
            owned += n;
            assert_eq!(Toggle::from_name(t.name()), Some(t));
        }
        assert_eq!(owned, Entry::ALL.len());
        assert_eq!(Toggle::from_name("layernorm"), None);
    }
}
