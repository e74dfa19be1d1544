//! The GPUs torchfuse launches on: PyTorch's primary context of each device, its SM version,
//! and a side stream per device for work that overlaps the caller's stream.

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Where a call runs: PyTorch's device index and current stream (`TfLaunch`).
pub use crate::abi::types::TfLaunch as Launch;

/// The tch device of a launch's GPU.
pub fn torch_device(launch: Launch) -> Result<tch::Device, crate::select::StockReason> {
    usize::try_from(launch.device)
        .map(tch::Device::Cuda)
        .map_err(|_| crate::select::StockReason::InvalidInput)
}

/// A GPU as torchfuse uses it: PyTorch's primary context and the SM version.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub sm: u32,
    pub arch: String,
    pub multiprocessors: u32,
    side: Mutex<Option<SideStream>>,
}

/// A second stream of a device, and the two events that fork work onto it from the caller's
/// stream and join it back: work on it is ordered like the rest of the op, and a CUDA graph
/// capture of the caller's stream takes it in.
pub struct SideStream {
    pub stream: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
}

impl SideStream {
    fn new(ctx: &Arc<CudaContext>) -> Result<SideStream, DriverError> {
        Ok(SideStream {
            stream: ctx.new_stream()?,
            fork: ctx.new_event(None)?,
            join: ctx.new_event(None)?,
        })
    }

    /// The side stream waits for what `main` has queued so far.
    pub fn fork_from(&self, main: &CudaStream) -> Result<(), DriverError> {
        self.fork.record(main)?;
        self.stream.wait(&self.fork)
    }

    /// `main` waits for what the side stream has queued so far. Where that cannot be queued,
    /// the host waits for the side stream instead, so no memory it writes is handed back
    /// while it still runs.
    pub fn join_into(&self, main: &CudaStream) -> Result<(), DriverError> {
        let joined = self
            .join
            .record(&self.stream)
            .and_then(|()| main.wait(&self.join));
        if joined.is_err() {
            let _ = self.stream.synchronize();
        }
        joined
    }
}

impl Device {
    /// Runs `f` with the device's side stream (made on first use), which no other call uses
    /// meanwhile: the fork and join events of one call cannot interleave with another's.
    pub fn with_side_stream<R>(&self, f: impl FnOnce(&SideStream) -> R) -> Result<R, DriverError> {
        let mut slot = self.side.lock().unwrap_or_else(|p| p.into_inner());
        let side = match slot.take() {
            Some(side) => side,
            None => SideStream::new(&self.ctx)?,
        };
        Ok(f(slot.insert(side)))
    }

    /// PyTorch's current stream of `launch`, borrowed for one call.
    pub fn stream(&self, launch: Launch) -> Arc<cudarc::driver::CudaStream> {
        // SAFETY: `launch.stream` is PyTorch's current stream of this device, alive for the call.
        unsafe {
            self.ctx
                .wrap_borrowed_stream(launch.stream as cudarc::driver::sys::CUstream)
        }
    }
}

type DeviceSlot = Result<Arc<Device>, String>;
static DEVICES: Lazy<Mutex<HashMap<i32, DeviceSlot>>> = Lazy::new(|| Mutex::new(HashMap::new()));

pub fn device(ordinal: i32) -> Result<Arc<Device>, String> {
    let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    devices
        .entry(ordinal)
        .or_insert_with(|| {
            // SAFETY: probe only.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("libcuda.so.1 not found".to_string());
            }
            let ordinal = usize::try_from(ordinal).map_err(|e| e.to_string())?;
            let ctx = CudaContext::new(ordinal).map_err(|e| format!("cuda context: {e}"))?;
            // torchfuse allocates nothing through cudarc: PyTorch orders its own memory.
            // SAFETY: no cudarc allocations exist.
            unsafe { ctx.disable_event_tracking() };
            let (major, minor) = ctx
                .compute_capability()
                .map_err(|e| format!("compute capability: {e}"))?;
            let sm = (major * 10 + minor) as u32;
            let multiprocessors = ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                )
                .map_err(|e| format!("multiprocessor count: {e}"))?;
            Ok(Arc::new(Device {
                ctx,
                sm,
                arch: super::nvrtc::arch_for(sm),
                multiprocessors: u32::try_from(multiprocessors).unwrap_or(1).max(1),
                side: Mutex::new(None),
            }))
        })
        .clone()
}
