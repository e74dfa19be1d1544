//! Cross-entropy over class-index targets, forward and backward: `aten::cross_entropy_loss`
//! (any caller) and `torchfuse::cross_entropy` (what the rewrite layer sends HF's causal-LM loss
//! to, the loss in fp32 from 16-bit logits), through kernels/cross_entropy.cu, or why stock
//! (PyTorch's `cross_entropy` on the logits cast to the loss dtype, in the glue) runs a call.
//! Both forwards share one backward entry (the glue's CrossEntropyFunction). In a compiler's
//! trace of static sizes the glue asks first (`plan_only`: decided, not launched or counted)
//! whether a kernel would serve; where one would, the graph calls `torchfuse::cross_entropy_fwd`
//! and `_bwd`, which arrive here at run time as the same entries.

use super::{elementwise, params};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{describe, device_addr, empty, kind_of_scalar_type};
use crate::abi::types::{TfCrossEntropyCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use cudarc::driver::LaunchConfig;
use serde::{Deserialize, Serialize};
use tch::Kind;

/// The kernels of kernels/cross_entropy.cu, by name.
const FWD_KERNEL: &str = "ce_fwd";
const REDUCE_KERNEL: &str = "ce_reduce";
const BWD_KERNEL: &str = "ce_bwd";

kernel_args! {
    /// ce_fwd's arguments (kernels/cross_entropy.cu): each row's loss and log-sum-exp, fp32.
    struct CeFwdArgs {
        logits: u64,
        target: u64,
        loss_rows: u64,
        lse: u64,
        rows: i64,
        cols: i64,
        ignore_index: i64,
        smoothing: f32,
    }
}

kernel_args! {
    /// ce_reduce's arguments (kernels/cross_entropy.cu).
    struct CeReduceArgs {
        loss_rows: u64,
        target: u64,
        out: u64,
        total_weight: u64,
        rows: i64,
        ignore_index: i64,
        /// at::Reduction's code.
        reduction: i32,
    }
}

kernel_args! {
    /// ce_bwd's arguments (kernels/cross_entropy.cu).
    struct CeBwdArgs {
        logits: u64,
        target: u64,
        lse: u64,
        total_weight: u64,
        grad_loss: u64,
        grad_logits: u64,
        rows: i64,
        cols: i64,
        ignore_index: i64,
        smoothing: f32,
        reduction: i32,
        vectorized: i32,
    }
}

/// ce_reduce's CTA (`TF_CE_REDUCE_THREADS`, passed by `defines`).
const REDUCE_THREADS: u32 = 1024;

/// at::Reduction's codes (the kernels get theirs from `defines`).
const REDUCTION_NONE: i32 = 0;
const REDUCTION_MEAN: i32 = 1;
const REDUCTION_SUM: i32 = 2;

/// Rows a launch's grid holds at most; CTAs stride over the rest (the kernels loop).
const MAX_GRID: i64 = 1 << 20;

pub struct CrossEntropy;

/// The checked facts of a call both directions share.
struct Shape {
    rows: i64,
    cols: i64,
    logits_kind: Kind,
}

impl Family for CrossEntropy {
    type Call = TfCrossEntropyCall;

    const FAMILY: OpFamily = OpFamily::CrossEntropy;

    unsafe fn unreadable(_entry: Entry, call: &TfCrossEntropyCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(
            &[
                &call.logits,
                &call.target,
                &call.grad_loss,
                &call.lse,
                &call.total_weight,
            ],
            call.plan_only == 0,
        )
    }

    unsafe fn counted(call: &TfCrossEntropyCall) -> bool {
        call.plan_only == 0
    }

    unsafe fn describe(
        _entry: Entry,
        call: &TfCrossEntropyCall,
    ) -> Option<(&'static str, Vec<i64>)> {
        Some(describe(call.logits.given()?))
    }

    /// Forward: loss, lse, total_weight. Backward: grad_logits.
    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfCrossEntropyCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        let logits = call.logits.given().ok_or(StockReason::InvalidInput)?;
        let target = call.target.given().ok_or(StockReason::InvalidInput)?;
        // Above 1 stock's call raises its error (the glue sends a negative or NaN one as 0,
        // which stock does not smooth).
        if !(0.0..=1.0).contains(&call.label_smoothing) {
            return Err(StockReason::InvalidInput);
        }
        if !(REDUCTION_NONE..=REDUCTION_SUM).contains(&call.reduction) {
            return Err(StockReason::InvalidInput);
        }
        // [rows, classes] logits and [rows] int64 targets; other forms (one sample, spatial
        // dims, probabilities as targets) are stock's.
        let [rows, cols] = shape else {
            return Err(StockReason::InvalidInput);
        };
        let (rows, cols) = (*rows, *cols);
        if target.sizes() != [rows] || target.kind() != Some(Kind::Int64) {
            return Err(StockReason::InvalidInput);
        }
        let logits_kind = logits.kind().ok_or(StockReason::UnsupportedDtype)?;
        let dtype = dtype_of(logits_kind).ok_or(StockReason::UnsupportedDtype)?;
        let device = gpu::torch_device(launch)?;
        if logits.device() != device || target.device() != device {
            return Err(StockReason::InvalidInput);
        }
        if !logits.is_contiguous() || !target.is_contiguous() {
            return Err(StockReason::NotContiguous);
        }
        if rows == 0 || cols == 0 {
            return Err(StockReason::EmptyInput);
        }
        let backward = entry == Entry::CrossEntropyBackward;
        let loss_kind = if backward {
            let grad = call.grad_loss.given().ok_or(StockReason::InvalidInput)?;
            grad.kind().ok_or(StockReason::UnsupportedDtype)?
        } else {
            kind_of_scalar_type(call.out_dtype).ok_or(StockReason::UnsupportedDtype)?
        };
        // The loss (forward) or its gradient (backward) in fp32 while the logits are 16-bit:
        // HF's form, which casts the logits to fp32 first.
        let wide = loss_kind != logits_kind;
        if wide && loss_kind != Kind::Float {
            return Err(StockReason::MixedDtypes);
        }
        let op = match (backward, wide) {
            (false, false) => KernelOp::CrossEntropyFwd,
            (false, true) => KernelOp::CrossEntropyFwdWide,
            (true, false) => KernelOp::CrossEntropyBwd,
            (true, true) => KernelOp::CrossEntropyBwdWide,
        };
        let selected = super::select(launch, |sm| Request {
            op,
            dtype,
            hidden: cols,
            rows,
            sm,
            deterministic: false,
            narrowed: false,
        })?;
        if call.plan_only != 0 {
            // The kernels are loaded now, at trace time; the graph's calls launch them.
            return Ok(Served::new(
                selected.variant.name.as_str(),
                [None, None, None],
            ));
        }
        let s = Shape {
            rows,
            cols,
            logits_kind,
        };
        if backward {
            backward_launch(launch, call, logits, target, &s, selected)
        } else {
            forward_launch(launch, call, logits, target, &s, loss_kind, selected)
        }
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if is_backward(op) {
            &[BWD_KERNEL]
        } else {
            &[FWD_KERNEL, REDUCE_KERNEL]
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            FWD_KERNEL => Some(CeFwdArgs::FIELDS),
            REDUCE_KERNEL => Some(CeReduceArgs::FIELDS),
            BWD_KERNEL => Some(CeBwdArgs::FIELDS),
            _ => None,
        }
    }

    /// Which kernels kernels/cross_entropy.cu compiles, and whether the loss is fp32.
    fn defines(op: KernelOp) -> Vec<String> {
        let wide = matches!(
            op,
            KernelOp::CrossEntropyFwdWide | KernelOp::CrossEntropyBwdWide
        );
        vec![
            format!("-DTF_CE_FWD={}", i32::from(!is_backward(op))),
            format!("-DTF_CE_BWD={}", i32::from(is_backward(op))),
            format!("-DTF_WIDE={}", i32::from(wide)),
            elementwise::define(),
            format!("-DTF_CE_REDUCE_THREADS={REDUCE_THREADS}"),
            format!("-DTF_REDUCTION_NONE={REDUCTION_NONE}"),
            format!("-DTF_REDUCTION_MEAN={REDUCTION_MEAN}"),
        ]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        let p: Params = params::parse(v)?;
        params::one_of(v, "THREADS", p.threads, &[128, 256, 512, 1024])?;
        Ok(p)
    }
}

