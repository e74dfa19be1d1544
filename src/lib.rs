//! torchfuse: fused CUDA kernels swapped in for PyTorch's own at the dispatcher.
//!
//! Loaded into a PyTorch process (by `libtorchfuse_preload.so` or
//! `torch.ops.load_library`), it registers overrides for the enabled aten ops at the CUDA
//! key (src/glue/shim.cpp). Each call is validated and matched against the registry
//! (`registry/*.toml`); a matching kernel from `kernels/` is compiled by NVRTC and launched on
//! PyTorch's current stream, anything else runs PyTorch's own kernel with a logged reason.

pub mod adam;
pub mod attention;
pub mod config;
pub mod embedding;
pub mod ffi;
pub mod jit;
pub mod logging;
pub mod norm;
pub mod ops;
pub mod registry;
pub mod sources;
pub mod stats;
pub mod tensor;
