//! LayerNorm and RMSNorm, forward and backward, through kernels/norm.cu, or why stock runs a
//! call. Calls stock would reject are sent to stock so the user gets stock's error. Also
//! `torchfuse::hf_rms_norm`, HF's RMSNorm composition, which is served by `aten::rms_norm`
//! where that computes the same thing (and so reaches the RMSNorm kernels), and
//! `torchfuse::norm_cast[_backward]`, a norm of fp32 rows whose output is written in bf16 (and
//! whose backward reads its gradient in bf16): the same kernels, compiled narrowed.

use super::params::{self, flag, one};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty, Contiguous};
use crate::abi::types::{TfNormCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Kernels, Launch};
use crate::runtime::{Entry, OpFamily, Toggle};
use crate::select::{dtype_of, DType, StockReason};
use cudarc::driver::LaunchConfig;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NormKind {
    Layer,
    Rms,
}

impl NormKind {
    fn kernel_op(self, backward: bool) -> KernelOp {
        match (self, backward) {
            (NormKind::Layer, false) => KernelOp::LayerNormFwd,
            (NormKind::Layer, true) => KernelOp::LayerNormBwd,
            (NormKind::Rms, false) => KernelOp::RmsNormFwd,
            (NormKind::Rms, true) => KernelOp::RmsNormBwd,
        }
    }
}

/// The kernels of kernels/norm.cu, by name: the forward; the backward and its column
/// reduction of the dgamma/dbeta partials.
const FWD_KERNEL: &str = "norm_fwd";
const BWD_KERNEL: &str = "norm_bwd";
const BWD_REDUCE_KERNEL: &str = "norm_bwd_reduce";

/// LayerNorm (`native_layer_norm[_backward]`) and RMSNorm (`_fused_rms_norm[_backward]`).
pub struct Norm;

impl Norm {
    /// The entry's norm and direction.
    fn of(entry: Entry) -> Option<(NormKind, bool)> {
        match entry {
            Entry::NativeLayerNorm => Some((NormKind::Layer, false)),
            Entry::NativeLayerNormBackward => Some((NormKind::Layer, true)),
            Entry::FusedRmsNorm => Some((NormKind::Rms, false)),
            Entry::FusedRmsNormBackward => Some((NormKind::Rms, true)),
            _ => None,
        }
    }
}

impl Family for Norm {
    type Call = TfNormCall;

    const FAMILY: OpFamily = OpFamily::Norm;

    unsafe fn unreadable(_entry: Entry, call: &TfNormCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(
            &[
                &call.input,
                &call.weight,
                &call.bias,
                &call.grad_out,
                &call.mean,
                &call.rstd,
            ],
            true,
        )
    }

    unsafe fn describe(_entry: Entry, call: &TfNormCall) -> Option<(&'static str, Vec<i64>)> {
        Some(describe(call.input.given()?))
    }

    /// Forward outputs: LayerNorm y, mean, rstd; RMSNorm y, rstd. Backward: dx, dweight,
    /// dbias (RMSNorm: no dbias), each only where `output_mask` asks for it.
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfNormCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        let input = call.input.given().ok_or(StockReason::InvalidInput)?;
        if matches!(entry, Entry::NormCast | Entry::NormCastBackward) {
            return norm_cast(entry, launch, call, input, shape);
        }
        if entry == Entry::HfRmsNorm {
            let weight = call.weight.given().ok_or(StockReason::InvalidInput)?;
            return hf_rms_norm(launch, input, weight);
        }
        let (kind, backward) = Norm::of(entry).ok_or(StockReason::InternalError)?;
        let normalized_shape = if call.normalized_ndim == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(call.normalized_shape, call.normalized_ndim)
        };
        let (kernel, [a, b, c]) = run(
            kind,
            backward,
            launch,
            call,
            input,
            shape,
            normalized_shape,
            (call.has_eps != 0).then_some(call.eps),
            None,
        )?;
        // aten's RMSNorm forward returns (y, rstd).
        let outputs = match (kind, backward) {
            (NormKind::Rms, false) => [a, c, None],
            _ => [a, b, c],
        };
        Ok(Served::new(kernel, outputs))
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if is_backward(op) {
            &[BWD_KERNEL, BWD_REDUCE_KERNEL]
        } else {
            &[FWD_KERNEL]
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            FWD_KERNEL => Some(NormFwdArgs::FIELDS),
            BWD_KERNEL => Some(NormBwdArgs::FIELDS),
            BWD_REDUCE_KERNEL => Some(NormBwdReduceArgs::FIELDS),
            _ => None,
        }
    }

    /// The defines that pick the op's kernels in kernels/norm.cu.
    fn defines(op: KernelOp) -> Vec<String> {
        let rms = matches!(op, KernelOp::RmsNormFwd | KernelOp::RmsNormBwd);
        vec![
            format!("-DTF_NORM_FWD={}", i32::from(!is_backward(op))),
            format!("-DTF_NORM_BWD={}", i32::from(is_backward(op))),
            format!("-DTF_RMS={}", i32::from(rms)),
        ]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        prepare(v)
    }
}

