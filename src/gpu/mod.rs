//! The GPU runtime: NVRTC, the CUBIN disk cache, devices and streams, the module store and
//! the launch helpers. The only code that uses cudarc's `sys`/`result` layers.

pub mod cache;
pub mod device;
pub mod modules;
pub mod nvrtc;
pub mod sources;

pub use device::{device, Device, Launch, SideStream};
pub use modules::{Kernel, Kernels};

/// `n / per` rounded up, as a CUDA grid dimension; None when it does not fit in 32 bits or
/// `per` is not positive. The one ceil-div of every launch.
pub fn blocks(n: i64, per: i64) -> Option<u32> {
    if per <= 0 || n < 0 {
        return None;
    }
    u32::try_from(n.checked_add(per - 1)? / per).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn blocks_round_up_and_refuse_what_a_grid_cannot_hold() {
        assert_eq!(super::blocks(0, 32), Some(0));
        assert_eq!(super::blocks(1, 32), Some(1));
        assert_eq!(super::blocks(64, 32), Some(2));
        assert_eq!(super::blocks(65, 32), Some(3));
        assert_eq!(super::blocks(1 << 40, 1), None);
        assert_eq!(super::blocks(5, 0), None);
        assert_eq!(super::blocks(-1, 4), None);
    }
}
