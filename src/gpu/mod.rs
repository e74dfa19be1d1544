//! The GPU runtime: NVRTC, the CUBIN disk cache, devices and streams, the module store and
//! the launch helpers. The only code that uses cudarc's `sys`/`result` layers.

pub mod args;
pub mod cache;
#[cfg(test)]
pub mod cubin;
pub mod device;
pub mod modules;
pub mod nvrtc;
pub mod sources;

use crate::select::StockReason;
pub use device::{device, torch_device, Device, Launch, SideStream};
pub use modules::{Kernel, Kernels};

/// `n / per` rounded up, for `n >= 0` and `per > 0` (the one ceil-div of every launch).
pub fn ceil_div(n: i64, per: i64) -> i64 {
    n / per + i64::from(n % per != 0)
}

/// `ceil_div(n, per)` as a CUDA grid dimension; a call too large for one goes to stock.
pub fn grid_dim(n: i64, per: i64) -> Result<u32, StockReason> {
    if n < 0 || per <= 0 {
        return Err(StockReason::InternalError);
    }
    u32::try_from(ceil_div(n, per)).map_err(|_| StockReason::NoVariantForShape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_dims_round_up_and_refuse_what_a_grid_cannot_hold() {
        assert_eq!(ceil_div(0, 32), 0);
        assert_eq!(ceil_div(i64::MAX, 2), i64::MAX / 2 + 1);
        assert_eq!(grid_dim(0, 32), Ok(0));
        assert_eq!(grid_dim(1, 32), Ok(1));
        assert_eq!(grid_dim(64, 32), Ok(2));
        assert_eq!(grid_dim(65, 32), Ok(3));
        assert_eq!(grid_dim(1 << 40, 1), Err(StockReason::NoVariantForShape));
        assert_eq!(grid_dim(5, 0), Err(StockReason::InternalError));
        assert_eq!(grid_dim(-1, 4), Err(StockReason::InternalError));
    }
}