/// A backward call's `output_mask` bits: dx, dweight, dbias.
fn mask(call: &TfNormCall) -> [bool; 3] {
    [0, 1, 2].map(|bit| call.output_mask & (1 << bit) != 0)
}

/// The dtype norm_cast writes y (and reads dy) in: bf16, the dtype bf16 autocast's Linears cast
/// an fp32 input to (fp16 autocast is not served: its consumers' gradients would add in fp16).
const NORM_CAST_Y: Kind = Kind::BFloat16;

/// `torchfuse::norm_cast[_backward]`: LayerNorm (`rms` 0) or RMSNorm over the last dim of an
/// fp32 x, y written in bf16 (`y_dtype`), dy read in bf16; every other tensor as the norm's
/// own (fp32 x, weight and bias, fp32 statistics). Served only where the norm's own toggles are
/// on (`layer_norm`, or `hf_rms_norm` and `rms_norm`). Where the norm's own override serves the
/// rows, the kernel is the one the original's norm runs and y is its output cast, bit for bit;
/// where only a `narrowed_only` variant does (the plain norm is stock's there), y is within the
/// contract of stock's norm cast. Otherwise the glue composes the norm and the cast.
unsafe fn norm_cast(
    entry: Entry,
    launch: Launch,
    call: &TfNormCall,
    input: &TfTensor,
    shape: &[i64],
) -> Result<Served, StockReason> {
    // HF's RMSNorm reaches the kernel through torchfuse::hf_rms_norm (its toggle) and then
    // aten::rms_norm's override (rms_norm's): both must be on for the original to run it.
    let (kind, own): (_, &[Toggle]) = if call.rms != 0 {
        (NormKind::Rms, &[Toggle::HfRmsNorm, Toggle::RmsNorm])
    } else {
        (NormKind::Layer, &[Toggle::LayerNorm])
    };
    if !own.iter().all(|t| t.registered() && t.active()) {
        return Err(StockReason::DisabledAtRuntime);
    }
    if input.kind() != Some(Kind::Float) {
        return Err(StockReason::UnsupportedDtype);
    }
    if crate::abi::tensor::kind_of_scalar_type(call.y_dtype) != Some(NORM_CAST_Y) {
        return Err(StockReason::UnsupportedDtype);
    }
    let hidden = shape.last().ok_or(StockReason::InvalidInput)?;
    // HF's RMSNorm has a weight and no bias (the composition raises otherwise).
    if kind == NormKind::Rms && (call.weight.given().is_none() || call.bias.given().is_some()) {
        return Err(StockReason::InvalidInput);
    }
    if kind == NormKind::Rms && *hidden < HF_RMS_NORM_MIN_HIDDEN {
        return Err(StockReason::NoVariantForShape);
    }
    let (kernel, outputs) = run(
        kind,
        entry == Entry::NormCastBackward,
        launch,
        call,
        input,
        shape,
        std::slice::from_ref(hidden),
        Some(call.eps),
        Some(NORM_CAST_Y),
    )?;
    Ok(Served::new(kernel, outputs))
}

/// One norm call through the kernels: the forward's y, mean (LayerNorm), rstd, or the
/// backward's dx, dweight, dbias (each where `output_mask` asks), and the variant that ran.
/// `narrow`: y's (dy's) dtype where it is not x's.
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    kind: NormKind,
    backward: bool,
    launch: Launch,
    call: &TfNormCall,
    input: &TfTensor,
    shape: &[i64],
    normalized_shape: &[i64],
    eps: Option<f64>,
    narrow: Option<Kind>,
) -> Result<(&'static str, [Option<Tensor>; 3]), StockReason> {
    let (weight, bias) = (call.weight.given(), call.bias.given());
    if !backward {
        let fwd = forward(
            launch,
            &ForwardCall {
                kind,
                input,
                shape,
                normalized_shape,
                weight,
                bias,
                eps,
                narrow,
            },
        )?;
        return Ok((fwd.kernel, [Some(fwd.y), fwd.mean, Some(fwd.rstd)]));
    }
    let bwd = self::backward(
        launch,
        &BackwardCall {
            kind,
            grad_out: call.grad_out.given().ok_or(StockReason::InvalidInput)?,
            input,
            shape,
            normalized_shape,
            mean: call.mean.given(),
            rstd: call.rstd.given().ok_or(StockReason::InvalidInput)?,
            weight,
            bias,
            output_mask: mask(call),
            narrow,
        },
    )?;
    Ok((bwd.kernel, [bwd.dx, bwd.dweight, bwd.dbias]))
}

fn is_backward(op: KernelOp) -> bool {
    matches!(op, KernelOp::LayerNormBwd | KernelOp::RmsNormBwd)
}

/// The aten op hf_rms_norm calls are routed to (counted there, with the kernel that ran).
const HF_RMS_NORM_BY_ATEN: &str = "aten::rms_norm";

