//! The op families: one module each (norm, adam, embedding, attention, gelu, cross_entropy, swiglu, rotary,
//! column_sum, mixed_add), each implementing
//! `Family`: the aten entries it serves and the boundary struct that describes their calls,
//! how a call is logged, how it is served (checked, planned, launched: `Served`, or the
//! reason stock runs it), and for the registry the kernels it launches (by name), the
//! constants it shares with them (defines) and the check of its variants' params. Here too:
//! the registry's op keys, the built-in registry, and `select`, which every op calls to find
//! its variant and kernels.

pub mod adam;
pub mod attention;
pub mod column_sum;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod gelu;
pub mod linear;
pub mod mixed_add;
pub mod norm;
pub mod params;
pub mod rotary;
pub mod swiglu;

use crate::abi::types::TfTensor;
use crate::gpu::args::Field;
use crate::gpu::{self, Device, Kernels, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{self, DType, StockReason};
use once_cell::sync::Lazy;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tch::Tensor;

/// What a served call hands back: up to three outputs (None: an undefined tensor, an output
/// not requested) and the registry variant that ran.
pub struct Served {
    pub outputs: [Option<Tensor>; 3],
    pub kernel: &'static str,
    /// Served by an aten op the glue calls next (hf_rms_norm's `aten::rms_norm`), whose own
    /// override counts the call with the kernel that ran: not counted here too.
    pub routed: bool,
}

impl Served {
    pub fn new(kernel: &'static str, outputs: [Option<Tensor>; 3]) -> Served {
        Served {
            outputs,
            kernel,
            routed: false,
        }
    }

    /// A call the glue serves by calling the aten op named `op` (see `routed`).
    pub fn routed(op: &'static str) -> Served {
        Served {
            outputs: [None, None, None],
            kernel: op,
            routed: true,
        }
    }
}

/// One op family: the same shape for every one.
pub trait Family {
    /// The boundary struct its entries' calls arrive in (`torchfuse_abi.h`).
    type Call;

    /// Which family of the op catalog (src/catalog.toml) it is.
    const FAMILY: OpFamily;

    /// Whether `entry` is one of this family's (the catalog says).
    fn serves(entry: Entry) -> bool {
        entry.family() == Self::FAMILY
    }

    /// The dtype name and shape a call is logged and counted under; None: not a call to
    /// count (a required tensor is missing).
    ///
    /// # Safety
    /// `call` is as the glue built it: its tensors are valid for the call.
    unsafe fn describe(entry: Entry, call: &Self::Call) -> Option<(&'static str, Vec<i64>)>;

    /// A tensor of the call whose sizes are symbolic (a compiler's trace under dynamic shapes)
    /// or whose data the glue did not read (`TfTensor::opaque`: a subclass or wrapper), if any:
    /// such a call goes to stock before anything reads a size or an address.
    ///
    /// # Safety
    /// As `describe`.
    unsafe fn unreadable(entry: Entry, call: &Self::Call) -> Option<&TfTensor>;

    /// Whether the answer to this call is counted in the stats (default: yes). A call that only
    /// asks whether a kernel would serve (a compiler's trace) is not: the calls its graph makes
    /// at run time are.
    ///
    /// # Safety
    /// As `describe`.
    unsafe fn counted(_call: &Self::Call) -> bool {
        true
    }

    /// Bad input stock would not survive: the error to raise instead (default: none).
    ///
    /// # Safety
    /// As `describe`.
    unsafe fn refuse(_entry: Entry, _call: &Self::Call) -> Option<String> {
        None
    }

    /// Serves the call with a fused kernel, or says why stock must. `shape` is what
    /// `describe` read.
    ///
    /// # Safety
    /// As `describe`.
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &Self::Call,
        shape: &[i64],
    ) -> Result<Served, StockReason>;

    /// The `extern "C"` kernels of its source that `op` launches, by name.
    fn kernels(op: KernelOp) -> &'static [&'static str];

    /// The fields of the argument struct (`kernel_args!`) each of its kernels is launched
    /// with, by kernel name: the registry test checks them against the kernel's parameters.
    fn kernel_args(kernel: &str) -> Option<&'static [Field]>;

    /// The constants its kernels share with its Rust side, as `-D` options (the kernel
    /// `#error`s without them).
    fn defines(op: KernelOp) -> Vec<String>;

    /// A variant's typed params (`params::parse`), with defaults.
    type Params: Serialize + Send + Sync + 'static;

    /// Reads and checks a variant's params, once, when the registry is parsed.
    fn prepare(v: &Variant) -> Result<Self::Params, String>;

    /// The family's own params among a variant's (another family's: a bug, stock serves).
    fn params(p: &OpParams) -> Result<&Self::Params, StockReason> {
        p.get().ok_or(StockReason::InternalError)
    }
}

