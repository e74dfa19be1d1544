//! Which kernel variant serves a call: data from `registry/*.toml` (reviewed like code),
//! matched on (op, dtype, shape, SM). Anything without a match goes to stock with a reason.

use once_cell::sync::Lazy;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// Test hook (`torch.ops.torchfuse._serve_below_thresholds`): serve shapes below a variant's
/// measured `min_rows` too, so tests reach the kernels on small inputs.
pub static SERVE_BELOW_THRESHOLDS: AtomicBool = AtomicBool::new(false);

/// Why a call went to PyTorch's own kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StockReason {
    NoKernelYet,
    DisabledAtRuntime,
    UnsupportedDtype,
    MixedDtypes,
    UnsupportedSm,
    NoVariantForShape,
    NotFasterHere,
    EmptyInput,
    InvalidInput,
    KernelUnavailable,
    LaunchFailed,
    InternalError,
}

impl std::fmt::Display for StockReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StockReason::NoKernelYet => "no kernel yet",
            StockReason::DisabledAtRuntime => "disabled at run time",
            StockReason::UnsupportedDtype => "unsupported dtype",
            StockReason::MixedDtypes => "mixed input/parameter dtypes",
            StockReason::UnsupportedSm => "GPU architecture not served",
            StockReason::NoVariantForShape => "no variant for this shape",
            StockReason::NotFasterHere => "stock is faster at this shape",
            StockReason::EmptyInput => "empty input",
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

    /// The value of `TF_DTYPE` the kernels are compiled with.
    pub fn kernel_code(self) -> i64 {
        match self {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
        }
    }
}

/// A kernel operation the registry knows variants of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
pub enum KernelOp {
    #[serde(rename = "layer_norm_fwd")]
    LayerNormFwd,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub name: String,
    pub op: KernelOp,
    /// File in `kernels/`.
    pub source: String,
    /// `extern "C"` kernel name in that file.
    pub entry: String,
    pub dtypes: Vec<DType>,
    /// Inclusive range of SM versions (major * 10 + minor).
    pub sm: [u32; 2],
    /// Inclusive range of the innermost (normalized/hidden) size.
    pub hidden: [i64; 2],
    /// Below this many rows stock is faster: measured, see the note in the file.
    #[serde(default)]
    pub min_rows: i64,
    #[serde(default)]
    pub priority: i32,
    /// Compile-time parameters, passed to NVRTC as `-DTF_<NAME>=<value>`.
    #[serde(default)]
    pub params: BTreeMap<String, i64>,
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
        let mut variants = Vec::new();
        for (name, text) in files {
            let file: RegistryFile =
                toml::from_str(text).map_err(|e| format!("registry/{name}: {e}"))?;
            variants.extend(file.variant);
        }
        let mut names = std::collections::HashSet::new();
        for v in &variants {
            if !names.insert(v.name.as_str()) {
                return Err(format!("duplicate variant name {}", v.name));
            }
            if v.hidden[0] < 1 || v.hidden[0] > v.hidden[1] {
                return Err(format!("{}: bad hidden range {:?}", v.name, v.hidden));
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
                KernelOp::LayerNormFwd => crate::layer_norm::validate_variant(v)?,
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
            .filter(|&i| self.variants[i].op == op)
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

    /// The variant (index) that serves `req`, or why stock does.
    pub fn select(&self, req: &Request) -> Result<usize, StockReason> {
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
            .find(|&i| ignore_thresholds || req.rows >= self.variants[i].min_rows)
            .ok_or(StockReason::NotFasterHere)
    }
}

/// The registry built into this library.
pub static REGISTRY: Lazy<Result<Registry, String>> =
    Lazy::new(|| Registry::parse(crate::sources::REGISTRY_FILES));

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
[[variant]]
name = "small"
op = "layer_norm_fwd"
source = "layer_norm.cu"
entry = "layer_norm_fwd"
dtypes = ["f32", "bf16"]
sm = [80, 90]
hidden = [1, 1024]
min_rows = 64
priority = 1
params = { THREADS_PER_ROW = 32, ROWS_PER_BLOCK = 4, ELEMS_PER_THREAD = 32 }

[[variant]]
name = "small_sm90"
op = "layer_norm_fwd"
source = "layer_norm.cu"
entry = "layer_norm_fwd"
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
        let no_source = SAMPLE.replace("source = \"layer_norm.cu\"", "source = \"missing.cu\"");
        assert!(Registry::parse(&[("s.toml", &no_source)])
            .unwrap_err()
            .contains("missing.cu"));
        assert!(Registry::parse(&[("u.toml", &unknown)]).is_err());
        let op = SAMPLE.replace("op = \"layer_norm_fwd\"\nsource = \"layer_norm.cu\"\nentry = \"layer_norm_fwd\"\ndtypes = [\"f32\", \"bf16\"]", "op = \"softmax\"\nsource = \"layer_norm.cu\"\nentry = \"layer_norm_fwd\"\ndtypes = [\"f32\", \"bf16\"]");
        assert!(Registry::parse(&[("o.toml", &op)]).is_err());
    }

    #[test]
    fn built_in_registry_parses() {
        let r = REGISTRY.as_ref().expect("built-in registry");
        assert!(!r.variants().is_empty());
    }
}