/// Narrower rows keep HF's composition: there the input gradient nearly cancels (at one
/// feature it is eps-sized), and aten's fused RMSNorm backward was measured 0.4% off a float64
/// reference on an fp32 row of one element, where the composition's autograd is exact.
const HF_RMS_NORM_MIN_HIDDEN: i64 = 32;

/// HF's RMSNorm, `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`, is
/// `aten::rms_norm(x, [hidden], weight, eps)` when weight and x share a floating dtype: the
/// same statistics in fp32, and the output in that dtype. (HF rounds the normalized value to
/// the dtype before the weight multiply; rms_norm rounds once, so it is no less accurate.)
/// Autograd and the kernel choice are aten's from there: on CUDA, `_fused_rms_norm`, which
/// torchfuse's `rms_norm` toggle serves. Served means the glue calls `aten::rms_norm` itself
/// (no outputs here): an exception raised inside it (activation checkpointing stops its
/// recompute by raising from a saved-tensor hook) must reach the caller unchanged, which a call
/// through tch, turning every C++ exception into an error value, would not let it. Mixed
/// dtypes (an fp32 weight on a bf16 activation, whose product HF computes in fp32) go to
/// stock: the glue runs HF's composition itself.
fn hf_rms_norm(launch: Launch, input: &TfTensor, weight: &TfTensor) -> Result<Served, StockReason> {
    let kind = input.kind().ok_or(StockReason::UnsupportedDtype)?;
    dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
    if weight.kind() != Some(kind) {
        return Err(StockReason::MixedDtypes);
    }
    let device = gpu::torch_device(launch)?;
    let hidden = *input.sizes().last().ok_or(StockReason::InvalidInput)?;
    if weight.sizes() != [hidden] || input.device() != device || weight.device() != device {
        return Err(StockReason::InvalidInput);
    }
    if hidden < HF_RMS_NORM_MIN_HIDDEN {
        return Err(StockReason::NoVariantForShape);
    }
    // Counted by `_fused_rms_norm`'s override where it is registered; without it (the rms_norm
    // toggle left out) aten's kernel runs uncounted, so the call is counted here.
    if Toggle::RmsNorm.registered() {
        Ok(Served::routed(HF_RMS_NORM_BY_ATEN))
    } else {
        Ok(Served::new(HF_RMS_NORM_BY_ATEN, [None, None, None]))
    }
}

/// A norm variant's compile-time params (`registry/norm.toml`), checked once.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Threads that share a row: a multiple of 32.
    threads_per_row: i64,
    rows_per_block: i64,
    /// A multiple of 8 (elements of the narrowest dtype in one 16-byte vector).
    elems_per_thread: i64,
    /// Forward: the next row's loads issued before this row's math.
    #[serde(default, with = "flag")]
    prefetch: bool,
    /// x (and dy) loaded past L1, weight and bias re-read from L1 every row.
    #[serde(default, with = "flag")]
    stream: bool,
    /// CTAs per SM the register budget must allow (`__launch_bounds__`).
    #[serde(default = "one")]
    min_blocks: i64,
    /// CTAs per row (a thread-block cluster, sm 90); 1: a CTA per row.
    #[serde(default = "one")]
    cluster: i64,
    /// Backward: the dgamma/dbeta accumulators in dynamic shared memory, not registers.
    #[serde(default, with = "flag")]
    smem_acc: bool,
}

/// Thread-block clusters (a row split across CTAs) start with Hopper.
const CLUSTER_MIN_SM: u32 = 90;

/// Static shared memory a CTA of norm_bwd may use (the CUDA limit without opting in).
const STATIC_SMEM_LIMIT: i64 = 48 * 1024;
/// Dynamic shared memory a variant may ask for: below what a CTA may opt in to on sm 80 and
/// 90 (A100: 163 KiB, H100: 227 KiB) together with what the kernels declare statically.
const DYNAMIC_SMEM_LIMIT: i64 = 160 * 1024;

/// Dynamic shared memory of a backward variant with SMEM_ACC = 1: its fp32 accumulators of
/// dgamma (and dbeta for LayerNorm), ELEMS_PER_THREAD each per thread (0 otherwise).
fn accumulator_bytes(op: KernelOp, p: &Params) -> i64 {
    if !is_backward(op) || !p.smem_acc {
        return 0;
    }
    let quantities = if op == KernelOp::LayerNormBwd { 2 } else { 1 };
    quantities * p.threads_per_row * p.rows_per_block * p.elems_per_thread * 4
}

/// The launch shape a variant's parameters give.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    threads_per_row: u32,
    rows_per_block: u32,
    /// CTAs that share each row (a thread-block cluster); 1 for a CTA per row.
    cluster: u32,
}

fn geometry(p: &Params) -> Geometry {
    // `prepare` checked that they fit in a CTA.
    let dim = |x: i64| x.clamp(1, 1024) as u32;
    Geometry {
        threads_per_row: dim(p.threads_per_row),
        rows_per_block: dim(p.rows_per_block),
        cluster: dim(p.cluster),
    }
}

