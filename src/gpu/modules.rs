//! The module store: one loaded CUBIN per (registry variant, dtype, device), its kernels
//! fetched by name. A module that cannot be had (no NVRTC, a compile error, a module that will
//! not load) is reported once and remembered: its variant is unusable for the rest of the
//! process and stock serves its calls.

use super::cache::cubin;
use super::device::Device;
use super::nvrtc::nvrtc_ready;
use crate::select::DType;
use crate::select::StockReason;
use cudarc::driver::{CudaFunction, CudaStream, DriverError};
use once_cell::sync::{Lazy, OnceCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// One `extern "C"` kernel of a loaded module, with what is measured of it once.
pub struct Kernel {
    pub name: &'static str,
    pub function: CudaFunction,
    /// CTAs that fit on one multiprocessor at once, for its block size.
    resident: OnceCell<u32>,
    /// Clusters (compiled with fixed cluster dimensions) that fit on the GPU at once.
    resident_clusters: OnceCell<u32>,
    /// Dynamic shared memory it has been allowed (beyond the default 48 KiB).
    shared_allowed: AtomicU32,
}

impl Kernel {
    /// How many CTAs of `block_threads` threads fit on one SM (at least 1). The first call's
    /// launch shape is the one measured: each kernel launches with one shape per variant.
    pub fn resident_per_sm(&self, block_threads: u32) -> u32 {
        self.resident_per_sm_with(block_threads, 0)
    }

    /// The same with `shared_bytes` of dynamic shared memory a CTA (the same on every call).
    pub fn resident_per_sm_with(&self, block_threads: u32, shared_bytes: u32) -> u32 {
        *self.resident.get_or_init(|| {
            self.function
                .occupancy_max_active_blocks_per_multiprocessor(
                    block_threads,
                    shared_bytes as usize,
                    None,
                )
                .unwrap_or(1)
                .max(1)
        })
    }

    /// How many clusters (compiled with `__cluster_dims__(cluster, 1, 1)`, blocks of
    /// `block_threads` threads with `shared_bytes` of dynamic shared memory, the same on every
    /// call) fit on the GPU at once; an error if none does.
    pub fn resident_clusters(
        &self,
        cluster: u32,
        block_threads: u32,
        shared_bytes: u32,
        stream: &CudaStream,
    ) -> Result<u32, DriverError> {
        self.resident_clusters
            .get_or_try_init(|| {
                let config = cudarc::driver::LaunchConfig {
                    grid_dim: (cluster, 1, 1),
                    block_dim: (block_threads, 1, 1),
                    shared_mem_bytes: shared_bytes,
                };
                let clusters = self.function.occupancy_max_active_clusters(config, stream)?;
                tracing::debug!(
                    "{}: {clusters} clusters of {cluster} x {block_threads}-thread CTAs fit at once",
                    self.name
                );
                match clusters {
                    0 => Err(DriverError(
                        cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE,
                    )),
                    n => Ok(n),
                }
            })
            .copied()
    }

    /// Lets the kernel launch with `bytes` of dynamic shared memory (an error if the GPU has
    /// less per block). Set for any nonzero size: the 48 KiB a CTA gets without opting in
    /// count its static shared memory too.
    pub fn allow_shared_bytes(&self, bytes: u32) -> Result<(), DriverError> {
        if bytes == 0 || self.shared_allowed.load(Ordering::Relaxed) >= bytes {
            return Ok(());
        }
        self.function.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(bytes).unwrap_or(i32::MAX),
        )?;
        self.shared_allowed.fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// The loaded kernels of one module.
pub struct Kernels {
    kernels: Vec<Kernel>,
}

impl Kernels {
    /// The kernel named `name`. Every name an op launches is one it loaded (a missing one
    /// makes the whole module unusable at load), so an unknown name is a bug: stock serves it.
    pub fn get(&self, name: &str) -> Result<&Kernel, StockReason> {
        self.kernels
            .iter()
            .find(|k| k.name == name)
            .ok_or(StockReason::InternalError)
    }
}

/// What identifies a module: the registry variant's index, the dtype, the output's dtype where
/// it is narrower (`TF_Y_DTYPE`), the device ordinal.
pub type ModuleKey = (usize, DType, Option<DType>, i32);

/// What to compile for a module, and the kernels to fetch from it.
pub struct ModuleSpec<'a> {
    /// Names the module in the logs (the variant and dtype).
    pub label: String,
    /// File in `kernels/`.
    pub source: &'a str,
    pub options: Vec<String>,
    pub kernels: &'static [&'static str],
}

static MODULES: Lazy<Mutex<HashMap<ModuleKey, Option<Arc<Kernels>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// The loaded kernels for `key`, built from `spec()` the first time, or None (reported once)
/// if they cannot be had.
pub fn load<'a>(
    key: ModuleKey,
    device: &Device,
    cache_dir: &std::path::Path,
    spec: impl FnOnce() -> ModuleSpec<'a>,
) -> Option<Arc<Kernels>> {
    let mut all = MODULES.lock().unwrap_or_else(|p| p.into_inner());
    all.entry(key)
        .or_insert_with(|| {
            let ordinal = key.3;
            let spec = spec();
            let loaded = cubin(
                &spec.label,
                spec.source,
                &spec.options,
                &device.arch,
                cache_dir,
            )
            .and_then(|bytes| {
                let module = device
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(bytes))
                    .map_err(|e| format!("loading module: {e}"))?;
                spec.kernels
                    .iter()
                    .map(|&name| {
                        let function = module
                            .load_function(name)
                            .map_err(|e| format!("kernel {name}: {e}"))?;
                        Ok(Kernel {
                            name,
                            function,
                            resident: OnceCell::new(),
                            resident_clusters: OnceCell::new(),
                            shared_allowed: AtomicU32::new(0),
                        })
                    })
                    .collect::<Result<Vec<_>, String>>()
            });
            match loaded {
                Ok(kernels) => {
                    tracing::debug!("{} ready on cuda:{ordinal}", spec.label);
                    Some(Arc::new(Kernels { kernels }))
                }
                Err(e) => {
                    if nvrtc_ready().is_ok() {
                        tracing::warn!(
                            "kernel {} unusable on cuda:{ordinal} ({}): {e}; stock serves its calls",
                            spec.label,
                            device.arch
                        );
                    }
                    None
                }
            }
        })
        .clone()
}
