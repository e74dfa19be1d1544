//! Which kernel variant serves a call: data from `registry/*.toml` (reviewed like code),
//! matched on (op, dtype, shape, SM). Anything without a match goes to stock with a reason.
//!
//! The registry knows no op: it is generic over the op key (`ops::KernelOp`) and over the typed
//! params the ops layer makes of each variant's `params` table when the data is parsed (and
//! checks there, once).

use super::{DType, StockReason};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// Test hook (`torch.ops.torchfuse._serve_below_thresholds`): serve shapes outside a variant's
/// measured `min_rows`..`max_rows` too, so tests reach the kernels on any input.
pub static SERVE_BELOW_THRESHOLDS: AtomicBool = AtomicBool::new(false);

/// Benchmark hook (`torch.ops.torchfuse._force_variant`): calls of the named variant's op go
/// to that variant whenever it can serve them (thresholds ignored), and to stock otherwise.
pub static FORCED_VARIANT: RwLock<Option<String>> = RwLock::new(None);

/// An op key of the registry data: what `op = "..."` names in `registry/*.toml`.
pub trait OpKey: Copy + Eq + Hash + Debug + DeserializeOwned + Send + Sync + 'static {}
impl<T: Copy + Eq + Hash + Debug + DeserializeOwned + Send + Sync + 'static> OpKey for T {}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant<Op> {
    pub name: String,
    pub op: Op,
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
    /// Served only to calls that write their output narrowed (norm_cast: the norm and the cast
    /// to the next op's dtype in one pass; `Request::narrowed`): measured faster than stock's
    /// norm followed by the cast, at widths where the plain kernel is not faster than stock.
    #[serde(default)]
    pub narrowed_only: bool,
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
struct RegistryFile<Op> {
    variant: Vec<Variant<Op>>,
}

/// What a kernel is asked to serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Request<Op> {
    pub op: Op,
    pub dtype: DType,
    pub hidden: i64,
    pub rows: i64,
    pub sm: u32,
    /// The user requires deterministic algorithms (see `Variant::deterministic_all_rows`).
    pub deterministic: bool,
    /// The kernel writes its output in a narrower dtype than its input (see
    /// `Variant::narrowed_only`).
    pub narrowed: bool,
}

#[derive(Debug)]
pub struct Registry<Op, P> {
    variants: Vec<Variant<Op>>,
    /// Each variant's typed params, by index.
    params: Vec<P>,
    /// `CandidateKey` -> candidate variant indices, best first; rows are checked per
    /// call against the candidates' `min_rows`, so the hot path is one hash lookup.
    candidates: RwLock<HashMap<CandidateKey<Op>, Candidates>>,
}

/// (op, dtype, hidden, sm, narrowed): a request's fields other than its rows and determinism.
type CandidateKey<Op> = (Op, DType, i64, u32, bool);
/// Variant indices best first, or why none can serve.
type Candidates = Result<Vec<usize>, StockReason>;

/// Checks one variant's op-specific data (its params, its kernel source) and makes its typed
/// params.
pub type Prepare<'a, Op, P> = &'a dyn Fn(&Variant<Op>) -> Result<P, String>;

impl<Op: OpKey, P> Registry<Op, P> {
    pub fn parse(
        files: &[(&str, &str)],
        prepare: Prepare<Op, P>,
    ) -> Result<Registry<Op, P>, String> {
        Registry::parse_with_sweep(files, None, prepare)
    }

    /// `sweep`: (name, text) of a file of benchmark-only variants.
    pub fn parse_with_sweep(
        files: &[(&str, &str)],
        sweep: Option<(&str, &str)>,
        prepare: Prepare<Op, P>,
    ) -> Result<Registry<Op, P>, String> {
        let mut variants = Vec::new();
        for (name, text) in files {
            let file: RegistryFile<Op> =
                toml::from_str(text).map_err(|e| format!("registry/{name}: {e}"))?;
            variants.extend(file.variant);
        }
        if let Some((name, text)) = sweep {
            let file: RegistryFile<Op> =
                toml::from_str(text).map_err(|e| format!("{name}: {e}"))?;
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
        }
        let params = variants.iter().map(prepare).collect::<Result<_, _>>()?;
        Ok(Registry {
            variants,
            params,
            candidates: RwLock::new(HashMap::new()),
        })
    }

    pub fn variants(&self) -> &[Variant<Op>] {
        &self.variants
    }

    pub fn variant(&self, index: usize) -> &Variant<Op> {
        &self.variants[index]
    }

    /// The typed params of variant `index`.
    pub fn params(&self, index: usize) -> &P {
        &self.params[index]
    }

    /// The variants that may serve `req` at some row count (a plain call: not the narrowed_only
    /// ones), best first, or why none can.
    fn find_candidates(&self, req: &Request<Op>) -> Result<Vec<usize>, StockReason> {
        let (dtype, hidden, sm) = (req.dtype, req.hidden, req.sm);
        let of_op: Vec<usize> = (0..self.variants.len())
            .filter(|&i| {
                let v = &self.variants[i];
                v.op == req.op && !v.sweep_only && (req.narrowed || !v.narrowed_only)
            })
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
        // Every plain variant goes before the narrowed_only ones: a narrowed call takes the
        // plain call's kernel where that serves (its output is then the plain one's, cast).
        fits.sort_by_key(|&i| {
            let v = &self.variants[i];
            (v.narrowed_only, std::cmp::Reverse(v.priority), i)
        });
        Ok(fits)
    }

    /// The forced variant for `req` (benchmark hook), if one is forced for its op (a
    /// narrowed_only one only for a narrowed call: a plain call is then selected as usual).
    fn forced(&self, req: &Request<Op>) -> Option<Result<usize, StockReason>> {
        let forced = FORCED_VARIANT.read().unwrap_or_else(|p| p.into_inner());
        let name = forced.as_deref()?;
        let index = self
            .variants
            .iter()
            .position(|v| v.name == name && v.op == req.op && (req.narrowed || !v.narrowed_only))?;
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
    pub fn select(&self, req: &Request<Op>) -> Result<usize, StockReason> {
        if let Some(forced) = self.forced(req) {
            return forced;
        }
        let key = (req.op, req.dtype, req.hidden, req.sm, req.narrowed);
        let cached = self
            .candidates
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned();
        let candidates = match cached {
            Some(c) => c,
            None => {
                let c = self.find_candidates(req);
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