/// A norm variant's params, and their limits.
fn prepare(v: &Variant) -> Result<Params, String> {
    let p: Params = params::parse(v)?;
    let (tpr, rows, ept) = (p.threads_per_row, p.rows_per_block, p.elems_per_thread);
    if tpr <= 0 || tpr % 32 != 0 || rows <= 0 || tpr * rows > 1024 {
        return Err(format!(
            "{}: THREADS_PER_ROW {tpr} x ROWS_PER_BLOCK {rows} is not a valid CTA",
            v.name
        ));
    }
    // 8 = elements of the narrowest dtype in one 16-byte vector.
    if ept <= 0 || ept % 8 != 0 {
        return Err(format!(
            "{}: ELEMS_PER_THREAD {ept} must be a positive multiple of 8",
            v.name
        ));
    }
    params::in_range(v, "MIN_BLOCKS", p.min_blocks, 1..=32)?;
    params::one_of(v, "CLUSTER", p.cluster, &[1, 2, 4, 8])?;
    let cluster = p.cluster;
    if cluster > 1 && (rows != 1 || tpr < 64 || v.sm[0] < CLUSTER_MIN_SM) {
        return Err(format!(
            "{}: CLUSTER > 1 needs ROWS_PER_BLOCK = 1, THREADS_PER_ROW >= 64 and sm >= \
             {CLUSTER_MIN_SM}",
            v.name
        ));
    }
    if cluster * tpr * ept < v.hidden[1] {
        return Err(format!(
            "{}: holds {} elements per row but claims hidden up to {}",
            v.name,
            cluster * tpr * ept,
            v.hidden[1]
        ));
    }
    let backward = is_backward(v.op);
    if p.smem_acc && !backward {
        return Err(format!("{}: SMEM_ACC is a backward parameter", v.name));
    }
    let accumulators = accumulator_bytes(v.op, &p);
    if accumulators > DYNAMIC_SMEM_LIMIT {
        return Err(format!(
            "{}: the accumulators need {accumulators} bytes of shared memory (limit {DYNAMIC_SMEM_LIMIT})",
            v.name
        ));
    }
    if backward && rows > 1 && rows * tpr * ept * 4 > STATIC_SMEM_LIMIT {
        return Err(format!(
            "{}: the CTA's dgamma partials need {} bytes of shared memory (limit {STATIC_SMEM_LIMIT})",
            v.name,
            rows * tpr * ept * 4
        ));
    }
    Ok(p)
}

/// A checked call: its dtype, rows x cols, and the statistics' keepdim shape.
struct Layout {
    kind: Kind,
    dtype: DType,
    device: Device,
    rows: i64,
    cols: i64,
    cols_i32: i32,
    stat_shape: Vec<i64>,
}

/// The checks stock makes (or a subset that sends everything stock would reject to stock).
fn layout(
    input: &TfTensor,
    shape: &[i64],
    normalized_shape: &[i64],
    launch: Launch,
    params: &[Option<&TfTensor>],
) -> Result<Layout, StockReason> {
    let kind = input.kind().ok_or(StockReason::UnsupportedDtype)?;
    let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
    let axis = shape
        .len()
        .checked_sub(normalized_shape.len())
        .filter(|_| !normalized_shape.is_empty())
        .ok_or(StockReason::InvalidInput)?;
    if shape[axis..] != *normalized_shape {
        return Err(StockReason::InvalidInput);
    }
    let device = gpu::torch_device(launch)?;
    for param in params.iter().flatten() {
        if param.sizes() != normalized_shape || param.device() != input.device() {
            return Err(StockReason::InvalidInput);
        }
        if param.kind() != Some(kind) {
            return Err(StockReason::MixedDtypes);
        }
    }
    let cols: i64 = normalized_shape.iter().product();
    let rows: i64 = shape[..axis].iter().product();
    if cols == 0 || rows == 0 {
        return Err(StockReason::EmptyInput);
    }
    let cols_i32 = i32::try_from(cols).map_err(|_| StockReason::NoVariantForShape)?;
    let mut stat_shape = shape[..axis].to_vec();
    stat_shape.extend(std::iter::repeat_n(1, normalized_shape.len()));
    Ok(Layout {
        kind,
        dtype,
        device,
        rows,
        cols,
        cols_i32,
        stat_shape,
    })
}

/// What serves a call: the registry's variant, its loaded kernels, and the launch shape.
struct Plan {
    variant: &'static Variant,
    kernels: Arc<Kernels>,
    gpu: Arc<gpu::Device>,
    geometry: Geometry,
    /// Persistent grid: every group of rows, but no more CTAs than fit on the GPU at once.
    grid: u32,
    /// Dynamic shared memory a CTA (the backward's accumulators with SMEM_ACC = 1).
    shared_bytes: u32,
}

impl Plan {
    /// Rows of the backward's fp32 partials: one per cluster (one per CTA without clusters).
    fn partial_rows(&self) -> u32 {
        self.grid / self.geometry.cluster
    }
}