/// A variant's typed params, whichever family's (`Family::params` takes them back), with what
/// its module is built from: the `-D` options (the op's shared constants, then every param
/// as `-DTF_<NAME>=<value>`, defaults included) and the kernels it launches.
pub struct OpParams {
    typed: Box<dyn std::any::Any + Send + Sync>,
    defines: Vec<String>,
    kernels: &'static [&'static str],
    kernel_args: fn(&str) -> Option<&'static [Field]>,
}

impl std::fmt::Debug for OpParams {
    /// The params as NVRTC sees them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.defines).finish()
    }
}

impl OpParams {
    /// Family `F`'s params of a variant of `op`, read and checked.
    fn prepare<F: Family>(op: KernelOp, v: &Variant) -> Result<OpParams, String> {
        let typed = F::prepare(v)?;
        let mut defines = F::defines(op);
        defines.extend(params::defines(&typed));
        Ok(OpParams {
            typed: Box::new(typed),
            defines,
            kernels: F::kernels(op),
            kernel_args: F::kernel_args,
        })
    }

    /// The params as `P`, if they are a `P`.
    pub fn get<P: 'static>(&self) -> Option<&P> {
        self.typed.downcast_ref()
    }

    /// The `extern "C"` kernels of the variant's source its op launches, by name.
    pub fn kernels(&self) -> &'static [&'static str] {
        self.kernels
    }

    /// The argument struct's fields of one of `kernels()`.
    pub fn kernel_args(&self, kernel: &str) -> Option<&'static [Field]> {
        (self.kernel_args)(kernel)
    }
}

include!(concat!(env!("OUT_DIR"), "/kernel_ops.rs"));

impl KernelOp {
    /// Reads and checks a variant's op-specific params when the registry is parsed, by the
    /// op's family (the catalog's `[[kernel_op]]`).
    fn prepare(self, v: &Variant) -> Result<OpParams, String> {
        match self.family() {
            OpFamily::Norm => OpParams::prepare::<norm::Norm>(self, v),
            OpFamily::Adam => OpParams::prepare::<adam::Adam>(self, v),
            OpFamily::Embedding => OpParams::prepare::<embedding::Embedding>(self, v),
            OpFamily::Attention => OpParams::prepare::<attention::Attention>(self, v),
            OpFamily::Gelu => OpParams::prepare::<gelu::Gelu>(self, v),
            OpFamily::CrossEntropy => OpParams::prepare::<cross_entropy::CrossEntropy>(self, v),
            OpFamily::Swiglu => OpParams::prepare::<swiglu::Swiglu>(self, v),
            OpFamily::Rotary => OpParams::prepare::<rotary::Rotary>(self, v),
            OpFamily::ColumnSum => OpParams::prepare::<column_sum::ColumnSum>(self, v),
            OpFamily::MixedAdd => OpParams::prepare::<mixed_add::MixedAdd>(self, v),
            OpFamily::Linear => OpParams::prepare::<linear::Linear>(self, v),
        }
    }
}

pub type Variant = select::Variant<KernelOp>;
pub type Request = select::Request<KernelOp>;
pub type Registry = select::Registry<KernelOp, OpParams>;

/// Checks a variant's source, and reads and checks its op-specific params.
fn prepare(v: &Variant) -> Result<OpParams, String> {
    if gpu::sources::kernel_source(&v.source).is_none() {
        return Err(format!("{}: no kernel source {}", v.name, v.source));
    }
    v.op.prepare(v)
}

/// Parses registry data, every variant checked by its op.
pub fn parse(files: &[(&str, &str)]) -> Result<Registry, String> {
    Registry::parse(files, &prepare)
}

