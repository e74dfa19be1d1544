//! `libtorchfuse_preload.so`: what users put in `LD_PRELOAD`.
//!
//! It has no libtorch dependency, so processes that never load torch (`/bin/true`, the
//! compilers torch.compile spawns) pay only for mapping it. It exports `dlopen`: every call
//! first checks whether libtorch is in the process and, the first time it is, loads
//! `libtorchfuse.so` from this library's own directory; then it forwards to libc's `dlopen`
//! with a tail jump. The jump matters: glibc resolves a bare library name against the RPATH
//! of the object that called `dlopen` (found from the return address), and torch's lazy
//! loads of NVRTC and cuDNN rely on their own `$ORIGIN` RPATH. An ordinary call would make
//! this library the caller and break them.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// libc's `dlopen`, resolved on first use.
static REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);

const IDLE: u8 = 0;
const LOADING: u8 = 1;
const DONE: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(IDLE);

type DlopenFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_void;

const MAIN_LIBRARY: &str = "libtorchfuse.so";

fn real_dlopen() -> Option<DlopenFn> {
    let mut addr = REAL_DLOPEN.load(Ordering::Acquire);
    if addr == 0 {
        // SAFETY: dlsym with a static, NUL-terminated name.
        addr = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlopen".as_ptr()) } as usize;
        REAL_DLOPEN.store(addr, Ordering::Release);
    }
    // SAFETY: a non-null result of dlsym("dlopen") is libc's dlopen.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, DlopenFn>(addr) })
}

/// This library's own path, from the address of one of its functions.
fn own_directory() -> Option<std::path::PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let found = unsafe { libc::dladdr(before_dlopen as *const c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    std::path::Path::new(&path)
        .parent()
        .map(|p| p.to_path_buf())
}

fn torch_is_loaded(dlopen: DlopenFn) -> bool {
    // SAFETY: RTLD_NOLOAD only looks the name up among loaded objects.
    let handle = unsafe {
        dlopen(
            c"libtorch_cpu.so".as_ptr(),
            libc::RTLD_NOLOAD | libc::RTLD_LAZY,
        )
    };
    if handle.is_null() {
        return false;
    }
    // SAFETY: balances the reference NOLOAD took.
    unsafe { libc::dlclose(handle) };
    true
}

fn load_main_library() {
    let Some(dir) = own_directory() else {
        eprintln!(
            "torchfuse: cannot find the preload library's directory; running without torchfuse"
        );
        return;
    };
    let path = dir.join(MAIN_LIBRARY);
    // SAFETY: libtorchfuse.so's initialiser registers with the already-loaded libtorch.
    match unsafe { libloading::Library::new(&path) } {
        // Never unloaded: the dispatcher holds pointers into it.
        Ok(lib) => std::mem::forget(lib),
        Err(e) => eprintln!(
            "torchfuse: cannot load {}: {e}; running without torchfuse",
            path.display()
        ),
    }
}

/// Runs before every forwarded `dlopen`: resolves libc's `dlopen` (which the jump reads) and
/// loads torchfuse once torch is present.
extern "C" fn before_dlopen() {
    let _ = std::panic::catch_unwind(|| {
        let Some(dlopen) = real_dlopen() else { return };
        if STATE.load(Ordering::Acquire) != IDLE || !torch_is_loaded(dlopen) {
            return;
        }
        // Loading the main library calls dlopen again (through here): LOADING makes that a
        // plain forward.
        if STATE
            .compare_exchange(IDLE, LOADING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            load_main_library();
            STATE.store(DONE, Ordering::Release);
        }
    });
}

/// The exported `dlopen`: save the arguments, run the check, restore them, then jump (not
/// call) to libc's `dlopen` so the caller's return address, and with it the caller's RPATH,
/// is what libc sees.
///
/// # Safety
/// Same contract as libc's `dlopen`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlopen(_filename: *const c_char, _flags: c_int) -> *mut c_void {
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {check}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp qword ptr [rip + {real}]",
        check = sym before_dlopen,
        real = sym REAL_DLOPEN,
    )
}

#[cfg(not(target_arch = "x86_64"))]
compile_error!("libtorchfuse_preload's dlopen trampoline is written for x86-64");
