//! Kernel runtime: NVRTC (from torch's own CUDA wheels) compiles `kernels/*.cu` for the
//! device's exact architecture to CUBIN, a disk cache keeps the result across processes, and
//! modules are loaded per device in the primary context that PyTorch uses.
//!
//! Any failure here (no NVRTC, a compile error, a module that will not load) is reported once
//! and remembered: the variant is unusable for the rest of the process and stock serves it.

use crate::registry::{DType, KernelOp, Request, StockReason, Variant, REGISTRY};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
use cudarc::nvrtc::sys as nvrtc_sys;
use once_cell::sync::{Lazy, OnceCell};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The directory holding `torch/` (site-packages), found from the loaded libtorch.
pub fn torch_site_packages() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| {
            Path::new(p)
                .parent()?
                .parent()?
                .parent()
                .map(Path::to_path_buf)
        })
}

/// torch's CUDA 13 wheels put NVRTC and the CUDA headers here.
fn nvidia_root() -> Option<PathBuf> {
    torch_site_packages().map(|s| s.join("nvidia").join("cu13"))
}

/// Loads torch's NVRTC by absolute path (builtins first, which NVRTC dlopens by bare name),
/// so cudarc's later bare-name open finds it already in the process.
fn nvrtc_ready() -> Result<(), String> {
    static READY: OnceCell<Result<(), String>> = OnceCell::new();
    READY
        .get_or_init(|| {
            let mut opened = Vec::new();
            if let Some(lib) = nvidia_root().map(|r| r.join("lib")) {
                for name in ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"] {
                    let path = lib.join(name);
                    if path.exists() {
                        // SAFETY: NVRTC's initialisers have no preconditions.
                        match unsafe { libloading::Library::new(&path) } {
                            Ok(l) => opened.push(l),
                            Err(e) => tracing::debug!("cannot open {path:?}: {e}"),
                        }
                    }
                }
            }
            // Kept open for the life of the process.
            std::mem::forget(opened);
            // SAFETY: only probes for the library; cudarc panics later if it is missing.
            if unsafe { nvrtc_sys::is_culib_present() } {
                Ok(())
            } else {
                let msg = "NVRTC (libnvrtc.so.13) not found next to torch or on the library path; \
                           torchfuse cannot compile kernels, stock PyTorch kernels serve every call";
                tracing::warn!("{msg}");
                Err(msg.to_string())
            }
        })
        .clone()
}

/// `sm_90a` for Hopper (its arch-specific features), `sm_XY` otherwise.
pub fn arch_for(sm: u32) -> String {
    if sm == 90 {
        "sm_90a".to_string()
    } else {
        format!("sm_{sm}")
    }
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; only called once NVRTC is loaded.
    unsafe {
        let _ = nvrtc_sys::nvrtcVersion(&mut major, &mut minor);
    }
    (major, minor)
}

