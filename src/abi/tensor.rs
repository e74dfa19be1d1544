//! Tensors crossing the C++ boundary: borrowed `at::Tensor*` seen as tch tensors, and owned
//! results handed back.

use super::types::{
    torchfuse_cxx_empty_unfilled, TfStatus, TfTensor, SCALAR_BFLOAT16, SCALAR_FLOAT, SCALAR_HALF,
    SCALAR_INT, SCALAR_LONG, SCALAR_UINT8,
};
use crate::select::{kind_name, StockReason};
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

impl TfTensor {
    /// The tensor as tch sees it, borrowed; None when absent.
    ///
    /// # Safety
    /// `handle` is null or a defined `at::Tensor` alive for the call (the glue's promise).
    pub unsafe fn borrow(&self) -> Option<Borrowed> {
        borrow(self.handle)
    }
}

/// # Safety
/// `ptr` is null or points to a defined `at::Tensor` that outlives the returned value.
pub unsafe fn borrow(ptr: *const c_void) -> Option<Borrowed> {
    (!ptr.is_null()).then(|| Borrowed(ManuallyDrop::new(Tensor::from_ptr(ptr as *mut _))))
}

/// Hands an owned tensor to C++, which takes it with `take()` in glue/call.cpp.
pub fn into_raw(tensor: Tensor) -> *mut c_void {
    let mut tensor = ManuallyDrop::new(tensor);
    tensor.as_mut_ptr().cast()
}

/// dtype name and shape of a tensor, for logs and stats.
pub fn describe(t: Option<&Tensor>) -> (&'static str, Vec<i64>) {
    match t {
        Some(t) => (kind_name(t.f_kind().ok()), t.size()),
        None => ("none", Vec::new()),
    }
}

/// The `c10::ScalarType` code of the kinds torchfuse allocates.
fn scalar_type(kind: Kind) -> Option<i16> {
    match kind {
        Kind::Uint8 => Some(SCALAR_UINT8),
        Kind::Int => Some(SCALAR_INT),
        Kind::Int64 => Some(SCALAR_LONG),
        Kind::Half => Some(SCALAR_HALF),
        Kind::Float => Some(SCALAR_FLOAT),
        Kind::BFloat16 => Some(SCALAR_BFLOAT16),
        _ => None,
    }
}

/// The kind of a `c10::ScalarType` code, among those torchfuse allocates.
pub fn kind_of_scalar_type(code: i16) -> Option<Kind> {
    [
        Kind::Uint8,
        Kind::Int,
        Kind::Int64,
        Kind::Half,
        Kind::Float,
        Kind::BFloat16,
    ]
    .into_iter()
    .find(|k| scalar_type(*k) == Some(code))
}

/// A new uninitialised tensor from PyTorch's allocator (on its current stream). On a GPU it is
/// never filled: with deterministic algorithms on, aten's `empty` writes every byte of it first
/// (torch.utils.deterministic.fill_uninitialized_memory), and every tensor torchfuse allocates
/// is written whole by its kernels.
pub fn empty(shape: &[i64], kind: Kind, device: Device) -> Result<Tensor, StockReason> {
    let (Device::Cuda(index), Some(scalar_type)) = (device, scalar_type(kind)) else {
        return Tensor::f_empty(shape, (kind, device)).map_err(|_| StockReason::InternalError);
    };
    let index = i16::try_from(index).map_err(|_| StockReason::InvalidInput)?;
    let mut status = TfStatus::new();
    // SAFETY: `shape` is valid for its length; `status` is writable. The result is null or a
    // new `at::Tensor` this function owns.
    let ptr = unsafe {
        torchfuse_cxx_empty_unfilled(shape.as_ptr(), shape.len(), scalar_type, index, &mut status)
    };
    if ptr.is_null() {
        tracing::debug!("allocation failed: {}", status.message());
        return Err(StockReason::InternalError);
    }
    // SAFETY: a new, owned `at::Tensor*`, the pointer type tch's tensors wrap and free.
    Ok(unsafe { Tensor::from_ptr(ptr.cast()) })
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