/// As `parse`, with a file of benchmark-only variants (name, text).
pub fn parse_with_sweep(
    files: &[(&str, &str)],
    sweep: Option<(&str, &str)>,
) -> Result<Registry, String> {
    Registry::parse_with_sweep(files, sweep, &prepare)
}

/// The registry built into this library.
/// With `TORCHFUSE_REGISTRY_EXTRA=<file.toml>`, that file's variants are added as sweep-only.
pub static REGISTRY: Lazy<Result<Registry, String>> = Lazy::new(|| {
    let extra = std::env::var_os("TORCHFUSE_REGISTRY_EXTRA").map(std::path::PathBuf::from);
    match extra {
        None => parse(select::REGISTRY_FILES),
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("TORCHFUSE_REGISTRY_EXTRA {path:?}: {e}"))?;
            let name = path.display().to_string();
            parse_with_sweep(select::REGISTRY_FILES, Some((&name, &text)))
        }
    }
});

/// NVRTC options for a variant with `params` at `dtype`: the dtype, the op's shared constants,
/// every one of the variant's params as `-DTF_<NAME>=<value>`.
pub fn compile_options(params: &OpParams, dtype: DType, arch: &str) -> Vec<String> {
    let mut options = gpu::nvrtc::base_options(arch);
    options.push(format!("-DTF_DTYPE={}", dtype.kernel_code()));
    options.extend(params.defines.iter().cloned());
    options
}

/// `compile_options` with the output's dtype apart from `dtype` where `narrow` names one
/// (`TF_Y_DTYPE`: a norm writing the dtype its consumers cast to, norm_cast).
pub fn compile_options_narrowed(
    params: &OpParams,
    dtype: DType,
    narrow: Option<DType>,
    arch: &str,
) -> Vec<String> {
    let mut options = compile_options(params, dtype, arch);
    if let Some(y) = narrow {
        options.push(format!("-DTF_Y_DTYPE={}", y.kernel_code()));
    }
    options
}

/// What serves a call: the launch's GPU, the registry's variant and its loaded kernels.
pub struct Selected {
    pub gpu: Arc<Device>,
    pub variant: &'static Variant,
    pub kernels: Arc<Kernels>,
    /// The variant's typed params (`Family::params` takes a family's own).
    pub params: &'static OpParams,
}

/// The registry's variant for `request(sm)` on `launch`'s GPU with its kernels loaded, or why
/// stock serves the call.
pub fn select(
    launch: Launch,
    request: impl FnOnce(u32) -> Request,
) -> Result<Selected, StockReason> {
    select_with(launch, request, None).map(|(selected, _)| selected)
}

/// `select`, and the same variant's kernels compiled with their output in `narrow`'s dtype
/// (`compile_options_narrowed`): one selection, two modules.
pub fn select_narrowed(
    launch: Launch,
    request: impl FnOnce(u32) -> Request,
    narrow: DType,
) -> Result<(Selected, Arc<Kernels>), StockReason> {
    let (selected, narrowed) = select_with(launch, request, Some(narrow))?;
    Ok((selected, narrowed.ok_or(StockReason::InternalError)?))
}

