//! Which kernel variant serves a call: data from `registry/*.toml` (reviewed like code),
//! matched on (op, dtype, shape, SM). Anything without a match goes to stock with a reason.

use once_cell::sync::Lazy;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// Test hook (`torch.ops.torchfuse._serve_below_thresholds`): serve shapes outside a variant's
/// measured `min_rows`..`max_rows` too, so tests reach the kernels on any input.
pub static SERVE_BELOW_THRESHOLDS: AtomicBool = AtomicBool::new(false);

/// Benchmark hook (`torch.ops.torchfuse._force_variant`): calls of the named variant's op go
/// to that variant whenever it can serve them (thresholds ignored), and to stock otherwise.
pub static FORCED_VARIANT: RwLock<Option<String>> = RwLock::new(None);

/// Why a call went to PyTorch's own kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StockReason {
    DisabledAtRuntime,
    UnsupportedDtype,
    MixedDtypes,
    UnsupportedSm,
    NoVariantForShape,
    NotFasterHere,
    EmptyInput,
    NothingRequested,
    ScaleGradByFreq,
    UserBackendChoice,
    AttentionFeature,
    InvalidInput,
    KernelUnavailable,
    LaunchFailed,
    InternalError,
}

impl std::fmt::Display for StockReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StockReason::DisabledAtRuntime => "disabled at run time",
            StockReason::UnsupportedDtype => "unsupported dtype",
            StockReason::MixedDtypes => "mixed input/parameter dtypes",
            StockReason::UnsupportedSm => "GPU architecture not served",
            StockReason::NoVariantForShape => "no variant for this shape",
            StockReason::NotFasterHere => "stock is faster at this shape",
            StockReason::EmptyInput => "empty input",
            StockReason::NothingRequested => "no output requested",
            StockReason::ScaleGradByFreq => "scale_grad_by_freq is not served",
            StockReason::UserBackendChoice => "SDPA backends restricted by the user",
            StockReason::AttentionFeature => {
                "attn_mask, dropout, nested inputs or a negative scale are not served"
            }
            StockReason::InvalidInput => "input stock rejects",
            StockReason::KernelUnavailable => "kernel unavailable",
            StockReason::LaunchFailed => "kernel launch failed",
            StockReason::InternalError => "internal error",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
pub enum DType {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    BF16,
    #[serde(rename = "f16")]
    F16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Elements in one 16-byte vector (`TF_VEC` in the kernels).
    pub fn vector_elems(self) -> i64 {
        (16 / self.size_bytes()) as i64
    }

    /// The value of `TF_DTYPE` the kernels are compiled with.
    pub fn kernel_code(self) -> i64 {
        match self {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
        }
    }
}

const ADAM_CAPACITY_DEFINE: &str = "-DTF_ADAM_MAX_TENSORS=500";
const _: () = assert!(crate::adam::MAX_TENSORS_PER_LAUNCH == 500);

/// A kernel operation the registry knows variants of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
pub enum KernelOp {
    #[serde(rename = "layer_norm_fwd")]
    LayerNormFwd,
    #[serde(rename = "layer_norm_bwd")]
    LayerNormBwd,
    #[serde(rename = "rms_norm_fwd")]
    RmsNormFwd,
    #[serde(rename = "rms_norm_bwd")]
    RmsNormBwd,
    /// `_fused_adam_` / `_fused_adamw_`; a request's `rows` is the step's total elements.
    #[serde(rename = "adam_step")]
    AdamStep,
    /// `embedding`; `hidden` is the embedding width, `rows` the number of indices.
    #[serde(rename = "embedding_fwd")]
    EmbeddingFwd,
    /// `embedding_dense_backward`; as the forward.
    #[serde(rename = "embedding_bwd")]
    EmbeddingBwd,
    /// scaled_dot_product_attention with `is_causal`, forward and backward; `hidden` is the
    /// head dim, `rows` the score elements B * H * Lq * Lk.
    #[serde(rename = "attention_causal")]
    AttentionCausal,
    /// As `AttentionCausal`, without a mask.
    #[serde(rename = "attention_full")]
    AttentionFull,
}