/// `narrow`: y's (forward) or dy's (backward) dtype where it is narrower than x's.
fn plan(
    op: KernelOp,
    l: &Layout,
    launch: Launch,
    narrow: Option<Kind>,
) -> Result<Plan, StockReason> {
    let narrow = narrow
        .map(|k| dtype_of(k).ok_or(StockReason::UnsupportedDtype))
        .transpose()?;
    let request = |sm| Request {
        op,
        dtype: l.dtype,
        hidden: l.cols,
        rows: l.rows,
        sm,
        deterministic: false,
        narrowed: false,
    };
    let main_kernel = if is_backward(op) {
        BWD_KERNEL
    } else {
        FWD_KERNEL
    };
    // The grid is the un-narrowed kernel's (`sized_by`): the backward's dgamma/dbeta partial
    // rows, one per CTA, and so the order of their sums, follow the grid, and a narrowed call
    // must sum in the original's order (its register count, and so its occupancy, may differ).
    // More CTAs than fit at once only run in waves.
    let (
        Selected {
            gpu,
            variant,
            kernels: sized_by,
            params,
        },
        kernels,
    ) = match narrow {
        None => {
            let selected = super::select(launch, request)?;
            let kernels = selected.kernels.clone();
            (selected, kernels)
        }
        Some(y) => super::select_narrowed(launch, request, y)?,
    };
    let p = Norm::params(params)?;
    let g = geometry(p);
    let main = kernels.get(main_kernel)?;
    let sizing = sized_by.get(main_kernel)?;
    let groups = gpu::ceil_div(l.rows, i64::from(g.rows_per_block));
    let block_threads = g.threads_per_row * g.rows_per_block;
    // `prepare` keeps it below DYNAMIC_SMEM_LIMIT.
    let shared_bytes = u32::try_from(accumulator_bytes(op, p)).unwrap_or(u32::MAX);
    if shared_bytes > 0 {
        for kernel in [main, sizing] {
            kernel
                .allow_shared_bytes(shared_bytes)
                .map_err(|e| super::launch_failed(variant, e))?;
        }
    }
    let grid = if g.cluster > 1 {
        // A cluster per group of rows; no more clusters than the GPCs can hold at once.
        let clusters = sizing
            .resident_clusters(g.cluster, block_threads, shared_bytes, &gpu.stream(launch))
            .map_err(|e| super::launch_failed(variant, e))?;
        groups.min(i64::from(clusters)) * i64::from(g.cluster)
    } else {
        let resident = sizing.resident_per_sm_with(block_threads, shared_bytes);
        groups.min(i64::from(resident) * i64::from(gpu.multiprocessors))
    };
    let grid = u32::try_from(grid).map_err(|_| StockReason::NoVariantForShape)?;
    Ok(Plan {
        variant,
        kernels,
        gpu,
        geometry: g,
        grid,
        shared_bytes,
    })
}

impl Plan {
    /// One CTA per group of rows, `rows_per_block` rows of `threads_per_row` threads.
    fn rows_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (
                self.geometry.threads_per_row,
                self.geometry.rows_per_block,
                1,
            ),
            shared_mem_bytes: self.shared_bytes,
        }
    }

    fn launch_failed(&self, e: cudarc::driver::DriverError) -> StockReason {
        super::launch_failed(self.variant, e)
    }
}

/// 1 when the kernel may use 16-byte accesses: whole vectors per row and every row tensor
/// 16-byte aligned (an absent one's address is 0).
fn vectorized(l: &Layout, addrs: &[u64]) -> i32 {
    i32::from(l.cols % l.dtype.vector_elems() == 0 && aligned16(addrs.iter().copied()))
}

/// Kernel argument for an optional tensor: its address, or null.
fn ptr(t: Option<&Tensor>) -> u64 {
    t.map_or(0, device_addr)
}

/// Kernel argument for an optional input: its address in row-major order, or null.
fn dense_ptr(t: &Option<Contiguous>) -> u64 {
    t.as_ref().map_or(0, Contiguous::addr)
}

/// An optional input in row-major order (a copy where it is not).
fn contiguous(t: Option<&TfTensor>) -> Result<Option<Contiguous<'_>>, StockReason> {
    t.map(TfTensor::contiguous).transpose()
}

struct Forward {
    pub y: Tensor,
    /// LayerNorm only.
    pub mean: Option<Tensor>,
    pub rstd: Tensor,
    pub kernel: &'static str,
}

struct ForwardCall<'a> {
    pub kind: NormKind,
    pub input: &'a TfTensor,
    /// `input.sizes()`, already read by the caller for its log line.
    pub shape: &'a [i64],
    pub normalized_shape: &'a [i64],
    pub weight: Option<&'a TfTensor>,
    /// LayerNorm only.
    pub bias: Option<&'a TfTensor>,
    /// None: RMSNorm's default, float32's machine epsilon (stock's choice for these dtypes).
    pub eps: Option<f64>,
    /// y's dtype where it is narrower than x's (norm_cast); None: x's.
    pub narrow: Option<Kind>,
}

