//! The layout elementwise families share (kernels/elementwise.cuh): each thread owns `chunks`
//! chunks of [`CHUNK`] consecutive elements, `threads` threads per CTA; their variants' params
//! and their one launch (gelu, swiglu, mixed_add).

use super::{params, Family, KernelOp, Request, Selected, Variant};
use crate::gpu::args::{self, KernelArgs};
use crate::gpu::{self, Launch};
use crate::select::{DType, StockReason};
use cudarc::driver::LaunchConfig;
use serde::{Deserialize, Serialize};

/// Elements per chunk: `TF_EW_CHUNK` in the kernels, passed by [`define`].
pub const CHUNK: i64 = 8;

/// The compile-time define that gives the kernels [`CHUNK`].
pub fn define() -> String {
    format!("-DTF_EW_CHUNK={CHUNK}")
}

/// An elementwise variant's compile-time params (its registry entry's `params`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Threads per CTA.
    threads: i64,
    /// Chunks of [`CHUNK`] elements per thread.
    chunks: i64,
}

/// An elementwise variant's params, read and checked.
pub fn prepare(v: &Variant) -> Result<Params, String> {
    let p: Params = params::parse(v)?;
    params::one_of(v, "THREADS", p.threads, &[128, 256, 512, 1024])?;
    params::in_range(v, "CHUNKS", p.chunks, 1..=8)?;
    Ok(p)
}

/// The launch of variant params `p` that covers `n` elements; a grid too large for CUDA goes to
/// stock.
pub fn launch_config(n: i64, p: &Params) -> Result<LaunchConfig, StockReason> {
    let (threads, chunks) = (p.threads, p.chunks);
    let block = u32::try_from(threads).map_err(|_| StockReason::InternalError)?;
    Ok(LaunchConfig {
        grid_dim: (
            gpu::grid_dim(gpu::ceil_div(n, CHUNK), threads * chunks)?,
            1,
            1,
        ),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One pass of family `F`'s op `op` over n elements of `dtype`: the registry's variant and its
/// launch, then the arguments `args` makes (last, so that no output is made for a call stock
/// takes), then the op's one kernel launched on the call's stream. The variant's name.
///
/// # Safety
/// The arguments' pointers address the elements the kernel reads and writes for n, of the
/// kernel's dtypes, valid until the stream is done with them; an output does not overlap an
/// input.
pub unsafe fn launch_pass<F: Family<Params = Params>, A: KernelArgs>(
    launch: Launch,
    op: KernelOp,
    dtype: DType,
    n: i64,
    args: impl FnOnce() -> Result<A, StockReason>,
) -> Result<&'static str, StockReason> {
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = super::select(launch, |sm| Request {
        op,
        dtype,
        hidden: 1,
        rows: n,
        sm,
        deterministic: false,
        narrowed: false,
    })?;
    let p = F::params(params)?;
    let config = launch_config(n, p)?;
    let [name] = F::kernels(op) else {
        return Err(StockReason::InternalError);
    };
    let kernel_args = args()?;
    let stream = gpu.stream(launch);
    let mut builder = stream.launch_builder(&kernels.get(name)?.function);
    args::push(&mut builder, &kernel_args);
    // SAFETY: the kernel's parameters are `A`'s fields (the compile test checks each kernel's
    // against its struct); the pointers are the caller's promise.
    unsafe { builder.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
    Ok(variant.name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_every_chunk_and_the_define_names_the_chunk() {
        let p = Params {
            threads: 256,
            chunks: 4,
        };
        let c = launch_config(CHUNK * 256 * 4 + 1, &p).expect("a small grid");
        assert_eq!((c.grid_dim.0, c.block_dim.0), (2, 256));
        assert_eq!(launch_config(0, &p).map(|c| c.grid_dim.0), Ok(0));
        assert_eq!(define(), "-DTF_EW_CHUNK=8");
    }
}