impl KernelOp {
    /// The `extern "C"` kernels of the variant's source this op launches.
    pub fn entries(self) -> &'static [&'static str] {
        match self {
            KernelOp::LayerNormFwd | KernelOp::RmsNormFwd => &["norm_fwd"],
            KernelOp::LayerNormBwd | KernelOp::RmsNormBwd => &["norm_bwd", "norm_bwd_reduce"],
            KernelOp::AdamStep => &["adam_step", "adam_step_small"],
            KernelOp::EmbeddingFwd => &["emb_fwd"],
            KernelOp::EmbeddingBwd => &[
                "emb_sort_count",
                "emb_sort_scatter",
                "emb_bwd_reduce",
                "emb_bwd_finish",
                "emb_zero_rows",
                "emb_sort_cluster",
                "emb_mark_rows",
                "emb_zero_rows_by_word",
            ],
            KernelOp::AttentionCausal | KernelOp::AttentionFull => {
                &["attn_fwd", "attn_bwd_prep", "attn_bwd_dkdv", "attn_bwd_dq"]
            }
        }
    }

    /// Preprocessor definitions the op adds to the variant's own parameters.
    pub fn defines(self) -> &'static [&'static str] {
        match self {
            KernelOp::LayerNormFwd => &["-DTF_NORM_FWD=1", "-DTF_RMS=0"],
            KernelOp::LayerNormBwd => &["-DTF_NORM_BWD=1", "-DTF_RMS=0"],
            KernelOp::RmsNormFwd => &["-DTF_NORM_FWD=1", "-DTF_RMS=1"],
            KernelOp::RmsNormBwd => &["-DTF_NORM_BWD=1", "-DTF_RMS=1"],
            KernelOp::AdamStep => &[ADAM_CAPACITY_DEFINE],
            KernelOp::EmbeddingFwd
            | KernelOp::EmbeddingBwd
            | KernelOp::AttentionCausal
            | KernelOp::AttentionFull => &[],
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub name: String,
    pub op: KernelOp,
    /// File in `kernels/`.
    pub source: String,
    pub dtypes: Vec<DType>,
    /// Inclusive range of SM versions (major * 10 + minor).
    pub sm: [u32; 2],
    /// Inclusive range of the innermost (normalized/hidden) size; ops without one omit it.
    #[serde(default = "any_size")]
    pub hidden: [i64; 2],
    /// Below this many rows stock is faster: measured, see the note in the file.
    #[serde(default)]
    pub min_rows: i64,
    /// Above this many rows stock is as fast or faster: measured, see the note in the file.
    #[serde(default = "any_rows")]
    pub max_rows: i64,
    /// With deterministic algorithms required, stock's own choice can be slower (attention:
    /// FlashAttention-2 with its deterministic backward instead of cuDNN); true: measured
    /// faster than that at every size, so min_rows/max_rows do not apply then.
    #[serde(default)]
    pub deterministic_all_rows: bool,
    /// Served only when deterministic algorithms are required: a variant measured faster
    /// than stock's deterministic choice only (with `deterministic_all_rows`, at any size).
    #[serde(default)]
    pub deterministic_only: bool,
    #[serde(default)]
    pub priority: i32,
    /// Compile-time parameters, passed to NVRTC as `-DTF_<NAME>=<value>`.
    #[serde(default)]
    pub params: BTreeMap<String, i64>,
    /// Loaded from `TORCHFUSE_REGISTRY_EXTRA` (benchmark sweeps): served only when forced by
    /// name (`torch.ops.torchfuse._force_variant`), never chosen on its own.
    #[serde(skip)]
    pub sweep_only: bool,
}

fn any_size() -> [i64; 2] {
    [1, i64::MAX]
}

fn any_rows() -> i64 {
    i64::MAX
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryFile {
    variant: Vec<Variant>,
}

/// What a kernel is asked to serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub op: KernelOp,
    pub dtype: DType,
    pub hidden: i64,
    pub rows: i64,
    pub sm: u32,
    /// The user requires deterministic algorithms (see `Variant::deterministic_all_rows`).
    pub deterministic: bool,
}

#[derive(Debug)]
pub struct Registry {
    variants: Vec<Variant>,
    /// (op, dtype, hidden, sm) -> candidate variant indices, best first; rows are checked per
    /// call against the candidates' `min_rows`, so the hot path is one hash lookup.
    candidates: RwLock<HashMap<CandidateKey, Result<Vec<usize>, StockReason>>>,
}

type CandidateKey = (KernelOp, DType, i64, u32);

impl Registry {
    pub fn parse(files: &[(&str, &str)]) -> Result<Registry, String> {
        Registry::parse_with_sweep(files, None)
    }

    /// `sweep`: (name, text) of a file of benchmark-only variants.
    pub fn parse_with_sweep(
        files: &[(&str, &str)],
        sweep: Option<(&str, &str)>,
    ) -> Result<Registry, String> {
        let mut variants = Vec::new();
        for (name, text) in files {
            let file: RegistryFile =
                toml::from_str(text).map_err(|e| format!("registry/{name}: {e}"))?;
            variants.extend(file.variant);
        }
        if let Some((name, text)) = sweep {
            let file: RegistryFile = toml::from_str(text).map_err(|e| format!("{name}: {e}"))?;
            variants.extend(file.variant.into_iter().map(|mut v| {
                v.sweep_only = true;
                v
            }));
        }
        let mut names = std::collections::HashSet::new();
        for v in &variants {
            if !names.insert(v.name.as_str()) {
                return Err(format!("duplicate variant name {}", v.name));
            }
            if v.hidden[0] < 1 || v.hidden[0] > v.hidden[1] {
                return Err(format!("{}: bad hidden range {:?}", v.name, v.hidden));
            }
            if v.min_rows > v.max_rows {
                return Err(format!("{}: min_rows above max_rows", v.name));
            }
            if v.deterministic_only && !v.deterministic_all_rows {
                return Err(format!(
                    "{}: deterministic_only takes deterministic_all_rows",
                    v.name
                ));
            }
            if v.sm[0] > v.sm[1] {
                return Err(format!("{}: bad sm range {:?}", v.name, v.sm));
            }
            if v.dtypes.is_empty() {
                return Err(format!("{}: no dtypes", v.name));
            }
            if crate::sources::kernel_source(&v.source).is_none() {
                return Err(format!("{}: no kernel source {}", v.name, v.source));
            }
            match v.op {
                KernelOp::LayerNormFwd
                | KernelOp::LayerNormBwd
                | KernelOp::RmsNormFwd
                | KernelOp::RmsNormBwd => crate::norm::validate_variant(v)?,
                KernelOp::AdamStep => crate::adam::validate_variant(v)?,
                KernelOp::EmbeddingFwd | KernelOp::EmbeddingBwd => {
                    crate::embedding::validate_variant(v)?
                }
                KernelOp::AttentionCausal | KernelOp::AttentionFull => {
                    crate::attention::validate_variant(v)?
                }
            }
        }
        Ok(Registry {
            variants,
            candidates: RwLock::new(HashMap::new()),
        })
    }

    pub fn variants(&self) -> &[Variant] {
        &self.variants
    }

    pub fn variant(&self, index: usize) -> &Variant {
        &self.variants[index]
    }

    fn find_candidates(
        &self,
        op: KernelOp,
        dtype: DType,
        hidden: i64,
        sm: u32,
    ) -> Result<Vec<usize>, StockReason> {
        let of_op: Vec<usize> = (0..self.variants.len())
            .filter(|&i| self.variants[i].op == op && !self.variants[i].sweep_only)
            .collect();
        let with_dtype: Vec<usize> = of_op
            .into_iter()
            .filter(|&i| self.variants[i].dtypes.contains(&dtype))
            .collect();
        if with_dtype.is_empty() {
            return Err(StockReason::UnsupportedDtype);
        }
        let with_sm: Vec<usize> = with_dtype
            .into_iter()
            .filter(|&i| (self.variants[i].sm[0]..=self.variants[i].sm[1]).contains(&sm))
            .collect();
        if with_sm.is_empty() {
            return Err(StockReason::UnsupportedSm);
        }
        let mut fits: Vec<usize> = with_sm
            .into_iter()
            .filter(|&i| {
                (self.variants[i].hidden[0]..=self.variants[i].hidden[1]).contains(&hidden)
            })
            .collect();
        if fits.is_empty() {
            return Err(StockReason::NoVariantForShape);
        }
        fits.sort_by_key(|&i| (std::cmp::Reverse(self.variants[i].priority), i));
        Ok(fits)
    }

    /// The forced variant for `req` (benchmark hook), if one is forced for its op.
    fn forced(&self, req: &Request) -> Option<Result<usize, StockReason>> {
        let forced = FORCED_VARIANT.read().unwrap_or_else(|p| p.into_inner());
        let name = forced.as_deref()?;
        let index = self
            .variants
            .iter()
            .position(|v| v.name == name && v.op == req.op)?;
        let v = &self.variants[index];
        let fits = v.dtypes.contains(&req.dtype)
            && (v.sm[0]..=v.sm[1]).contains(&req.sm)
            && (v.hidden[0]..=v.hidden[1]).contains(&req.hidden);
        Some(if fits {
            Ok(index)
        } else {
            Err(StockReason::NoVariantForShape)
        })
    }

    /// The variant (index) that serves `req`, or why stock does.
    pub fn select(&self, req: &Request) -> Result<usize, StockReason> {
        if let Some(forced) = self.forced(req) {
            return forced;
        }
        let key = (req.op, req.dtype, req.hidden, req.sm);
        let cached = self
            .candidates
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned();
        let candidates = match cached {
            Some(c) => c,
            None => {
                let c = self.find_candidates(req.op, req.dtype, req.hidden, req.sm);
                self.candidates
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key, c.clone());
                c
            }
        }?;
        let ignore_thresholds = SERVE_BELOW_THRESHOLDS.load(Ordering::Relaxed);
        candidates
            .into_iter()
            .find(|&i| {
                let v = &self.variants[i];
                if v.deterministic_only {
                    return req.deterministic;
                }
                ignore_thresholds
                    || (req.deterministic && v.deterministic_all_rows)
                    || (v.min_rows..=v.max_rows).contains(&req.rows)
            })
            .ok_or(StockReason::NotFasterHere)
    }
}