fn select_with(
    launch: Launch,
    request: impl FnOnce(u32) -> Request,
    narrow: Option<DType>,
) -> Result<(Selected, Option<Arc<Kernels>>), StockReason> {
    let gpu = gpu::device(launch.device).map_err(|e| {
        tracing::debug!("cuda:{} unavailable to torchfuse: {e}", launch.device);
        StockReason::KernelUnavailable
    })?;
    // The driver calls below and in the op (module loads, TMA descriptors, launches) need the
    // context current on this thread; a backward runs on autograd's device thread, where
    // nothing made it current before PyTorch's own first launch there.
    gpu.ctx.bind_to_thread().map_err(|e| {
        crate::runtime::logging::warn_once(&format!("context cuda:{}", launch.device), || {
            format!(
                "cuda:{}: cannot make its context current on this thread: {e}; stock serves \
                 these calls",
                launch.device
            )
        });
        StockReason::KernelUnavailable
    })?;
    let registry = REGISTRY
        .as_ref()
        .map_err(|_| StockReason::KernelUnavailable)?;
    let req = Request {
        narrowed: narrow.is_some(),
        ..request(gpu.sm)
    };
    let index = registry.select(&req)?;
    let variant = registry.variant(index);
    let params = registry.params(index);
    let load = |narrow: Option<DType>| {
        gpu::modules::load(
            (index, req.dtype, narrow, launch.device),
            &gpu,
            &crate::runtime::config::get().cache_dir,
            || gpu::modules::ModuleSpec {
                label: match narrow {
                    None => format!("{} ({})", variant.name, req.dtype.name()),
                    Some(y) => format!("{} ({} to {})", variant.name, req.dtype.name(), y.name()),
                },
                source: &variant.source,
                options: compile_options_narrowed(params, req.dtype, narrow, &gpu.arch),
                kernels: params.kernels(),
            },
        )
        .ok_or(StockReason::KernelUnavailable)
    };
    let kernels = load(None)?;
    let narrowed = narrow.map(|y| load(Some(y))).transpose()?;
    Ok((
        Selected {
            gpu,
            variant,
            kernels,
            params,
        },
        narrowed,
    ))
}

