//! Tensors crossing the C++ boundary: borrowed `at::Tensor*` seen as tch tensors, and owned
//! results handed back.

use crate::registry::{DType, StockReason};
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use tch::{Device, Kind, Tensor};

/// An `at::Tensor` owned by the caller, viewed as a tch `Tensor` without taking ownership.
pub struct Borrowed(ManuallyDrop<Tensor>);

impl Deref for Borrowed {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.0
    }
}

/// # Safety
/// `ptr` is null or points to a defined `at::Tensor` that outlives the returned value.
pub unsafe fn borrow(ptr: *const c_void) -> Option<Borrowed> {
    (!ptr.is_null()).then(|| Borrowed(ManuallyDrop::new(Tensor::from_ptr(ptr as *mut _))))
}

/// Hands an owned tensor to C++, which takes it with `take()` in shim.cpp.
pub fn into_raw(tensor: Tensor) -> *mut c_void {
    let mut tensor = ManuallyDrop::new(tensor);
    tensor.as_mut_ptr().cast()
}

pub fn dtype_of(kind: Kind) -> Option<DType> {
    match kind {
        Kind::Float => Some(DType::F32),
        Kind::BFloat16 => Some(DType::BF16),
        Kind::Half => Some(DType::F16),
        _ => None,
    }
}

pub fn kind_name(kind: Option<Kind>) -> &'static str {
    match kind {
        Some(k) => match dtype_of(k) {
            Some(d) => d.name(),
            None => match k {
                Kind::Double => "f64",
                Kind::Int64 => "i64",
                Kind::Int => "i32",
                Kind::Uint8 => "u8",
                Kind::Bool => "bool",
                _ => "other",
            },
        },
        None => "none",
    }
}

/// dtype name and shape of a tensor, for logs and stats.
pub fn describe(t: Option<&Tensor>) -> (&'static str, Vec<i64>) {
    match t {
        Some(t) => (kind_name(t.f_kind().ok()), t.size()),
        None => ("none", Vec::new()),
    }
}

/// A new uninitialised tensor from PyTorch's allocator (on its current stream).
pub fn empty(shape: &[i64], kind: Kind, device: Device) -> Result<Tensor, StockReason> {
    Tensor::f_empty(shape, (kind, device)).map_err(|_| StockReason::InternalError)
}

/// Every tensor's data 16-byte aligned (a kernel's 16-byte accesses are legal).
pub fn aligned16<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> bool {
    tensors
        .into_iter()
        .all(|t| (t.data_ptr() as usize).is_multiple_of(16))
}

/// The tensor's data address, as a kernel argument.
pub fn device_addr(t: &Tensor) -> u64 {
    t.data_ptr() as u64
}