/// Everything that determines a CUBIN: source, headers, options, architecture, NVRTC.
pub fn cache_key(source: &str, options: &[String], arch: &str) -> u64 {
    let (major, minor) = nvrtc_version();
    let mut parts: Vec<&[u8]> = vec![source.as_bytes(), arch.as_bytes()];
    let version = format!(
        "nvrtc {major}.{minor} torchfuse {}",
        env!("CARGO_PKG_VERSION")
    );
    parts.push(version.as_bytes());
    let headers: Vec<(&str, &str)> = crate::sources::headers().collect();
    for (name, text) in &headers {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    for o in options {
        parts.push(o.as_bytes());
    }
    fnv1a(&parts)
}

const CACHE_MAGIC: &[u8; 8] = b"TFCUBIN\x01";
const CACHE_HEADER: usize = 32;

/// A cached CUBIN, or None if the file is missing, truncated, foreign or corrupt.
pub fn read_cached(path: &Path, key: u64) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.len() < CACHE_HEADER || &bytes[..8] != CACHE_MAGIC {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
    let payload = &bytes[CACHE_HEADER..];
    (word(8) == key && word(16) == payload.len() as u64 && word(24) == fnv1a(&[payload]))
        .then(|| payload.to_vec())
}

/// Writes atomically (temp file + rename), so a reader never sees a partial file.
pub fn write_cached(path: &Path, key: u64, payload: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut bytes = Vec::with_capacity(CACHE_HEADER + payload.len());
    bytes.extend_from_slice(CACHE_MAGIC);
    bytes.extend_from_slice(&key.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a(&[payload]).to_le_bytes());
    bytes.extend_from_slice(payload);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = path.with_extension(format!("tmp.{}.{nanos}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// NVRTC options for one variant of `op` at `dtype`.
pub fn compile_options(
    op: KernelOp,
    params: &BTreeMap<String, i64>,
    dtype: DType,
    arch: &str,
) -> Vec<String> {
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        format!("-DTF_DTYPE={}", dtype.kernel_code()),
    ];
    options.extend(op.defines().iter().map(|d| d.to_string()));
    options.extend(params.iter().map(|(k, v)| format!("-DTF_{k}={v}")));
    options
}

/// Compiles `source` to a CUBIN with NVRTC (no disk cache).
pub fn nvrtc_compile(source_name: &str, options: &[String]) -> Result<Vec<u8>, String> {
    nvrtc_ready()?;
    let source = crate::sources::kernel_source(source_name)
        .ok_or_else(|| format!("no kernel source {source_name}"))?;
    let cstr = |s: &str| CString::new(s).map_err(|e| e.to_string());
    let src = cstr(source)?;
    let name = cstr(source_name)?;
    let headers: Vec<(CString, CString)> = crate::sources::headers()
        .map(|(n, t)| Ok((cstr(n)?, cstr(t)?)))
        .collect::<Result<_, String>>()?;
    let header_texts: Vec<*const c_char> = headers.iter().map(|(_, t)| t.as_ptr()).collect();
    let header_names: Vec<*const c_char> = headers.iter().map(|(n, _)| n.as_ptr()).collect();
    let opts: Vec<CString> = options.iter().map(|o| cstr(o)).collect::<Result<_, _>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    // SAFETY: every pointer outlives the program; the program is destroyed on every path.
    unsafe {
        let mut prog = std::ptr::null_mut();
        nvrtc_sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            header_texts.as_ptr(),
            header_names.as_ptr(),
        )
        .result()
        .map_err(|e| format!("nvrtcCreateProgram: {e}"))?;
        let compiled =
            nvrtc_sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let result = if compiled == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            let mut size = 0usize;
            let mut cubin = Vec::new();
            nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .and_then(|_| {
                    cubin.resize(size, 0u8);
                    nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result()
                })
                .map(|_| cubin)
                .map_err(|e| format!("nvrtcGetCUBIN: {e}"))
        } else {
            let log = cudarc::nvrtc::result::get_program_log(prog)
                .map(|l| {
                    let bytes: Vec<u8> = l
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            Err(format!("{source_name} {options:?}: {compiled:?}\n{log}"))
        };
        let _ = nvrtc_sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// A CUBIN for `variant` at `dtype` and `arch`, from the disk cache or freshly compiled.
pub fn cubin(
    variant: &Variant,
    dtype: DType,
    arch: &str,
    cache_dir: &Path,
) -> Result<Vec<u8>, String> {
    nvrtc_ready()?;
    let source = crate::sources::kernel_source(&variant.source)
        .ok_or_else(|| format!("no kernel source {}", variant.source))?;
    let options = compile_options(variant.op, &variant.params, dtype, arch);
    let key = cache_key(source, &options, arch);
    let path = cache_dir.join(format!("{key:016x}-{arch}.cubin"));
    if let Some(bytes) = read_cached(&path, key) {
        tracing::debug!(
            "{} {} {arch}: cubin from cache {path:?}",
            variant.name,
            dtype.name()
        );
        return Ok(bytes);
    }
    let started = std::time::Instant::now();
    let bytes = nvrtc_compile(&variant.source, &options)?;
    tracing::debug!(
        "{} {} {arch}: compiled in {:.0} ms",
        variant.name,
        dtype.name(),
        started.elapsed().as_secs_f64() * 1e3
    );
    if let Err(e) = write_cached(&path, key, &bytes) {
        tracing::debug!("cannot write kernel cache {path:?}: {e}");
    }
    Ok(bytes)
}

/// Where a call runs: PyTorch's device index and current stream (`TfLaunch` in shim.cpp).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Launch {
    pub device: i32,
    pub stream: *mut std::ffi::c_void,
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
                arch: arch_for(sm),
                multiprocessors: u32::try_from(multiprocessors).unwrap_or(1).max(1),
                side: Mutex::new(None),
            }))
        })
        .clone()
}

