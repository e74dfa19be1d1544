//! `aten::sum.dim_IntList` where the dims summed are a contiguous tensor's leading ones: the
//! column sums autograd makes every biased Linear's bias gradient with (the output's gradient
//! summed over its rows), through kernels/column_sum.cu, or why stock's reduction runs a call.

use super::params;
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty, kind_of_scalar_type};
use crate::abi::types::{TfColumnSumCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use cudarc::driver::LaunchConfig;
use serde::{Deserialize, Serialize};
use tch::Kind;

/// The kernels of kernels/column_sum.cu, by name.
const PARTIAL_KERNEL: &str = "column_sum_partial";
const FINISH_KERNEL: &str = "column_sum_finish";

/// Threads a CTA of the finishing kernel (one a column); kernels/column_sum.cu takes it as
/// TF_FINISH_THREADS.
const FINISH_THREADS: i64 = 256;

/// CUDA's largest grid y dimension: the row splits of one call.
const MAX_SPLITS: i64 = 65535;

kernel_args! {
    /// column_sum_partial's arguments (kernels/column_sum.cu).
    struct PartialArgs {
        x: u64,
        partial: u64,
        rows: i64,
        cols: i64,
        vectorized: i32,
    }
}

kernel_args! {
    /// column_sum_finish's arguments (kernels/column_sum.cu).
    struct FinishArgs {
        partial: u64,
        out: u64,
        splits: i64,
        cols: i64,
    }
}

/// A call's sum as rows x columns: the leading `summed` dims of a row-major tensor summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Columns {
    pub summed: usize,
    pub rows: i64,
    pub cols: i64,
}

/// Whether `dims` (as given to `sum`, negative ones counting from the end) name exactly the
/// leading dims 0..k of a tensor of `sizes`, for some k below its rank; then the sum as rows x
/// columns. None for anything else: no dims or all of them (a full reduction), a dim out of
/// range or repeated (stock raises), any other set.
pub fn columns_of(sizes: &[i64], dims: &[i64]) -> Option<Columns> {
    let ndim = i64::try_from(sizes.len()).ok()?;
    if dims.is_empty() || dims.len() >= sizes.len() {
        return None;
    }
    let mut seen = vec![false; sizes.len()];
    for &d in dims {
        let wrapped = if d < 0 { d + ndim } else { d };
        let index = usize::try_from(wrapped).ok().filter(|&i| i < sizes.len())?;
        if std::mem::replace(&mut seen[index], true) {
            return None;
        }
    }
    let summed = dims.len();
    if !seen[..summed].iter().all(|&s| s) {
        return None;
    }
    Some(Columns {
        summed,
        rows: sizes[..summed].iter().product(),
        cols: sizes[summed..].iter().product(),
    })
}

/// The sum's shape: the dims kept, with the summed ones as 1 where `keepdim`.
pub fn output_shape(sizes: &[i64], summed: usize, keepdim: bool) -> Vec<i64> {
    let ones = if keepdim { summed } else { 0 };
    std::iter::repeat_n(1, ones)
        .chain(sizes[summed..].iter().copied())
        .collect()
}

pub struct ColumnSum;

impl Family for ColumnSum {
    type Call = TfColumnSumCall;

    const FAMILY: OpFamily = OpFamily::ColumnSum;

    unsafe fn unreadable(_entry: Entry, call: &TfColumnSumCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(&[&call.input], true)
    }

    unsafe fn describe(_entry: Entry, call: &TfColumnSumCall) -> Option<(&'static str, Vec<i64>)> {
        Some(describe(call.input.given()?))
    }