kernel_args! {
    /// norm_fwd's arguments (kernels/norm.cu); device addresses, 0 for none.
    struct NormFwdArgs {
        x: u64,
        weight: u64,
        bias: u64,
        y: u64,
        /// LayerNorm only.
        mean_out: u64,
        rstd_out: u64,
        rows: i64,
        cols: i32,
        eps: f32,
        /// Every pointer 16-byte aligned and cols a multiple of the vector width (1) or not (0).
        vectorized: i32,
    }
}

kernel_args! {
    /// norm_bwd's arguments (kernels/norm.cu); device addresses, 0 for none.
    struct NormBwdArgs {
        dy: u64,
        x: u64,
        mean: u64,
        rstd: u64,
        weight: u64,
        dx: u64,
        dw_partial: u64,
        db_partial: u64,
        rows: i64,
        cols: i32,
        vectorized: i32,
    }
}

kernel_args! {
    /// norm_bwd_reduce's arguments (kernels/norm.cu): `groups` partial rows of `cols`.
    struct NormBwdReduceArgs {
        dw_partial: u64,
        db_partial: u64,
        groups: i32,
        cols: i32,
        dw: u64,
        db: u64,
    }
}

/// `native_layer_norm` / `_fused_rms_norm` with a fused kernel when the registry has one.
fn forward(launch: Launch, call: &ForwardCall) -> Result<Forward, StockReason> {
    let l = layout(
        call.input,
        call.shape,
        call.normalized_shape,
        launch,
        &[call.weight, call.bias],
    )?;
    let plan = plan(call.kind.kernel_op(false), &l, launch, call.narrow)?;

    let x = call.input.contiguous()?;
    let weight = contiguous(call.weight)?;
    let bias = contiguous(call.bias)?;
    let y = empty(call.shape, call.narrow.unwrap_or(l.kind), l.device)?;
    let mean = match call.kind {
        NormKind::Layer => Some(empty(&l.stat_shape, Kind::Float, l.device)?),
        NormKind::Rms => None,
    };
    let rstd = empty(&l.stat_shape, Kind::Float, l.device)?;

    let (x_ptr, w_ptr, b_ptr, y_ptr) = (
        x.addr(),
        dense_ptr(&weight),
        dense_ptr(&bias),
        device_addr(&y),
    );
    let vectorized = vectorized(&l, &[x_ptr, y_ptr, w_ptr, b_ptr]);
    let (mean_ptr, rstd_ptr) = (ptr(mean.as_ref()), ptr(Some(&rstd)));
    let eps = call.eps.unwrap_or(f64::from(f32::EPSILON)) as f32;

    let stream = plan.gpu.stream(launch);
    let mut args = stream.launch_builder(&plan.kernels.get(FWD_KERNEL)?.function);
    let fwd_args = NormFwdArgs {
        x: x_ptr,
        weight: w_ptr,
        bias: b_ptr,
        y: y_ptr,
        mean_out: mean_ptr,
        rstd_out: rstd_ptr,
        rows: l.rows,
        cols: l.cols_i32,
        eps,
        vectorized,
    };
    args::push(&mut args, &fwd_args);
    // SAFETY: norm_fwd's parameters are NormFwdArgs's fields (the compile test checks); x and y
    // hold rows x cols elements of the kernel's dtype (y of its TF_Y_DTYPE, which `plan`
    // compiled from `narrow`), weight and bias cols, mean (LayerNorm
    // only) and rstd rows fp32 values; all live until the stream is done with them (PyTorch's
    // allocator orders reuse on it).
    unsafe { args.launch(plan.rows_config()) }.map_err(|e| plan.launch_failed(e))?;
    Ok(Forward {
        y,
        mean,
        rstd,
        kernel: plan.variant.name.as_str(),
    })
}

struct Backward {
    pub dx: Option<Tensor>,
    pub dweight: Option<Tensor>,
    pub dbias: Option<Tensor>,
    pub kernel: &'static str,
}

struct BackwardCall<'a> {
    pub kind: NormKind,
    pub grad_out: &'a TfTensor,
    pub input: &'a TfTensor,
    /// `input.sizes()`.
    pub shape: &'a [i64],
    pub normalized_shape: &'a [i64],
    /// LayerNorm only.
    pub mean: Option<&'a TfTensor>,
    pub rstd: &'a TfTensor,
    pub weight: Option<&'a TfTensor>,
    /// LayerNorm only.
    pub bias: Option<&'a TfTensor>,
    /// dx, dweight, dbias (RMSNorm: the third is false).
    pub output_mask: [bool; 3],
    /// dy's dtype where it is narrower than x's (norm_cast); None: x's.
    pub narrow: Option<Kind>,
}

fn statistic_ok(stat: &TfTensor, rows: i64, input: &TfTensor) -> bool {
    stat.kind() == Some(Kind::Float) && stat.numel() == rows && stat.device() == input.device()
}

