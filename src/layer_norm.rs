//! LayerNorm forward through a fused kernel (kernels/layer_norm.cu), or why stock runs it.

use crate::jit;
use crate::registry::{KernelOp, Request, StockReason, Variant, REGISTRY};
use crate::tensor::dtype_of;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ffi::c_void;
use tch::{Device, Kind, Tensor};

/// Compile-time parameters every layer_norm_fwd variant must set, and their limits.
pub fn validate_variant(v: &Variant) -> Result<(), String> {
    let get = |k: &str| {
        v.params
            .get(k)
            .copied()
            .ok_or_else(|| format!("{}: missing param {k}", v.name))
    };
    let tpr = get("THREADS_PER_ROW")?;
    let rows = get("ROWS_PER_BLOCK")?;
    let ept = get("ELEMS_PER_THREAD")?;
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
    if tpr * ept < v.hidden[1] {
        return Err(format!(
            "{}: holds {} elements per row but claims hidden up to {}",
            v.name,
            tpr * ept,
            v.hidden[1]
        ));
    }
    Ok(())
}

pub struct Forward {
    pub y: Tensor,
    pub mean: Tensor,
    pub rstd: Tensor,
    pub kernel: &'static str,
}

fn is_16_byte_aligned(t: &Tensor) -> bool {
    (t.data_ptr() as usize).is_multiple_of(16)
}

/// Runs `native_layer_norm` with a fused kernel when the registry has one for this call.
/// `shape` is `input.size()`, which the caller has already read for its log line.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    device_index: i32,
    stream: *mut c_void,
    input: &Tensor,
    shape: &[i64],
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Forward, StockReason> {
    let kind = input.f_kind().map_err(|_| StockReason::UnsupportedDtype)?;
    let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
    let axis = shape
        .len()
        .checked_sub(normalized_shape.len())
        .filter(|_| !normalized_shape.is_empty())
        .ok_or(StockReason::InvalidInput)?;
    if shape[axis..] != *normalized_shape {
        return Err(StockReason::InvalidInput);
    }
    let device =
        Device::Cuda(usize::try_from(device_index).map_err(|_| StockReason::InvalidInput)?);
    for param in [weight, bias].into_iter().flatten() {
        if param.size() != normalized_shape || param.device() != input.device() {
            return Err(StockReason::InvalidInput);
        }
        if param.f_kind().ok() != Some(kind) {
            return Err(StockReason::MixedDtypes);
        }
    }
    let cols: i64 = normalized_shape.iter().product();
    let rows: i64 = shape[..axis].iter().product();
    if cols == 0 || rows == 0 {
        return Err(StockReason::EmptyInput);
    }
    let cols_i32 = i32::try_from(cols).map_err(|_| StockReason::NoVariantForShape)?;

    let gpu = jit::device(device_index).map_err(|e| {
        tracing::debug!("cuda:{device_index} unavailable to torchfuse: {e}");
        StockReason::KernelUnavailable
    })?;
    let registry = REGISTRY
        .as_ref()
        .map_err(|_| StockReason::KernelUnavailable)?;
    let index = registry.select(&Request {
        op: KernelOp::LayerNormFwd,
        dtype,
        hidden: cols,
        rows,
        sm: gpu.sm,
    })?;
    let variant = registry.variant(index);
    let function = jit::function(index, variant, dtype, device_index, &gpu)
        .ok_or(StockReason::KernelUnavailable)?;

    let rows_per_block = variant.params.get("ROWS_PER_BLOCK").copied().unwrap_or(1);
    let threads_per_row = variant.params.get("THREADS_PER_ROW").copied().unwrap_or(32);
    let blocks = u32::try_from((rows + rows_per_block - 1) / rows_per_block)
        .ok()
        .filter(|&b| b < (1u32 << 31))
        .ok_or(StockReason::NoVariantForShape)?;

    let x = input.contiguous();
    let weight = weight.map(Tensor::contiguous);
    let bias = bias.map(Tensor::contiguous);
    let y = Tensor::f_empty(shape, (kind, device)).map_err(|_| StockReason::InternalError)?;
    let mut stat_shape = shape[..axis].to_vec();
    stat_shape.extend(std::iter::repeat_n(1, normalized_shape.len()));
    let mean = Tensor::f_empty(&stat_shape, (Kind::Float, device))
        .map_err(|_| StockReason::InternalError)?;
    let rstd = Tensor::f_empty(&stat_shape, (Kind::Float, device))
        .map_err(|_| StockReason::InternalError)?;

    let vec_elems = (16 / dtype.size_bytes()) as i64;
    let vectorized = cols % vec_elems == 0
        && [Some(&x), Some(&y), weight.as_ref(), bias.as_ref()]
            .into_iter()
            .flatten()
            .all(is_16_byte_aligned);
    let ptr = |t: Option<&Tensor>| t.map_or(0u64, |t| t.data_ptr() as u64);
    let (x_ptr, w_ptr, b_ptr, y_ptr) = (
        ptr(Some(&x)),
        ptr(weight.as_ref()),
        ptr(bias.as_ref()),
        ptr(Some(&y)),
    );
    let (mean_ptr, rstd_ptr) = (ptr(Some(&mean)), ptr(Some(&rstd)));
    let eps = eps as f32;
    let vectorized = i32::from(vectorized);

    // SAFETY: `stream` is PyTorch's current stream of this device, alive for the call.
    let stream = unsafe {
        gpu.ctx
            .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
    };
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads_per_row as u32, rows_per_block as u32, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&function);
    launch
        .arg(&x_ptr)
        .arg(&w_ptr)
        .arg(&b_ptr)
        .arg(&y_ptr)
        .arg(&mean_ptr)
        .arg(&rstd_ptr)
        .arg(&rows)
        .arg(&cols_i32)
        .arg(&eps)
        .arg(&vectorized);
    // SAFETY: argument types and order match layer_norm_fwd; every buffer holds rows x cols
    // (or cols, or rows) elements of the kernel's dtype and lives until the stream is done
    // with it (PyTorch's allocator orders reuse on this stream).
    unsafe { launch.launch(config) }.map_err(|e| {
        crate::ffi::warn_once_launch_failure(&variant.name, &e.to_string());
        StockReason::LaunchFailed
    })?;
    Ok(Forward {
        y,
        mean,
        rstd,
        kernel: variant.name.as_str(),
    })
}
