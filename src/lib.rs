//! torchfuse: fused CUDA kernels swapped in for PyTorch's own at the dispatcher.
//!
//! Loaded into a PyTorch process (by `libtorchfuse_preload.so` or `torch.ops.load_library`),
//! it registers overrides for the enabled aten ops at the CUDA key. A call's path, and the
//! layers, each depending only on those after it:
//!
//! - `abi`: the C++ glue and the Rust entry points (the boundary with PyTorch);
//! - `ops`: one module per op family: checks the call, plans and launches its kernels;
//! - `gpu`: NVRTC, the CUBIN cache, devices and streams, the module store;
//! - `runtime`: config, logging, stats, toggles;
//! - `select`: the registry data (`registry/*.toml`), dtypes, stock reasons.
//!
//! A call the registry has no variant for, or that fails anywhere, runs PyTorch's own kernel
//! with a logged reason.

pub mod abi;
pub mod gpu;
pub mod ops;
pub mod runtime;
pub mod select;