/// `native_layer_norm_backward` / `_fused_rms_norm_backward`: one pass over x and dy.
fn backward(launch: Launch, call: &BackwardCall) -> Result<Backward, StockReason> {
    let [want_dx, want_dw, want_db] = call.output_mask;
    let want_db = want_db && call.kind == NormKind::Layer;
    // Stock raises for a gradient of a missing parameter.
    if (want_dw && call.weight.is_none()) || (want_db && call.bias.is_none()) {
        return Err(StockReason::InvalidInput);
    }
    if !(want_dx || want_dw || want_db) {
        return Err(StockReason::NothingRequested);
    }
    let l = layout(
        call.input,
        call.shape,
        call.normalized_shape,
        launch,
        &[call.weight, call.bias],
    )?;
    if call.grad_out.sizes() != call.shape
        || call.grad_out.kind() != Some(call.narrow.unwrap_or(l.kind))
        || call.grad_out.device() != call.input.device()
        || !statistic_ok(call.rstd, l.rows, call.input)
        || (call.kind == NormKind::Layer
            && !call
                .mean
                .is_some_and(|m| statistic_ok(m, l.rows, call.input)))
    {
        return Err(StockReason::InvalidInput);
    }
    let plan = plan(call.kind.kernel_op(true), &l, launch, call.narrow)?;

    let dy = call.grad_out.contiguous()?;
    let x = call.input.contiguous()?;
    let mean = contiguous(call.mean)?;
    let rstd = call.rstd.contiguous()?;
    let weight = contiguous(call.weight)?;
    let dx = want_dx
        .then(|| empty(call.shape, l.kind, l.device))
        .transpose()?;
    let partial_shape = [i64::from(plan.partial_rows()), l.cols];
    let dw_partial = want_dw
        .then(|| empty(&partial_shape, Kind::Float, l.device))
        .transpose()?;
    let db_partial = want_db
        .then(|| empty(&partial_shape, Kind::Float, l.device))
        .transpose()?;
    let dweight = want_dw
        .then(|| empty(call.normalized_shape, l.kind, l.device))
        .transpose()?;
    let dbias = want_db
        .then(|| empty(call.normalized_shape, l.kind, l.device))
        .transpose()?;

    let (dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr) = (
        dy.addr(),
        x.addr(),
        dense_ptr(&mean),
        rstd.addr(),
        dense_ptr(&weight),
        ptr(dx.as_ref()),
    );
    let vectorized = vectorized(&l, &[dy_ptr, x_ptr, w_ptr, dx_ptr]);
    let (dwp_ptr, dbp_ptr) = (ptr(dw_partial.as_ref()), ptr(db_partial.as_ref()));
    let (dw_ptr, db_ptr) = (ptr(dweight.as_ref()), ptr(dbias.as_ref()));
    let groups = i32::try_from(plan.partial_rows()).map_err(|_| StockReason::NoVariantForShape)?;

    let stream = plan.gpu.stream(launch);
    let mut args = stream.launch_builder(&plan.kernels.get(BWD_KERNEL)?.function);
    let bwd_args = NormBwdArgs {
        dy: dy_ptr,
        x: x_ptr,
        mean: mean_ptr,
        rstd: rstd_ptr,
        weight: w_ptr,
        dx: dx_ptr,
        dw_partial: dwp_ptr,
        db_partial: dbp_ptr,
        rows: l.rows,
        cols: l.cols_i32,
        vectorized,
    };
    args::push(&mut args, &bwd_args);
    // SAFETY: norm_bwd's parameters are NormBwdArgs's fields (the compile test checks); dy, x and
    // dx hold rows x cols elements of the kernel's dtype (dy of its TF_Y_DTYPE), mean/rstd rows
    // fp32 values, weight cols elements, the partials partial_rows x cols fp32 values; null
    // pointers are the outputs not requested. All live until the stream is done with them.
    unsafe { args.launch(plan.rows_config()) }.map_err(|e| plan.launch_failed(e))?;

    if want_dw || want_db {
        let column_blocks = gpu::grid_dim(l.cols, 32)?;
        let mut args = stream.launch_builder(&plan.kernels.get(BWD_REDUCE_KERNEL)?.function);
        let reduce_args = NormBwdReduceArgs {
            dw_partial: dwp_ptr,
            db_partial: dbp_ptr,
            groups,
            cols: l.cols_i32,
            dw: dw_ptr,
            db: db_ptr,
        };
        args::push(&mut args, &reduce_args);
        let config = LaunchConfig {
            grid_dim: (column_blocks, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: norm_bwd_reduce's parameters are NormBwdReduceArgs's fields; the
        // partials hold groups x cols fp32 values written by the launch before on the same
        // stream, dweight and dbias cols elements (or null when not requested).
        unsafe { args.launch(config) }.map_err(|e| plan.launch_failed(e))?;
    }
    Ok(Backward {
        dx,
        dweight,
        dbias,
        kernel: plan.variant.name.as_str(),
    })
}

#[cfg(test)]
mod tests {
    fn parse(params: &str) -> Result<(), String> {
        parse_at("[80, 90]", 768, params)
    }

    /// A LayerNorm forward variant of 96 threads x 8 elements per CTA.
    fn parse_at(sm: &str, max_hidden: i64, params: &str) -> Result<(), String> {
        crate::ops::parse(&[(
            "t.toml",
            &format!(
                "[[variant]]\nname = \"t\"\nop = \"layer_norm_fwd\"\nsource = \"norm.cu\"\n\
                 dtypes = [\"bf16\"]\nsm = {sm}\nhidden = [1, {max_hidden}]\n\
                 params = {{ THREADS_PER_ROW = 96, ELEMS_PER_THREAD = 8{params} }}\n"
            ),
        )])
        .map(|_| ())
    }

    #[test]
    fn cluster_variants_are_hopper_only_one_row_per_cta_and_hold_their_rows() {
        // 4 CTAs of 96 x 8 hold 3072 columns.
        assert_eq!(
            parse_at("[90, 90]", 3072, ", ROWS_PER_BLOCK = 1, CLUSTER = 4"),
            Ok(())
        );
        let too_wide = parse_at("[90, 90]", 3073, ", ROWS_PER_BLOCK = 1, CLUSTER = 4");
        assert!(too_wide.unwrap_err().contains("holds 3072 elements"));
        let ampere = parse_at("[80, 90]", 768, ", ROWS_PER_BLOCK = 1, CLUSTER = 2");
        assert!(ampere.unwrap_err().contains("sm >= 90"));
        let two_rows = parse_at("[90, 90]", 768, ", ROWS_PER_BLOCK = 2, CLUSTER = 2");
        assert!(two_rows.unwrap_err().contains("ROWS_PER_BLOCK = 1"));
        let one_warp = crate::ops::parse(&[(
            "t.toml",
            "[[variant]]\nname = \"t\"\nop = \"layer_norm_bwd\"\nsource = \"norm.cu\"\n\
             dtypes = [\"bf16\"]\nsm = [90, 90]\nhidden = [1, 512]\nparams = { \
             THREADS_PER_ROW = 32, ROWS_PER_BLOCK = 1, ELEMS_PER_THREAD = 8, CLUSTER = 2 }\n",
        )]);
        assert!(one_warp.unwrap_err().contains("THREADS_PER_ROW >= 64"));
        for bad in [0, 3, 16] {
            let err = parse_at(
                "[90, 90]",
                768,
                &format!(", ROWS_PER_BLOCK = 1, CLUSTER = {bad}"),
            );
            assert!(
                err.unwrap_err().contains("CLUSTER must be"),
                "CLUSTER = {bad}"
            );
        }
    }

    #[test]
    fn prefetch_and_stream_are_flags() {
        assert_eq!(parse(", ROWS_PER_BLOCK = 1"), Ok(()));
        assert_eq!(
            parse(", ROWS_PER_BLOCK = 1, PREFETCH = 1, STREAM = 1"),
            Ok(())
        );
        for bad in [", STREAM = 2", ", PREFETCH = -1"] {
            let err = parse(&format!(", ROWS_PER_BLOCK = 1{bad}")).unwrap_err();
            assert!(err.contains("must be 0 or 1"), "{bad}: {err}");
        }
        let misspelt = parse(", ROWS_PER_BLOCK = 1, STREEM = 1");
        assert!(misspelt.unwrap_err().contains("unknown param"));
    }

    /// A backward variant with `params` after THREADS_PER_ROW and ROWS_PER_BLOCK = 1.
    fn parse_bwd(op: &str, params: &str) -> Result<(), String> {
        crate::ops::parse(&[(
            "t.toml",
            &format!(
                "[[variant]]\nname = \"t\"\nop = \"{op}\"\nsource = \"norm.cu\"\n\
                 dtypes = [\"bf16\"]\nsm = [80, 90]\nhidden = [1, 1024]\n\
                 params = {{ THREADS_PER_ROW = 1024, ROWS_PER_BLOCK = 1{params} }}\n"
            ),
        )])
        .map(|_| ())
    }

    #[test]
    fn shared_memory_accumulators_are_a_backward_flag_within_the_limit() {
        let fits = ", ELEMS_PER_THREAD = 16, SMEM_ACC = 1, MIN_BLOCKS = 1";
        assert_eq!(parse_bwd("layer_norm_bwd", fits), Ok(()));
        assert_eq!(parse_bwd("rms_norm_bwd", fits), Ok(()));
        // LayerNorm: 2 quantities x 1024 threads x 24 elements x 4 bytes = 192 KiB.
        let too_big = parse_bwd("layer_norm_bwd", ", ELEMS_PER_THREAD = 24, SMEM_ACC = 1");
        assert!(too_big.unwrap_err().contains("shared memory"));
        // RMSNorm has one quantity: 96 KiB fits.
        let one_quantity = parse_bwd("rms_norm_bwd", ", ELEMS_PER_THREAD = 24, SMEM_ACC = 1");
        assert_eq!(one_quantity, Ok(()));
        let forward = parse(", ROWS_PER_BLOCK = 1, SMEM_ACC = 1");
        assert!(forward.unwrap_err().contains("backward parameter"));
        let not_a_flag = parse_bwd("layer_norm_bwd", ", ELEMS_PER_THREAD = 8, SMEM_ACC = 2");
        assert!(not_a_flag.unwrap_err().contains("must be 0 or 1"));
    }
}