/// The registry built into this library.
/// With `TORCHFUSE_REGISTRY_EXTRA=<file.toml>`, that file's variants are added as sweep-only.
pub static REGISTRY: Lazy<Result<Registry, String>> = Lazy::new(|| {
    let extra = std::env::var_os("TORCHFUSE_REGISTRY_EXTRA").map(std::path::PathBuf::from);
    match extra {
        None => Registry::parse(crate::sources::REGISTRY_FILES),
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("TORCHFUSE_REGISTRY_EXTRA {path:?}: {e}"))?;
            let name = path.display().to_string();
            Registry::parse_with_sweep(crate::sources::REGISTRY_FILES, Some((&name, &text)))
        }
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
[[variant]]
name = "small"
op = "layer_norm_fwd"
source = "norm.cu"
dtypes = ["f32", "bf16"]
sm = [80, 90]
hidden = [1, 1024]
min_rows = 64
priority = 1
params = { THREADS_PER_ROW = 32, ROWS_PER_BLOCK = 4, ELEMS_PER_THREAD = 32 }

[[variant]]
name = "small_sm90"
op = "layer_norm_fwd"
source = "norm.cu"
dtypes = ["bf16"]
sm = [90, 90]
hidden = [512, 1024]
min_rows = 64
priority = 5
params = { THREADS_PER_ROW = 32, ROWS_PER_BLOCK = 4, ELEMS_PER_THREAD = 32 }
"#;

    fn req(dtype: DType, hidden: i64, rows: i64, sm: u32) -> Request {
        Request {
            op: KernelOp::LayerNormFwd,
            dtype,
            hidden,
            rows,
            sm,
            deterministic: false,
        }
    }

    #[test]
    fn selection_follows_the_data() {
        let r = Registry::parse(&[("sample.toml", SAMPLE)]).unwrap();
        let name = |q: Request| r.select(&q).map(|i| r.variant(i).name.clone());
        assert_eq!(
            name(req(DType::BF16, 768, 4096, 90)),
            Ok("small_sm90".into())
        );
        assert_eq!(name(req(DType::BF16, 768, 4096, 80)), Ok("small".into()));
        assert_eq!(name(req(DType::BF16, 256, 4096, 90)), Ok("small".into()));
        assert_eq!(name(req(DType::F32, 768, 4096, 90)), Ok("small".into()));
        assert_eq!(
            name(req(DType::F16, 768, 4096, 90)),
            Err(StockReason::UnsupportedDtype)
        );
        assert_eq!(
            name(req(DType::F32, 768, 4096, 75)),
            Err(StockReason::UnsupportedSm)
        );
        assert_eq!(
            name(req(DType::F32, 2048, 4096, 90)),
            Err(StockReason::NoVariantForShape)
        );
        assert_eq!(
            name(req(DType::F32, 768, 8, 90)),
            Err(StockReason::NotFasterHere)
        );
        // Cached answers are the same answers.
        assert_eq!(
            name(req(DType::BF16, 768, 4096, 90)),
            Ok("small_sm90".into())
        );
        assert_eq!(
            name(req(DType::BF16, 768, 8, 90)),
            Err(StockReason::NotFasterHere)
        );
    }

    #[test]
    fn deterministic_only_variants_serve_deterministic_calls_that_others_leave() {
        let sample = r#"
[[variant]]
name = "routed"
op = "layer_norm_fwd"
source = "norm.cu"
dtypes = ["bf16"]
sm = [90, 90]
hidden = [1, 1024]
max_rows = 1000
priority = 1
params = { THREADS_PER_ROW = 32, ROWS_PER_BLOCK = 4, ELEMS_PER_THREAD = 32 }

[[variant]]
name = "deterministic_large"
op = "layer_norm_fwd"
source = "norm.cu"
dtypes = ["bf16"]
sm = [90, 90]
hidden = [1, 1024]
priority = 1
deterministic_all_rows = true
deterministic_only = true
params = { THREADS_PER_ROW = 32, ROWS_PER_BLOCK = 4, ELEMS_PER_THREAD = 32 }
"#;
        let r = Registry::parse(&[("det.toml", sample)]).unwrap();
        let name = |rows: i64, deterministic: bool| {
            let q = Request {
                deterministic,
                ..req(DType::BF16, 768, rows, 90)
            };
            r.select(&q).map(|i| r.variant(i).name.clone())
        };
        assert_eq!(name(500, false), Ok("routed".into()));
        assert_eq!(name(500, true), Ok("routed".into()));
        assert_eq!(name(5000, false), Err(StockReason::NotFasterHere));
        assert_eq!(name(5000, true), Ok("deterministic_large".into()));
        let without_all_rows = sample.replace("deterministic_all_rows = true\n", "");
        assert!(Registry::parse(&[("d.toml", &without_all_rows)])
            .unwrap_err()
            .contains("deterministic_only takes"));
    }

    #[test]
    fn malformed_data_is_rejected() {
        let dup = format!("{SAMPLE}\n{}", SAMPLE.replace("small_sm90", "x"));
        assert!(Registry::parse(&[("d.toml", &dup)])
            .unwrap_err()
            .contains("duplicate"));
        let bad = SAMPLE.replace("hidden = [1, 1024]", "hidden = [2048, 1024]");
        assert!(Registry::parse(&[("b.toml", &bad)])
            .unwrap_err()
            .contains("hidden"));
        let unknown = SAMPLE.replace("priority = 1\n", "priority = 1\ncolour = 3\n");
        let too_wide = SAMPLE.replace("hidden = [1, 1024]", "hidden = [1, 1025]");
        assert!(Registry::parse(&[("w.toml", &too_wide)])
            .unwrap_err()
            .contains("holds 1024"));
        let no_source = SAMPLE.replace("source = \"norm.cu\"", "source = \"missing.cu\"");
        assert!(Registry::parse(&[("s.toml", &no_source)])
            .unwrap_err()
            .contains("missing.cu"));
        assert!(Registry::parse(&[("u.toml", &unknown)]).is_err());
        let op = SAMPLE.replacen("op = \"layer_norm_fwd\"", "op = \"softmax\"", 1);
        assert!(Registry::parse(&[("o.toml", &op)]).is_err());
    }

    /// Attention on sm 90: large calls go to stock (cuDNN), unless deterministic algorithms
    /// are required, where stock's choice is slower at every size (registry/attention.toml):
    /// they go to the persistent-forward variant then, small ones to the routed one.
    #[test]
    fn deterministic_mode_routes_every_attention_size_on_sm90() {
        let r = REGISTRY.as_ref().expect("built-in registry");
        let pick = |rows, deterministic, sm| {
            r.select(&Request {
                op: KernelOp::AttentionCausal,
                dtype: DType::BF16,
                hidden: 64,
                rows,
                sm,
                deterministic,
            })
            .map(|i| r.variant(i).name.clone())
        };
        let gpt2 = 8 * 12 * 1024 * 1024;
        assert_eq!(pick(gpt2, false, 90), Err(StockReason::NotFasterHere));
        assert_eq!(
            pick(gpt2, true, 90),
            Ok("attn_d64_causal_wg_persistent".to_string())
        );
        assert_eq!(pick(4096, false, 90), Ok("attn_d64_causal_wg".to_string()));
        assert_eq!(pick(4096, true, 90), Ok("attn_d64_causal_wg".to_string()));
        // No A100 was measured: sm 80 keeps its thresholds in either mode.
        assert_eq!(pick(gpt2, true, 80), Err(StockReason::NotFasterHere));
    }

    /// The built-in registry answers a table of calls as measured (registry/norm.toml).
    #[test]
    fn built_in_registry_routes_a_table_of_calls() {
        let r = REGISTRY.as_ref().expect("built-in registry");
        let pick = |op, dtype, hidden, rows, sm| {
            r.select(&Request {
                op,
                dtype,
                hidden,
                rows,
                sm,
                deterministic: false,
            })
            .map(|i| r.variant(i).name.clone())
        };
        use KernelOp::*;
        let served = [
            (LayerNormFwd, DType::BF16, 768, 16384, "ln_fwd_16bit_h768"),
            (LayerNormFwd, DType::F16, 1000, 16384, "ln_fwd_16bit_h1024"),
            (LayerNormFwd, DType::F32, 4096, 16384, "ln_fwd_f32_h4096"),
            (LayerNormBwd, DType::BF16, 8192, 8192, "ln_bwd_16bit_h8192"),
            (LayerNormBwd, DType::F32, 16384, 4096, "ln_bwd_f32_h16384"),
            (RmsNormFwd, DType::BF16, 4096, 16384, "rms_fwd_16bit_h4096"),
            (RmsNormBwd, DType::F32, 768, 16384, "rms_bwd_f32_h768"),
            (RmsNormBwd, DType::BF16, 2048, 16384, "rms_bwd_16bit_h2048"),
            // Rows split across a cluster of CTAs (sm 90; sm 80: see below).
            (LayerNormFwd, DType::F32, 65536, 2048, "ln_fwd_f32_h65536"),
            (
                LayerNormBwd,
                DType::BF16,
                16384,
                4096,
                "ln_bwd_16bit_h16384",
            ),
            (RmsNormBwd, DType::F16, 20000, 4096, "rms_bwd_16bit_h32768"),
            (RmsNormFwd, DType::BF16, 40000, 2048, "rms_fwd_16bit_h65536"),
            // Adam: any size of step (rows = elements), no threshold (registry/adam.toml).
            (AdamStep, DType::F32, 1, 1, "adam_f32"),
            (AdamStep, DType::F32, 1, 354_823_168, "adam_f32"),
            (AdamStep, DType::BF16, 1, 124_439_808, "adam_16bit"),
            (AdamStep, DType::F16, 1, 1024, "adam_16bit"),
            // Embedding (registry/embedding.toml).
            (EmbeddingFwd, DType::BF16, 768, 16384, "emb_fwd"),
            (EmbeddingFwd, DType::F32, 4096, 2048, "emb_fwd"),
            (EmbeddingBwd, DType::BF16, 768, 16384, "emb_bwd"),
            (EmbeddingBwd, DType::F32, 4096, 8192, "emb_bwd"),
            (EmbeddingBwd, DType::F16, 768, 131072, "emb_bwd"),
            (EmbeddingBwd, DType::F32, 64, 4096, "emb_bwd"),
            (EmbeddingBwd, DType::BF16, 768, 1024, "emb_bwd"),
            (EmbeddingBwd, DType::F32, 4096, 2048, "emb_bwd"),
            // Attention: small causal calls (rows = B*H*Lq*Lk), registry/attention.toml.
            (
                AttentionCausal,
                DType::BF16,
                64,
                12 * 128 * 128,
                "attn_d64_causal",
            ),
            (
                AttentionCausal,
                DType::F16,
                128,
                32 * 256 * 256,
                "attn_d128_causal",
            ),
            (AttentionCausal, DType::BF16, 64, 1 << 22, "attn_d64_causal"),
            (
                AttentionFull,
                DType::BF16,
                64,
                12 * 128 * 128,
                "attn_d64_full",
            ),
            (
                AttentionFull,
                DType::F16,
                128,
                16 * 512 * 512,
                "attn_d128_full",
            ),
        ];
        for (op, dtype, hidden, rows, prefix) in served {
            let name =
                pick(op, dtype, hidden, rows, 90).unwrap_or_else(|e| panic!("{prefix}: {e}"));
            assert!(
                name.starts_with(prefix),
                "{op:?} {dtype:?} {hidden}: {name}"
            );
            // Hopper's attention forward is the warpgroup-MMA variant, and Hopper splits wide
            // rows across clusters; sm_80 runs the same variants otherwise.
            let attention = matches!(op, AttentionCausal | AttentionFull);
            assert_eq!(attention, name.ends_with("_wg"), "{name}");
            let ampere = pick(op, dtype, hidden, rows, 80);
            // Hopper sorts up to 32768 embedding tokens of rows up to 1024 wide on one cluster,
            // sm_80 in launches.
            if op == EmbeddingBwd {
                assert_eq!(
                    name.contains("_cluster_sort"),
                    rows <= 32768 && hidden <= 1024,
                    "{name}"
                );
                assert_eq!(ampere, Ok(name.replace("_cluster_sort", "_sorted")));
                continue;
            }
            // A trailing _s<MIN_BLOCKS> (shared-memory accumulators) follows the cluster size.
            let shape = match name.rsplit_once("_s") {
                Some((head, blocks)) if blocks.parse::<u32>().is_ok() => head,
                _ => name.as_str(),
            };
            match shape.rsplit_once("_c") {
                Some((_, cluster)) if cluster.parse::<u32>().is_ok() => match hidden {
                    ..=16384 => assert!(ampere.is_ok_and(|n| n.starts_with(prefix) && n != name)),
                    _ => assert_eq!(ampere, Err(StockReason::NoVariantForShape)),
                },
                _ => assert_eq!(ampere, Ok(name.trim_end_matches("_wg").to_string())),
            }
        }
        let stock = [
            // Launch-bound: stock is as fast.
            (
                LayerNormFwd,
                DType::BF16,
                768,
                512,
                StockReason::NotFasterHere,
            ),
            (
                LayerNormBwd,
                DType::BF16,
                768,
                2048,
                StockReason::NotFasterHere,
            ),
            // Measured no faster than stock.
            (
                RmsNormFwd,
                DType::F32,
                1024,
                16384,
                StockReason::NoVariantForShape,
            ),
            (
                RmsNormFwd,
                DType::BF16,
                2048,
                16384,
                StockReason::NoVariantForShape,
            ),
            // Rows wider than 8 CTAs of a cluster hold.
            (
                LayerNormFwd,
                DType::F32,
                65537,
                2048,
                StockReason::NoVariantForShape,
            ),
            (
                RmsNormBwd,
                DType::BF16,
                131072,
                2048,
                StockReason::NoVariantForShape,
            ),
            // Large gathers: stock's index_select is as fast.
            (
                EmbeddingFwd,
                DType::BF16,
                768,
                131072,
                StockReason::NotFasterHere,
            ),
            (
                EmbeddingFwd,
                DType::F32,
                4096,
                16384,
                StockReason::NotFasterHere,
            ),
            // Small backward calls: stock's memset and one small kernel win.
            (
                EmbeddingBwd,
                DType::BF16,
                768,
                1023,
                StockReason::NotFasterHere,
            ),
            (
                EmbeddingBwd,
                DType::F32,
                4096,
                2047,
                StockReason::NotFasterHere,
            ),
            // Attention: stock's cuDNN is faster on every larger call, masked or not.
            (
                AttentionCausal,
                DType::BF16,
                64,
                96 * 1024 * 1024,
                StockReason::NotFasterHere,
            ),
            (
                AttentionFull,
                DType::BF16,
                128,
                4 * 16 * 512 * 512,
                StockReason::NotFasterHere,
            ),
            (
                AttentionCausal,
                DType::F32,
                64,
                16 * 128 * 128,
                StockReason::UnsupportedDtype,
            ),
            (
                AttentionCausal,
                DType::BF16,
                96,
                16 * 128 * 128,
                StockReason::NoVariantForShape,
            ),
            (
                LayerNormFwd,
                DType::BF16,
                768,
                16384,
                StockReason::UnsupportedSm,
            ),
        ];
        for (i, (op, dtype, hidden, rows, reason)) in stock.into_iter().enumerate() {
            let sm = if i == stock.len() - 1 { 75 } else { 90 };
            assert_eq!(
                pick(op, dtype, hidden, rows, sm),
                Err(reason),
                "{op:?} {dtype:?} {hidden}x{rows}"
            );
        }
        // Pre-Ampere GPUs get stock's Adam (the kernels need sm_80's bf16 conversions).
        assert_eq!(
            pick(AdamStep, DType::F32, 1, 1 << 20, 75),
            Err(StockReason::UnsupportedSm)
        );
    }

    #[test]
    fn sweep_variants_serve_only_when_forced() {
        let sweep = SAMPLE
            .replace("name = \"small\"", "name = \"cand\"")
            .replace("name = \"small_sm90\"", "name = \"cand2\"");
        let r =
            Registry::parse_with_sweep(&[("sample.toml", SAMPLE)], Some(("sweep.toml", &sweep)))
                .unwrap();
        let q = req(DType::F32, 768, 4096, 90);
        assert_eq!(r.variant(r.select(&q).unwrap()).name, "small");
        *FORCED_VARIANT.write().unwrap() = Some("cand".into());
        assert_eq!(r.variant(r.select(&q).unwrap()).name, "cand");
        // Forced but unable to serve this call: stock, not another variant.
        assert_eq!(
            r.select(&req(DType::F32, 2048, 4096, 90)),
            Err(StockReason::NoVariantForShape)
        );
        *FORCED_VARIANT.write().unwrap() = None;
        assert_eq!(r.variant(r.select(&q).unwrap()).name, "small");
    }

    #[test]
    fn built_in_registry_parses() {
        let r = REGISTRY.as_ref().expect("built-in registry");
        assert!(!r.variants().is_empty());
    }
}