fn is_backward(op: KernelOp) -> bool {
    matches!(
        op,
        KernelOp::CrossEntropyBwd | KernelOp::CrossEntropyBwdWide
    )
}

/// One CTA a row, up to `MAX_GRID` rows at once.
fn row_launch(rows: i64, threads: i64) -> Result<LaunchConfig, StockReason> {
    Ok(LaunchConfig {
        grid_dim: (gpu::grid_dim(rows.min(MAX_GRID), 1)?, 1, 1),
        block_dim: (
            u32::try_from(threads).map_err(|_| StockReason::InternalError)?,
            1,
            1,
        ),
        shared_mem_bytes: 0,
    })
}

/// ce_bwd's 16-byte accesses are legal from each row's first 16-byte boundary on (the elements
/// before and after the whole chunks go one by one): the logits and their gradient sit at the
/// same offset within 16 bytes. (ce_fwd reads the logits alone: always.)
fn vectorized(addrs: &[u64]) -> i32 {
    i32::from(addrs.windows(2).all(|pair| pair[0] % 16 == pair[1] % 16))
}

/// ce_fwd, then ce_reduce (mean, sum; or none with a loss dtype other than fp32).
unsafe fn forward_launch(
    launch: Launch,
    call: &TfCrossEntropyCall,
    logits: &TfTensor,
    target: &TfTensor,
    s: &Shape,
    loss_kind: Kind,
    selected: Selected,
) -> Result<Served, StockReason> {
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = selected;
    let p = CrossEntropy::params(params)?;
    let device = logits.device();
    let loss_rows = empty(&[s.rows], Kind::Float, device)?;
    let lse = empty(&[s.rows], Kind::Float, device)?;
    let mut total_weight = empty(&[], Kind::Float, device)?;
    let stream = gpu.stream(launch);
    let (logits_ptr, target_ptr) = (logits.addr(), target.addr());
    let (rows_ptr, lse_ptr, weight_ptr) = (
        device_addr(&loss_rows),
        device_addr(&lse),
        device_addr(&total_weight),
    );
    let smoothing = call.label_smoothing as f32;
    let fwd = kernels.get(FWD_KERNEL)?;
    let mut args = stream.launch_builder(&fwd.function);
    let fwd_args = CeFwdArgs {
        logits: logits_ptr,
        target: target_ptr,
        loss_rows: rows_ptr,
        lse: lse_ptr,
        rows: s.rows,
        cols: s.cols,
        ignore_index: call.ignore_index,
        smoothing,
    };
    args::push(&mut args, &fwd_args);
    // SAFETY: ce_fwd's parameters are CeFwdArgs's fields (the compile test checks); logits is
    // [rows, cols] contiguous of the module's dtype,
    // target [rows] int64, loss_rows and lse fp32 [rows]; all live until the stream is done
    // with them (PyTorch's allocator orders reuse on it).
    unsafe { args.launch(row_launch(s.rows, p.threads)?) }
        .map_err(|e| super::launch_failed(variant, e))?;
    let loss = if call.reduction == REDUCTION_NONE && loss_kind == Kind::Float {
        loss_rows.shallow_clone()
    } else {
        let loss_shape: &[i64] = if call.reduction == REDUCTION_NONE {
            &[s.rows]
        } else {
            &[]
        };
        let loss = empty(loss_shape, loss_kind, device)?;
        let loss_ptr = device_addr(&loss);
        let grid = if call.reduction == REDUCTION_NONE {
            gpu::grid_dim(s.rows.min(MAX_GRID), i64::from(REDUCE_THREADS))?
        } else {
            1
        };
        let reduce = kernels.get(REDUCE_KERNEL)?;
        let mut args = stream.launch_builder(&reduce.function);
        let reduce_args = CeReduceArgs {
            loss_rows: rows_ptr,
            target: target_ptr,
            out: loss_ptr,
            total_weight: weight_ptr,
            rows: s.rows,
            ignore_index: call.ignore_index,
            reduction: call.reduction,
        };
        args::push(&mut args, &reduce_args);
        let config = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ce_reduce's parameters are CeReduceArgs's fields; out holds one value (mean, sum) or rows
        // values (none) of the loss dtype the module was compiled for (fp32 when wide).
        unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
        loss
    };
    if call.reduction == REDUCTION_NONE {
        // No reduction ran; a `none` backward never reads total_weight (nll_loss's is 0 too).
        total_weight
            .f_zero_()
            .map(drop)
            .map_err(|_| StockReason::InternalError)?;
    }
    Ok(Served::new(
        variant.name.as_str(),
        [Some(loss), Some(lse), Some(total_weight)],
    ))
}