/// The loaded kernels of one variant at one dtype on one device, in `KernelOp::entries` order.
pub struct Kernels {
    pub functions: Vec<CudaFunction>,
    /// CTAs of each function that fit on one multiprocessor at once, for its block size.
    resident: Vec<OnceCell<u32>>,
    /// Clusters of each function (compiled with fixed cluster dimensions) that fit on the GPU
    /// at once.
    resident_clusters: Vec<OnceCell<u32>>,
    /// Dynamic shared memory each function has been allowed (beyond the default 48 KiB).
    shared_allowed: Vec<std::sync::atomic::AtomicU32>,
}

impl Kernels {
    /// How many CTAs of `block_threads` threads of function `i` fit on one SM (at least 1).
    pub fn resident_per_sm(&self, i: usize, block_threads: u32) -> u32 {
        self.resident_per_sm_with(i, block_threads, 0)
    }

    /// The same with `shared_bytes` of dynamic shared memory a CTA (the same on every call).
    pub fn resident_per_sm_with(&self, i: usize, block_threads: u32, shared_bytes: u32) -> u32 {
        *self.resident[i].get_or_init(|| {
            self.functions[i]
                .occupancy_max_active_blocks_per_multiprocessor(
                    block_threads,
                    shared_bytes as usize,
                    None,
                )
                .unwrap_or(1)
                .max(1)
        })
    }

