//! NVRTC, loaded from torch's own CUDA 13 wheels: compiles `kernels/*.cu` for the device's
//! exact architecture to CUBIN. Any failure (no NVRTC, a compile error) is an error value.

use cudarc::nvrtc::sys as nvrtc_sys;
use once_cell::sync::OnceCell;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

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
pub fn nvrtc_ready() -> Result<(), String> {
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

/// NVRTC's version; (0, 0) when NVRTC is not loaded (then nothing is compiled either).
pub fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: a probe, then plain out-parameters of a loaded NVRTC.
    unsafe {
        if nvrtc_sys::is_culib_present() {
            let _ = nvrtc_sys::nvrtcVersion(&mut major, &mut minor);
        }
    }
    (major, minor)
}

/// The options every kernel is compiled with, before its op's and variant's defines.
pub fn base_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
    ]
}

/// Compiles `source` to a CUBIN with NVRTC (no disk cache).
pub fn nvrtc_compile(source_name: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let source = super::sources::kernel_source(source_name)
        .ok_or_else(|| format!("no kernel source {source_name}"))?;
    compile_text(source_name, source, options)
}

/// Compiles the text `source` (named `source_name` in NVRTC's messages), with the kernels'
/// headers, to a CUBIN.
pub fn compile_text(
    source_name: &str,
    source: &str,
    options: &[String],
) -> Result<Vec<u8>, String> {
    nvrtc_ready()?;
    let cstr = |s: &str| CString::new(s).map_err(|e| e.to_string());
    let src = cstr(source)?;
    let name = cstr(source_name)?;
    let headers: Vec<(CString, CString)> = super::sources::headers()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_for(90), "sm_90a");
        assert_eq!(arch_for(80), "sm_80");
        assert_eq!(arch_for(89), "sm_89");
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