unsafe fn backward_launch(
    launch: Launch,
    call: &TfCrossEntropyCall,
    logits: &TfTensor,
    target: &TfTensor,
    s: &Shape,
    selected: Selected,
) -> Result<Served, StockReason> {
    let grad_loss = call.grad_loss.given().ok_or(StockReason::InvalidInput)?;
    let lse = call.lse.given().ok_or(StockReason::InvalidInput)?;
    let total_weight = call.total_weight.given().ok_or(StockReason::InvalidInput)?;
    let device = logits.device();
    let grad_numel = if call.reduction == REDUCTION_NONE {
        s.rows
    } else {
        1
    };
    let float_ok = |t: &TfTensor, n: i64| {
        t.device() == device && t.kind() == Some(Kind::Float) && t.numel() == n
    };
    if !float_ok(lse, s.rows) || !float_ok(total_weight, 1) || !lse.is_contiguous() {
        return Err(StockReason::InvalidInput);
    }
    if grad_loss.device() != device || grad_loss.numel() != grad_numel {
        return Err(StockReason::InvalidInput);
    }
    if !grad_loss.is_contiguous() {
        return Err(StockReason::NotContiguous);
    }
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = selected;
    let p = CrossEntropy::params(params)?;
    let grad_logits = empty(&[s.rows, s.cols], s.logits_kind, device)?;
    let stream = gpu.stream(launch);
    let (logits_ptr, grad_logits_ptr) = (logits.addr(), device_addr(&grad_logits));
    let bwd_args = CeBwdArgs {
        logits: logits_ptr,
        target: target.addr(),
        lse: lse.addr(),
        total_weight: total_weight.addr(),
        grad_loss: grad_loss.addr(),
        grad_logits: grad_logits_ptr,
        rows: s.rows,
        cols: s.cols,
        ignore_index: call.ignore_index,
        smoothing: call.label_smoothing as f32,
        reduction: call.reduction,
        vectorized: vectorized(&[logits_ptr, grad_logits_ptr]),
    };
    let bwd = kernels.get(BWD_KERNEL)?;
    let mut args = stream.launch_builder(&bwd.function);
    args::push(&mut args, &bwd_args);
    // SAFETY: ce_bwd's parameters are CeBwdArgs's fields (the compile test checks); shapes and
    // dtypes checked above; grad_logits is new, [rows, cols] of the logits' dtype.
    unsafe { args.launch(row_launch(s.rows, p.threads)?) }
        .map_err(|e| super::launch_failed(variant, e))?;
    Ok(Served::new(
        variant.name.as_str(),
        [Some(grad_logits), None, None],
    ))
}

/// A cross_entropy variant's compile-time params (`registry/cross_entropy.toml`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Threads per CTA, which owns a row.
    threads: i64,
}