    /// How many clusters of function `i` (compiled with `__cluster_dims__(cluster, 1, 1)`,
    /// blocks of `block_threads` threads with `shared_bytes` of dynamic shared memory, the
    /// same on every call) fit on the GPU at once; an error if none does.
    pub fn resident_clusters(
        &self,
        i: usize,
        cluster: u32,
        block_threads: u32,
        shared_bytes: u32,
        stream: &CudaStream,
    ) -> Result<u32, DriverError> {
        self.resident_clusters[i]
            .get_or_try_init(|| {
                let config = cudarc::driver::LaunchConfig {
                    grid_dim: (cluster, 1, 1),
                    block_dim: (block_threads, 1, 1),
                    shared_mem_bytes: shared_bytes,
                };
                let clusters = self.functions[i].occupancy_max_active_clusters(config, stream)?;
                tracing::debug!(
                    "{clusters} clusters of {cluster} x {block_threads}-thread CTAs fit at once"
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

    /// Lets function `i` launch with `bytes` of dynamic shared memory (an error if the GPU
    /// has less per block). Set for any nonzero size: the 48 KiB a CTA gets without opting in
    /// count its static shared memory too.
    pub fn allow_shared_bytes(
        &self,
        i: usize,
        bytes: u32,
    ) -> Result<(), cudarc::driver::DriverError> {
        use std::sync::atomic::Ordering;
        if bytes == 0 || self.shared_allowed[i].load(Ordering::Relaxed) >= bytes {
            return Ok(());
        }
        self.functions[i].set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(bytes).unwrap_or(i32::MAX),
        )?;
        self.shared_allowed[i].fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }
}

type KernelsKey = (usize, DType, i32);
static KERNELS: Lazy<Mutex<HashMap<KernelsKey, Option<Arc<Kernels>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// The loaded kernels for registry variant `index`, or None (reported once) if they cannot be
/// had.
pub fn kernels(
    index: usize,
    variant: &Variant,
    dtype: DType,
    ordinal: i32,
    device: &Device,
) -> Option<Arc<Kernels>> {
    let mut all = KERNELS.lock().unwrap_or_else(|p| p.into_inner());
    all.entry((index, dtype, ordinal))
        .or_insert_with(|| {
            let loaded = cubin(variant, dtype, &device.arch, &crate::ffi::config().cache_dir)
                .and_then(|bytes| {
                    let module = device
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(bytes))
                        .map_err(|e| format!("loading module: {e}"))?;
                    variant
                        .op
                        .entries()
                        .iter()
                        .map(|entry| {
                            module
                                .load_function(entry)
                                .map_err(|e| format!("kernel {entry}: {e}"))
                        })
                        .collect::<Result<Vec<_>, String>>()
                });
            match loaded {
                Ok(functions) => {
                    tracing::debug!("{} {} ready on cuda:{ordinal}", variant.name, dtype.name());
                    let resident = functions.iter().map(|_| OnceCell::new()).collect();
                    let resident_clusters = functions.iter().map(|_| OnceCell::new()).collect();
                    let shared_allowed = functions
                        .iter()
                        .map(|_| std::sync::atomic::AtomicU32::new(0))
                        .collect();
                    Some(Arc::new(Kernels {
                        functions,
                        resident,
                        resident_clusters,
                        shared_allowed,
                    }))
                }
                Err(e) => {
                    if nvrtc_ready().is_ok() {
                        tracing::warn!(
                            "kernel {} ({}) unusable on cuda:{ordinal} ({}): {e}; stock serves its calls",
                            variant.name,
                            dtype.name(),
                            device.arch
                        );
                    }
                    None
                }
            }
        })
        .clone()
}

/// What serves a call: the launch's GPU, the registry's variant and its loaded kernels.
pub struct Selected {
    pub gpu: Arc<Device>,
    pub variant: &'static Variant,
    pub kernels: Arc<Kernels>,
}

/// The registry's variant for `request(sm)` on `launch`'s GPU with its kernels loaded, or why
/// stock serves the call.
pub fn select(
    launch: Launch,
    request: impl FnOnce(u32) -> Request,
) -> Result<Selected, StockReason> {
    let gpu = device(launch.device).map_err(|e| {
        tracing::debug!("cuda:{} unavailable to torchfuse: {e}", launch.device);
        StockReason::KernelUnavailable
    })?;
    let registry = REGISTRY
        .as_ref()
        .map_err(|_| StockReason::KernelUnavailable)?;
    let req = request(gpu.sm);
    let index = registry.select(&req)?;
    let variant = registry.variant(index);
    let kernels = kernels(index, variant, req.dtype, launch.device, &gpu)
        .ok_or(StockReason::KernelUnavailable)?;
    Ok(Selected {
        gpu,
        variant,
        kernels,
    })
}

/// A failed launch of `variant`'s kernel: warned once, and stock serves the call.
pub fn launch_failed(variant: &Variant, e: cudarc::driver::DriverError) -> StockReason {
    crate::ffi::warn_once_launch_failure(&variant.name, &e.to_string());
    StockReason::LaunchFailed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_round_trip_and_rejections() {
        let dir = std::env::temp_dir().join(format!("torchfuse-cache-test-{}", std::process::id()));
        let path = dir.join("k.cubin");
        let payload = b"not really a cubin, but bytes".to_vec();
        write_cached(&path, 42, &payload).unwrap();
        assert_eq!(read_cached(&path, 42), Some(payload.clone()));
        // Another key's file is foreign.
        assert_eq!(read_cached(&path, 43), None);
        // Truncated.
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 3]).unwrap();
        assert_eq!(read_cached(&path, 42), None);
        // Same length, one byte flipped.
        let mut flipped = full.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert_eq!(read_cached(&path, 42), None);
        // Not ours at all.
        std::fs::write(&path, b"\x7fELF").unwrap();
        assert_eq!(read_cached(&path, 42), None);
        // A rewrite replaces it.
        write_cached(&path, 42, &payload).unwrap();
        assert_eq!(read_cached(&path, 42), Some(payload));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cache_key_depends_on_every_input() {
        let o = |s: &str| vec![s.to_string()];
        let base = cache_key("src", &o("-DA=1"), "sm_90a");
        assert_eq!(base, cache_key("src", &o("-DA=1"), "sm_90a"));
        assert_ne!(base, cache_key("src2", &o("-DA=1"), "sm_90a"));
        assert_ne!(base, cache_key("src", &o("-DA=2"), "sm_90a"));
        assert_ne!(base, cache_key("src", &o("-DA=1"), "sm_80"));
    }

    #[test]
    fn arch_names() {
        assert_eq!(arch_for(90), "sm_90a");
        assert_eq!(arch_for(80), "sm_80");
        assert_eq!(arch_for(89), "sm_89");
    }
}

#[cfg(test)]
mod nvrtc_tests {
    use super::*;

