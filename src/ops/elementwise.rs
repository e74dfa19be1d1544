//! The layout elementwise families share (kernels/elementwise.cuh): each thread owns `chunks`
//! chunks of [`CHUNK`] consecutive elements, `threads` threads per CTA.

use crate::gpu;
use crate::select::StockReason;
use cudarc::driver::LaunchConfig;

/// Elements per chunk: `TF_EW_CHUNK` in the kernels, passed by [`define`].
pub const CHUNK: i64 = 8;

/// The compile-time define that gives the kernels [`CHUNK`].
pub fn define() -> String {
    format!("-DTF_EW_CHUNK={CHUNK}")
}

/// The launch that covers `n` elements; a grid too large for CUDA goes to stock.
pub fn launch_config(n: i64, threads: i64, chunks: i64) -> Result<LaunchConfig, StockReason> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_every_chunk_and_the_define_names_the_chunk() {
        let c = launch_config(CHUNK * 256 * 4 + 1, 256, 4).expect("a small grid");
        assert_eq!((c.grid_dim.0, c.block_dim.0), (2, 256));
        assert_eq!(launch_config(0, 256, 4).map(|c| c.grid_dim.0), Ok(0));
        assert_eq!(define(), "-DTF_EW_CHUNK=8");
    }
}
