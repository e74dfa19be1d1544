//! The boundary with PyTorch: the C++ glue (`glue/*.cpp`, registering the overrides with the
//! dispatcher and calling stock), the Rust entry points it calls, load-time registration, and
//! the tensors that cross (borrowed in, owned out).

pub mod control;
pub mod entries;
pub mod lifecycle;
pub mod tensor;
pub mod types;