    /// Every registry variant compiles, for every dtype it claims, for sm_80 and sm_90a where
    /// its SM range includes them (a warpgroup-MMA variant is sm_90a only).
    /// Needs torch's NVRTC (the test binary links libtorch, so it is found next to it).
    #[test]
    fn every_variant_compiles_for_sm80_and_sm90a() {
        // Make sure libtorch is mapped (it is linked, but the linker may defer it).
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        if let Err(e) = nvrtc_ready() {
            panic!("NVRTC unavailable: {e}");
        }
        let registry = REGISTRY.as_ref().expect("registry");
        let jobs: Vec<(&Variant, DType, &str)> = registry
            .variants()
            .iter()
            .flat_map(|v| v.dtypes.iter().map(move |&d| (v, d)))
            .flat_map(|(v, d)| {
                [(80, "sm_80"), (90, "sm_90a")]
                    .into_iter()
                    .filter(|(sm, _)| (v.sm[0]..=v.sm[1]).contains(sm))
                    .map(move |(_, arch)| (v, d, arch))
            })
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let compiled: usize = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = 0;
                        while let Some(&(variant, dtype, arch)) =
                            jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                        {
                            let options = compile_options(variant.op, &variant.params, dtype, arch);
                            let cubin =
                                nvrtc_compile(&variant.source, &options).unwrap_or_else(|e| {
                                    panic!("{} {} {arch}: {e}", variant.name, dtype.name())
                                });
                            assert_eq!(&cubin[..4], b"\x7fELF", "{} is not a CUBIN", variant.name);
                            for entry in variant.op.entries() {
                                assert!(
                                    cubin.windows(entry.len()).any(|w| w == entry.as_bytes()),
                                    "{} {arch}: no kernel {entry}",
                                    variant.name
                                );
                            }
                            done += 1;
                        }
                        done
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("worker")).sum()
        });
        assert_eq!(compiled, jobs.len());
        assert!(compiled >= registry.variants().len());
        // Both architectures are covered.
        for arch in ["sm_80", "sm_90a"] {
            assert!(
                jobs.iter().any(|j| j.2 == arch),
                "nothing compiled for {arch}"
            );
        }
    }

    #[test]
    fn a_compile_error_is_an_error_not_a_panic() {
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        let options = vec![
            "--gpu-architecture=sm_90a".to_string(),
            "-DTF_DTYPE=7".to_string(),
        ];
        let err = nvrtc_compile("norm.cu", &options).unwrap_err();
        assert!(err.contains("TF_DTYPE must be"), "{err}");
    }
}