/// A failed launch of `variant`'s kernel: warned once, and stock serves the call.
pub fn launch_failed(variant: &Variant, e: cudarc::driver::DriverError) -> StockReason {
    crate::runtime::logging::warn_once_launch_failure(&variant.name, &e.to_string());
    StockReason::LaunchFailed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::registry::FORCED_VARIANT;

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
            narrowed: false,
        }
    }

    #[test]
    fn selection_follows_the_data() {
        let r = parse(&[("sample.toml", SAMPLE)]).unwrap();
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

    /// One `[[variant]]` of test data: its name, op, dtypes, hidden range, any further lines,
    /// and params of 32 elements a thread, 32 threads a row for each 1024 of its widest row.
    fn variant(name: &str, op: &str, dtypes: &str, hidden: [i64; 2], extra: &str) -> String {
        let threads = 32 * ((hidden[1] + 1023) / 1024);
        format!(
            "[[variant]]\nname = \"{name}\"\nop = \"{op}\"\nsource = \"norm.cu\"\n\
             dtypes = [{dtypes}]\nsm = [90, 90]\nhidden = [{}, {}]\n{extra}\
             params = {{ THREADS_PER_ROW = {threads}, ROWS_PER_BLOCK = 4, ELEMS_PER_THREAD = 32 }}\n\n",
            hidden[0], hidden[1]
        )
    }

    #[test]
    fn deterministic_only_variants_serve_deterministic_calls_that_others_leave() {
        let bf16 = "\"bf16\"";
        let sample = variant(
            "routed",
            "layer_norm_fwd",
            bf16,
            [1, 1024],
            "max_rows = 1000\npriority = 1\n",
        ) + &variant(
            "deterministic_large",
            "layer_norm_fwd",
            bf16,
            [1, 1024],
            "priority = 1\ndeterministic_all_rows = true\ndeterministic_only = true\n",
        );
        let r = parse(&[("det.toml", &sample)]).unwrap();
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
        assert!(parse(&[("d.toml", &without_all_rows)])
            .unwrap_err()
            .contains("deterministic_only takes"));
    }

    #[test]
    fn narrowed_only_variants_serve_narrowed_calls_only() {
        let (f32, rms) = ("\"f32\"", "rms_norm_fwd");
        let narrowed = |priority: i64| {
            let extra = format!("min_rows = 4096\nnarrowed_only = true\npriority = {priority}\n");
            variant("narrowed", rms, f32, [1, 1024], &extra)
        };
        let wider = variant("wider", rms, f32, [1025, 2048], "");
        let r = parse(&[("n.toml", &(narrowed(0) + &wider))]).unwrap();
        let pick = |r: &Registry, rows: i64, narrowed: bool| {
            let q = Request {
                op: KernelOp::RmsNormFwd,
                narrowed,
                ..req(DType::F32, 1024, rows, 90)
            };
            r.select(&q).map(|i| r.variant(i).name.clone())
        };
        assert_eq!(pick(&r, 8192, true), Ok("narrowed".into()));
        // A plain call has no variant at this width (the reason its stock calls are logged with).
        assert_eq!(pick(&r, 8192, false), Err(StockReason::NoVariantForShape));
        assert_eq!(pick(&r, 1024, true), Err(StockReason::NotFasterHere));
        // Where a plain variant serves too, a narrowed call takes it, whatever the file's order
        // and the narrowed one's priority.
        let later = variant("later", rms, f32, [1, 1024], "");
        let r = parse(&[("b.toml", &(narrowed(1) + &later))]).unwrap();
        assert_eq!(pick(&r, 8192, true), Ok("later".into()));
    }

    #[test]
    fn malformed_data_is_rejected() {
        let dup = format!("{SAMPLE}\n{}", SAMPLE.replace("small_sm90", "x"));
        assert!(parse(&[("d.toml", &dup)])
            .unwrap_err()
            .contains("duplicate"));
        let bad = SAMPLE.replace("hidden = [1, 1024]", "hidden = [2048, 1024]");
        assert!(parse(&[("b.toml", &bad)]).unwrap_err().contains("hidden"));
        let unknown = SAMPLE.replace("priority = 1\n", "priority = 1\ncolour = 3\n");
        let too_wide = SAMPLE.replace("hidden = [1, 1024]", "hidden = [1, 1025]");
        assert!(parse(&[("w.toml", &too_wide)])
            .unwrap_err()
            .contains("holds 1024"));
        let no_source = SAMPLE.replace("source = \"norm.cu\"", "source = \"missing.cu\"");
        assert!(parse(&[("s.toml", &no_source)])
            .unwrap_err()
            .contains("missing.cu"));
        assert!(parse(&[("u.toml", &unknown)]).is_err());
        let op = SAMPLE.replacen("op = \"layer_norm_fwd\"", "op = \"softmax\"", 1);
        assert!(parse(&[("o.toml", &op)]).is_err());
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
                narrowed: false,
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

    /// The built-in registry's variant for a call (deterministic algorithms not required), or
    /// why stock serves it.
    fn pick(
        op: KernelOp,
        dtype: DType,
        hidden: i64,
        rows: i64,
        sm: u32,
    ) -> Result<String, StockReason> {
        let r = REGISTRY.as_ref().expect("built-in registry");
        r.select(&Request {
            op,
            dtype,
            hidden,
            rows,
            sm,
            deterministic: false,
            narrowed: false,
        })
        .map(|i| r.variant(i).name.clone())
    }

    /// The built-in registry answers a table of calls as measured (registry/norm.toml).
    #[test]
    fn built_in_registry_routes_a_table_of_calls() {
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
        let r = parse_with_sweep(&[("sample.toml", SAMPLE)], Some(("sweep.toml", &sweep))).unwrap();
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

    /// The ops the rewrite layer and the cross-entropy override send calls to: served at every
    /// shape measured (registry/{gelu,cross_entropy,swiglu,rotary}.toml), tiny ones included,
    /// on sm 80 and 90 alike; what was measured no faster, or has no variant, goes to stock.
    #[test]
    fn built_in_registry_routes_the_llm_step_ops() {
        use KernelOp::*;
        let served = [
            (CrossEntropyFwdWide, DType::BF16, 50304, 8192, "ce_fwd_wide"),
            (
                CrossEntropyBwdWide,
                DType::F16,
                128256,
                65536,
                "ce_bwd_wide",
            ),
            (CrossEntropyFwd, DType::F32, 10, 64, "ce_fwd"),
            (CrossEntropyBwd, DType::F32, 1, 1, "ce_bwd"),
            (SiluMulFwd, DType::BF16, 1, 4096 * 11008, "silu_mul_fwd"),
            (SiluMulBwd, DType::F16, 1, 64, "silu_mul_bwd"),
            (
                GeluTanhMulFwd,
                DType::BF16,
                1,
                4096 * 16384,
                "gelu_tanh_mul_fwd",
            ),
            (GeluTanhMulBwd, DType::F32, 1, 64, "gelu_tanh_mul_bwd"),
            (
                RotaryFwdWide,
                DType::BF16,
                64,
                4 * 1024 * 24,
                "rope_fwd_wide",
            ),
            (RotaryBwd, DType::F32, 128, 1, "rope_bwd"),
            (
                GeluTanhFwdWide,
                DType::BF16,
                1,
                8192 * 3072,
                "gelu_fwd_wide",
            ),
            // Widening copies (registry/mixed_add.toml): every size, bias-sized ones too.
            (MixedCopy, DType::BF16, 1, 768, "mixed_copy_t256_c2"),
            (MixedCopy, DType::F16, 1, 3072 * 768, "mixed_copy_t256_c4"),
            (
                MixedCopy,
                DType::BF16,
                1,
                151_936 * 896,
                "mixed_copy_t512_c2",
            ),
        ];
        for (op, dtype, hidden, rows, prefix) in served {
            for sm in [80, 90] {
                let name = pick(op, dtype, hidden, rows, sm)
                    .unwrap_or_else(|e| panic!("{prefix} sm {sm}: {e}"));
                assert!(name.starts_with(prefix), "{op:?} {dtype:?}: {name}");
            }
        }
        // Equal-dtype GELU: stock's own kernel is one pass too, measured as fast.
        assert_eq!(
            pick(GeluTanhFwd, DType::BF16, 1, 8192 * 3072, 90),
            Err(StockReason::NotFasterHere)
        );
        // fp32 logits with an fp32 loss are not the wide form: no variant takes f32 there.
        assert_eq!(
            pick(CrossEntropyFwdWide, DType::F32, 50304, 8192, 90),
            Err(StockReason::UnsupportedDtype)
        );
    }

    /// Column sums (bias gradients): the two measured variants by width, stock below their
    /// `min_rows` and under 128 columns (registry/column_sum.toml).
    #[test]
    fn built_in_registry_routes_column_sums_by_width_and_rows() {
        use KernelOp::ColumnSum;
        for dtype in [DType::BF16, DType::F32, DType::F16] {
            for sm in [80, 90] {
                assert_eq!(
                    pick(ColumnSum, dtype, 768, 32768, sm).as_deref(),
                    Ok("colsum_w16_r512_u2")
                );
                assert_eq!(
                    pick(ColumnSum, dtype, 1024, 12288, sm).as_deref(),
                    Ok("colsum_w16_r512_u2")
                );
                assert_eq!(
                    pick(ColumnSum, dtype, 3072, 8192, sm).as_deref(),
                    Ok("colsum_w8_r512_u4")
                );
                assert_eq!(
                    pick(ColumnSum, dtype, 768, 8192, sm),
                    Err(StockReason::NotFasterHere)
                );
                assert_eq!(
                    pick(ColumnSum, dtype, 2304, 4096, sm),
                    Err(StockReason::NotFasterHere)
                );
                assert_eq!(
                    pick(ColumnSum, dtype, 64, 65536, sm),
                    Err(StockReason::NoVariantForShape)
                );
            }
        }
    }

    #[test]
    fn built_in_registry_parses() {
        let r = REGISTRY.as_ref().expect("built-in registry");
        assert!(!r.variants().is_empty());
    }
}

#[cfg(test)]
mod nvrtc_tests {
    use super::*;
    use crate::gpu::nvrtc::{nvrtc_compile, nvrtc_ready};

    /// A tool, not a check: writes what NVRTC makes of every registry variant for sm_90a
    /// (each kernel's code size and register counts, `cubin::code_summary`), a line per
    /// variant and dtype, to the file named by TORCHFUSE_CODE_SUMMARY. Two runs, before and
    /// after a change that should not alter the generated code (how a kernel's arguments
    /// arrive), compared with `diff`:
    /// `TORCHFUSE_CODE_SUMMARY=/tmp/before.txt cargo test --release code_summary -- --ignored`.
    #[test]
    #[ignore = "a tool: writes TORCHFUSE_CODE_SUMMARY"]
    fn code_summary_of_every_variant() {
        let Ok(out) = std::env::var("TORCHFUSE_CODE_SUMMARY") else {
            panic!("set TORCHFUSE_CODE_SUMMARY to the file to write");
        };
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        nvrtc_ready().expect("NVRTC");
        let registry = REGISTRY.as_ref().expect("registry");
        let mut lines = Vec::new();
        for (i, v) in registry.variants().iter().enumerate() {
            if !(v.sm[0]..=v.sm[1]).contains(&90) {
                continue;
            }
            for &dtype in &v.dtypes {
                let options = compile_options(registry.params(i), dtype, "sm_90a");
                let cubin = nvrtc_compile(&v.source, &options).expect("compiles");
                let summary = crate::gpu::cubin::code_summary(&cubin).expect("a CUBIN");
                lines.push(format!("{} {} {summary}", v.name, dtype.name()));
            }
        }
        std::fs::write(out, lines.join("\n") + "\n").expect("written");
    }

    /// One compilation: a variant, its params, the dtype, the narrowed output's dtype (norm_cast),
    /// the architecture.
    type Job<'a> = (
        &'a Variant,
        &'a OpParams,
        DType,
        Option<DType>,
        &'static str,
    );

    /// Every compilation the product can ask of NVRTC for these architectures ((sm, arch)):
    /// each variant whose SM range holds the sm, in each of its dtypes, and an fp32 norm's
    /// narrowed to bf16 as well (norm_cast's).
    fn compile_jobs<'a>(registry: &'a Registry, archs: &[(u32, &'static str)]) -> Vec<Job<'a>> {
        let narrowed = |v: &Variant, d: DType| {
            (v.op.family() == OpFamily::Norm && d == DType::F32).then_some(DType::BF16)
        };
        let mut jobs = Vec::new();
        for (i, v) in registry.variants().iter().enumerate() {
            for &d in &v.dtypes {
                for y in std::iter::once(None).chain(narrowed(v, d).map(Some)) {
                    for &(sm, arch) in archs {
                        if (v.sm[0]..=v.sm[1]).contains(&sm) {
                            jobs.push((v, registry.params(i), d, y, arch));
                        }
                    }
                }
            }
        }
        jobs
    }

    /// `work` on every job, on as many threads as the machine has: how many ran.
    fn in_parallel(jobs: &[Job], work: impl Fn(&Job) + Sync) -> usize {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = 0;
                        while let Some(job) =
                            jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                        {
                            work(job);
                            done += 1;
                        }
                        done
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("worker")).sum()
        })
    }

    /// A tool, not a check: fills the kernel cache directory named by TORCHFUSE_PREWARM_CACHE
    /// with every CUBIN the product can ask for on sm_90 (Hopper), the files the library itself
    /// would write there (`gpu::cache::cubin`: the same key, the same NVRTC version where torch's
    /// wheel is the GPU machine's). A GPU machine that starts bare then takes its kernels from
    /// that directory (`TORCHFUSE_CACHE_DIR`) instead of compiling each on first use:
    /// `TORCHFUSE_PREWARM_CACHE=.dev/cache cargo test --release prewarm -- --ignored`.
    #[test]
    #[ignore = "a tool: writes TORCHFUSE_PREWARM_CACHE"]
    fn prewarm_kernel_cache_for_sm90() {
        let Some(dir) = std::env::var_os("TORCHFUSE_PREWARM_CACHE") else {
            panic!("set TORCHFUSE_PREWARM_CACHE to the cache directory to fill");
        };
        let dir = std::path::PathBuf::from(dir);
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        nvrtc_ready().expect("NVRTC");
        let registry = REGISTRY.as_ref().expect("registry");
        let jobs = compile_jobs(registry, &[(90, "sm_90a")]);
        let written = in_parallel(&jobs, |&(variant, params, dtype, narrow, arch)| {
            let options = compile_options_narrowed(params, dtype, narrow, arch);
            crate::gpu::cache::cubin(&variant.name, &variant.source, &options, arch, &dir)
                .unwrap_or_else(|e| panic!("{} {}: {e}", variant.name, dtype.name()));
        });
        println!("{written} kernels in {dir:?}");
    }

    /// A few spilled registers are cheap (L1); more is a copy the kernel should not make.
    const MAX_STACK_BYTES: u32 = 32;
    /// Norm backward variants that hold a wide row's elements in registers (64 and 32 a
    /// thread) and spill some of them: measured as they are (docs/bench/norm/).
    const SPILLING: [&str; 2] = [
        "ln_bwd_16bit_h16384_t256x1_e64",
        "ln_bwd_f32_h16384_t512x1_e32",
    ];

    /// The kernels launched with positional arguments: attention's, whose parameter lists
    /// differ by variant (`Attention::kernel_args`).
    const POSITIONAL_ARGS: [&str; 3] = ["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"];

    /// Kernel `kernel`'s argument struct (`Family::kernel_args`) is its parameter list: the
    /// same names in the same order (its definition in the variant's source or a header) and
    /// the same sizes (the CUBIN's record of each parameter).
    fn check_kernel_args(variant: &Variant, params: &OpParams, kernel: &str, cubin: &[u8]) {
        let Some(fields) = params.kernel_args(kernel) else {
            assert!(
                POSITIONAL_ARGS.contains(&kernel),
                "{}: no argument struct for {kernel}",
                variant.name
            );
            return;
        };
        let sizes = crate::gpu::cubin::kernel_param_sizes(cubin, kernel)
            .unwrap_or_else(|e| panic!("{}: {e}", variant.name));
        let field_sizes: Vec<u32> = fields.iter().map(|f| f.size as u32).collect();
        assert_eq!(
            sizes, field_sizes,
            "{} {kernel}: parameter sizes",
            variant.name
        );
        let source = gpu::sources::kernel_source(&variant.source).expect("source");
        let names = crate::gpu::args::param_names(source, kernel)
            .or_else(|| {
                gpu::sources::headers()
                    .find_map(|(_, text)| crate::gpu::args::param_names(text, kernel))
            })
            .unwrap_or_else(|| panic!("{}: no definition of {kernel}", variant.name));
        let field_names: Vec<&str> = fields.iter().map(|f| f.name).collect();
        assert_eq!(
            names, field_names,
            "{} {kernel}: parameter names",
            variant.name
        );
    }

    /// Every registry variant compiles, for every dtype it claims (a norm's fp32 variants also
    /// narrowed to bf16 output, as norm_cast asks), for sm_80 and sm_90a where its SM range
    /// includes them (a warpgroup-MMA variant is sm_90a only), with no stack frame beyond a few
    /// spilled registers.
    /// Needs torch's NVRTC (the test binary links libtorch, so it is found next to it).
    #[test]
    fn every_variant_compiles_for_sm80_and_sm90a() {
        // Make sure libtorch is mapped (it is linked, but the linker may defer it).
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        if let Err(e) = nvrtc_ready() {
            panic!("NVRTC unavailable: {e}");
        }
        let registry = REGISTRY.as_ref().expect("registry");
        let jobs = compile_jobs(registry, &[(80, "sm_80"), (90, "sm_90a")]);
        let compiled: usize = in_parallel(&jobs, |&(variant, params, dtype, narrow, arch)| {
            let options = compile_options_narrowed(params, dtype, narrow, arch);
            let cubin = nvrtc_compile(&variant.source, &options)
                .unwrap_or_else(|e| panic!("{} {} {arch}: {e}", variant.name, dtype.name()));
            assert_eq!(&cubin[..4], b"\x7fELF", "{} is not a CUBIN", variant.name);
            let stack = crate::gpu::cubin::max_stack_bytes(&cubin)
                .unwrap_or_else(|e| panic!("{} {arch}: {e}", variant.name));
            assert!(
                stack <= MAX_STACK_BYTES || SPILLING.contains(&variant.name.as_str()),
                "{} {} {arch}: a {stack}-byte stack frame (local memory on every \
                 use; an argument or array the compiler could not keep in registers)",
                variant.name,
                dtype.name()
            );
            for entry in params.kernels() {
                assert!(
                    cubin.windows(entry.len()).any(|w| w == entry.as_bytes()),
                    "{} {arch}: no kernel {entry}",
                    variant.name
                );
                check_kernel_args(variant, params, entry, &cubin);
            }
        });
        assert_eq!(compiled, jobs.len());
        assert!(compiled >= registry.variants().len());
        assert!(
            jobs.iter().any(|j| j.3.is_some()),
            "no narrowed norm compiled"
        );
        // Both architectures are covered.
        for arch in ["sm_80", "sm_90a"] {
            assert!(
                jobs.iter().any(|j| j.4 == arch),
                "nothing compiled for {arch}"
            );
        }
    }
}