    /// The sum over the leading dims, in the input's dtype.
    unsafe fn serve(
        _entry: Entry,
        launch: Launch,
        call: &TfColumnSumCall,
        shape: &[i64],
    ) -> Result<Served, StockReason> {
        let input = call.input.given().ok_or(StockReason::InvalidInput)?;
        let kind = input.kind().ok_or(StockReason::UnsupportedDtype)?;
        let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
        // A dtype asked for other than the input's: stock's accumulation and cast.
        if call.has_dtype != 0 && kind_of_scalar_type(call.out_dtype) != Some(kind) {
            return Err(StockReason::FormNotServed);
        }
        let dims: &[i64] = if call.has_dims != 0 && !call.dims.is_null() {
            // SAFETY: the glue's promise: `dims` points to `ndims` values alive for the call.
            unsafe { std::slice::from_raw_parts(call.dims, call.ndims) }
        } else {
            &[]
        };
        // Not a sum over leading dims (a full reduction, a last-dim sum, bad dims): stock's.
        let columns = columns_of(shape, dims).ok_or(StockReason::FormNotServed)?;
        let device = gpu::torch_device(launch)?;
        if input.device() != device || !input.is_contiguous() {
            return Err(StockReason::NotContiguous);
        }
        let Columns { summed, rows, cols } = columns;
        if rows == 0 || cols == 0 {
            return Err(StockReason::EmptyInput);
        }
        let Selected {
            gpu,
            variant,
            kernels,
            params,
        } = super::select(launch, |sm| Request {
            op: KernelOp::ColumnSum,
            dtype,
            hidden: cols,
            rows,
            sm,
            deterministic: false,
            narrowed: false,
        })?;
        let p = ColumnSum::params(params)?;
        let splits = gpu::ceil_div(rows, p.rows_per_split);
        if splits > MAX_SPLITS {
            return Err(StockReason::NoVariantForShape);
        }
        // Elements of one 16-byte access: a lane's columns (kernels/column_sum.cu's TF_VEC).
        let per_access = 16 / kind.elt_size_in_bytes() as i64;
        let tile = 32 * per_access;
        let partial_config = LaunchConfig {
            grid_dim: (
                gpu::grid_dim(cols, tile)?,
                u32::try_from(splits).map_err(|_| StockReason::InternalError)?,
                1,
            ),
            block_dim: (
                u32::try_from(32 * p.warps).map_err(|_| StockReason::InternalError)?,
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        let finish_config = LaunchConfig {
            grid_dim: (gpu::grid_dim(cols, FINISH_THREADS)?, 1, 1),
            block_dim: (FINISH_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let partial = empty(&[splits, cols], Kind::Float, device)?;
        let out = empty(
            &output_shape(shape, summed, call.keepdim != 0),
            kind,
            device,
        )?;
        let x = input.addr();
        // 16-byte accesses need the rows' starts aligned too: whole 16-byte groups a row.
        let vectorized = i32::from(aligned16([x]) && cols % per_access == 0);
        let partial_args = PartialArgs {
            x,
            partial: device_addr(&partial),
            rows,
            cols,
            vectorized,
        };
        let finish_args = FinishArgs {
            partial: device_addr(&partial),
            out: device_addr(&out),
            splits,
            cols,
        };
        let stream = gpu.stream(launch);
        let mut args = stream.launch_builder(&kernels.get(PARTIAL_KERNEL)?.function);
        args::push(&mut args, &partial_args);
        // SAFETY: column_sum_partial's parameters are PartialArgs's fields (the compile test
        // checks); x holds rows x cols contiguous elements of the dtype the module was compiled
        // for, `partial` splits x cols floats; both live until the stream is done with them
        // (PyTorch's allocator orders reuse on it).
        unsafe { args.launch(partial_config) }.map_err(|e| super::launch_failed(variant, e))?;
        let mut args = stream.launch_builder(&kernels.get(FINISH_KERNEL)?.function);
        args::push(&mut args, &finish_args);
        // SAFETY: column_sum_finish's parameters are FinishArgs's fields; it reads `partial` as
        // above and writes cols elements of `out`.
        unsafe { args.launch(finish_config) }.map_err(|e| super::launch_failed(variant, e))?;
        Ok(Served::new(variant.name.as_str(), [Some(out), None, None]))
    }

    fn kernels(_op: KernelOp) -> &'static [&'static str] {
        &[PARTIAL_KERNEL, FINISH_KERNEL]
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            PARTIAL_KERNEL => Some(PartialArgs::FIELDS),
            FINISH_KERNEL => Some(FinishArgs::FIELDS),
            _ => None,
        }
    }

    fn defines(_op: KernelOp) -> Vec<String> {
        vec![format!("-DTF_FINISH_THREADS={FINISH_THREADS}")]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        let p: Params = params::parse(v)?;
        params::one_of(v, "WARPS", p.warps, &[4, 8, 16])?;
        params::one_of(
            v,
            "ROWS_PER_SPLIT",
            p.rows_per_split,
            &[64, 128, 256, 512, 1024],
        )?;
        params::one_of(v, "UNROLL", p.unroll, &[1, 2, 4, 8])?;
        Ok(p)
    }
}

/// A column_sum variant's compile-time params (`registry/column_sum.toml`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Warps a CTA of the partial-sum kernel.
    warps: i64,
    /// Rows a CTA sums (the last split takes what is left): the grid's y dimension.
    rows_per_split: i64,
    /// Rows a warp loads before it adds them.
    unroll: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_dims_in_any_order_and_sign_are_column_sums() {
        let sizes = [4, 8, 768];
        assert_eq!(
            columns_of(&sizes, &[0]),
            Some(Columns {
                summed: 1,
                rows: 4,
                cols: 8 * 768
            })
        );
        for dims in [&[0, 1][..], &[1, 0], &[-3, -2], &[1, -3]] {
            assert_eq!(
                columns_of(&sizes, dims),
                Some(Columns {
                    summed: 2,
                    rows: 32,
                    cols: 768
                }),
                "{dims:?}"
            );
        }
    }

    #[test]
    fn other_dims_full_sums_and_bad_dims_go_to_stock() {
        let sizes = [4, 8, 768];
        for dims in [
            &[][..],    // dim=None or []: a full reduction
            &[0, 1, 2], // every dim: a full reduction
            &[1],       // not a leading dim
            &[2],       // the last dim
            &[0, 2],    // not contiguous from the front
            &[0, 0],    // repeated: stock raises
            &[0, -3],   // repeated after wrapping
            &[3],       // out of range: stock raises
            &[-4],      // out of range
        ] {
            assert_eq!(columns_of(&sizes, dims), None, "{dims:?}");
        }
        assert_eq!(columns_of(&[], &[0]), None, "a 0-d tensor");
    }

    #[test]
    fn keepdim_keeps_the_summed_dims_as_ones() {
        let sizes = [4, 8, 768];
        assert_eq!(output_shape(&sizes, 2, true), vec![1, 1, 768]);
        assert_eq!(output_shape(&sizes, 2, false), vec![768]);
        assert_eq!(output_shape(&sizes, 1, false), vec![8, 768]);
    }
}
