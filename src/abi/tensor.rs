//! Tensors crossing the C++ boundary: borrowed `at::Tensor*` seen as tch tensors, and owned
//! results handed back.

use crate::select::{kind_name, StockReason};
use std::ffi::{c_char, c_void};
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

/// dtype name and shape of a tensor, for logs and stats.
pub fn describe(t: Option<&Tensor>) -> (&'static str, Vec<i64>) {
    match t {
        Some(t) => (kind_name(t.f_kind().ok()), t.size()),
        None => ("none", Vec::new()),
    }
}

/// `c10::ScalarType` codes.
pub const SCALAR_UINT8: i16 = 0;
pub const SCALAR_INT: i16 = 3;
pub const SCALAR_LONG: i16 = 4;
pub const SCALAR_HALF: i16 = 5;
pub const SCALAR_FLOAT: i16 = 6;
pub const SCALAR_DOUBLE: i16 = 7;
pub const SCALAR_BFLOAT16: i16 = 15;

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

extern "C" {
    fn torchfuse_cxx_empty_unfilled(
        sizes: *const i64,
        ndim: usize,
        scalar_type: i16,
        device: i8,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
}

/// A new uninitialised tensor from PyTorch's allocator (on its current stream). On a GPU it is
/// never filled: with deterministic algorithms on, aten's `empty` writes every byte of it first
/// (torch.utils.deterministic.fill_uninitialized_memory), and every tensor torchfuse allocates
/// is written whole by its kernels.
pub fn empty(shape: &[i64], kind: Kind, device: Device) -> Result<Tensor, StockReason> {
    let (Device::Cuda(index), Some(scalar_type)) = (device, scalar_type(kind)) else {
        return Tensor::f_empty(shape, (kind, device)).map_err(|_| StockReason::InternalError);
    };
    let index = i8::try_from(index).map_err(|_| StockReason::InvalidInput)?;
    let mut err = [0 as c_char; 256];
    // SAFETY: `shape` is valid for its length; `err` is writable for its length. The result
    // is null or a new `at::Tensor` this function owns.
    let ptr = unsafe {
        torchfuse_cxx_empty_unfilled(
            shape.as_ptr(),
            shape.len(),
            scalar_type,
            index,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if ptr.is_null() {
        // SAFETY: the C++ side wrote a NUL-terminated message (or left the zeroed buffer).
        let message = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        tracing::debug!("allocation failed: {}", message.to_string_lossy());
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
