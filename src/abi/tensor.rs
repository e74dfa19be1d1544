//! Tensors crossing the C++ boundary: borrowed `at::Tensor*` seen as tch tensors, and owned
//! results handed back.

use super::types::{
    torchfuse_cxx_empty_unfilled, TfStatus, TfTensor, SCALAR_BFLOAT16, SCALAR_BOOL, SCALAR_DOUBLE,
    SCALAR_FLOAT, SCALAR_HALF, SCALAR_INT, SCALAR_INT16, SCALAR_INT8, SCALAR_LONG, SCALAR_UINT8,
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

/// What Rust reads of a tensor: the facts the glue wrote once (`torchfuse_abi.h`), no call
/// back into libtorch. An absent tensor has no sizes, no kind and no device.
impl TfTensor {
    /// The tensor, if present (an optional argument given).
    pub fn given(&self) -> Option<&TfTensor> {
        self.present().then_some(self)
    }

    /// Its sizes; empty when absent or not strided (a tensor with symbolic sizes, a nested
    /// or sparse one).
    pub fn sizes(&self) -> &[i64] {
        // SAFETY: the glue's promise: with `strided`, `sizes` points to `ndim` sizes that live
        // as long as the call, and so as long as the call's struct that holds `self`.
        unsafe { facts_slice(self.strided, self.sizes, self.ndim) }
    }

    /// Its strides in elements, as `sizes`.
    pub fn strides(&self) -> &[i64] {
        // SAFETY: as `sizes`.
        unsafe { facts_slice(self.strided, self.strides, self.ndim) }
    }

    pub fn numel(&self) -> i64 {
        self.numel
    }

    /// Its dtype; None when absent or a dtype torchfuse never reads.
    pub fn kind(&self) -> Option<Kind> {
        if !self.present() {
            return None;
        }
        KINDS
            .iter()
            .find(|(code, ..)| *code == self.dtype)
            .map(|(_, kind, _)| *kind)
    }

    /// Its dtype's name for logs and stats.
    pub fn kind_name(&self) -> &'static str {
        match self.kind() {
            None if self.present() => "other",
            kind => kind_name(kind),
        }
    }

    /// The CUDA device it is on, or `Device::Cpu` for any other (or none).
    pub fn device(&self) -> Device {
        match usize::try_from(self.device) {
            Ok(index) if self.present() => Device::Cuda(index),
            _ => Device::Cpu,
        }
    }

    /// PyTorch's `is_contiguous()`: strided, and each dim of more than one element steps over
    /// all the dims after it (an empty tensor is contiguous).
    pub fn is_contiguous(&self) -> bool {
        if self.strided == 0 {
            return false;
        }
        if self.numel == 0 {
            return true;
        }
        let mut expected = 1;
        for (&size, &stride) in self.sizes().iter().zip(self.strides()).rev() {
            if size != 1 {
                if stride != expected {
                    return false;
                }
                expected *= size;
            }
        }
        true
    }

    /// Its data's address on the GPU (0 for a tensor not on a CUDA device), as a kernel
    /// argument.
    pub fn addr(&self) -> u64 {
        self.data as u64
    }

    /// Its elements in row-major order for a kernel: the tensor itself where it is contiguous,
    /// else a contiguous copy made now (PyTorch's `contiguous()`). A tensor whose data the glue
    /// did not read (not on a CUDA device, a compiler's fake tensor) goes to stock.
    pub fn contiguous(&self) -> Result<Contiguous<'_>, StockReason> {
        if self.data.is_null() {
            return Err(StockReason::InvalidInput);
        }
        if self.is_contiguous() {
            return Ok(Contiguous::Same(self));
        }
        // SAFETY: the handle is null or the call's borrowed at::Tensor (the glue's promise).
        let t = unsafe { self.borrow() }.ok_or(StockReason::InvalidInput)?;
        t.f_contiguous()
            .map(Contiguous::Copy)
            .map_err(|_| StockReason::InvalidInput)
    }
}

/// (`c10::ScalarType` code, kind, whether torchfuse allocates it) of every dtype torchfuse
/// reads: the one table of the codes Rust uses.
const KINDS: [(i16, Kind, bool); 10] = [
    (SCALAR_UINT8, Kind::Uint8, true),
    (SCALAR_INT8, Kind::Int8, false),
    (SCALAR_INT16, Kind::Int16, false),
    (SCALAR_INT, Kind::Int, true),
    (SCALAR_LONG, Kind::Int64, true),
    (SCALAR_HALF, Kind::Half, true),
    (SCALAR_FLOAT, Kind::Float, true),
    (SCALAR_DOUBLE, Kind::Double, false),
    (SCALAR_BOOL, Kind::Bool, false),
    (SCALAR_BFLOAT16, Kind::BFloat16, true),
];

/// # Safety
/// With `strided` nonzero, `ptr` points to `len` values that outlive the returned slice.
unsafe fn facts_slice<'a>(strided: u8, ptr: *const i64, len: i64) -> &'a [i64] {
    match usize::try_from(len) {
        Ok(len) if strided != 0 && !ptr.is_null() && len > 0 => {
            std::slice::from_raw_parts(ptr, len)
        }
        _ => &[],
    }
}

/// A tensor's elements in row-major order: the call's tensor itself, or a copy that lives as
/// long as this value (and so until the kernel that reads it is queued; PyTorch's allocator
/// orders the reuse of its memory on the stream).
pub enum Contiguous<'a> {
    Same(&'a TfTensor),
    Copy(Tensor),
}

impl Contiguous<'_> {
    pub fn addr(&self) -> u64 {
        match self {
            Contiguous::Same(t) => t.addr(),
            Contiguous::Copy(t) => device_addr(t),
        }
    }
}

impl TfTensor {
    /// The tensor as tch sees it, borrowed; None when absent. Only to make new tensors from it:
    /// what Rust reads of it is in the facts above.
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
pub fn describe(t: &TfTensor) -> (&'static str, Vec<i64>) {
    (t.kind_name(), t.sizes().to_vec())
}

/// The `c10::ScalarType` code of the kinds torchfuse allocates.
fn scalar_type(kind: Kind) -> Option<i16> {
    KINDS
        .iter()
        .find(|(_, k, allocated)| *allocated && *k == kind)
        .map(|(code, ..)| *code)
}

/// The kind of a `c10::ScalarType` code, among those torchfuse allocates.
pub fn kind_of_scalar_type(code: i16) -> Option<Kind> {
    KINDS
        .iter()
        .find(|(c, _, allocated)| *allocated && *c == code)
        .map(|(_, kind, _)| *kind)
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

/// Every address 16-byte aligned (a kernel's 16-byte accesses are legal).
pub fn aligned16(addrs: impl IntoIterator<Item = u64>) -> bool {
    addrs.into_iter().all(|a| a.is_multiple_of(16))
}

/// A tensor's data address, as a kernel argument (the tensors torchfuse allocates).
pub fn device_addr(t: &Tensor) -> u64 {
    t.data_ptr() as u64
}

/// The glue's description of `t`, as an override makes it (for tests: the description
/// borrows `t`, which must outlive it).
#[cfg(test)]
pub fn described(t: &Tensor) -> TfTensor {
    let mut out = TfTensor::ABSENT;
    // SAFETY: `t` is a defined at::Tensor (tch's pointer type); `out` is writable.
    unsafe { super::types::torchfuse_cxx_describe(t.as_ptr().cast(), &mut out) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_glue_describes_a_tensor_as_libtorch_sees_it() {
        let base = Tensor::arange(4 * 6 * 8, (Kind::Float, Device::Cpu)).view([4, 6, 8]);
        let views = [
            base.shallow_clone(),
            base.transpose(0, 2),
            base.narrow(2, 1, 4),
            base.unsqueeze(1),
            base.unsqueeze(-1),
            base.unsqueeze(0).expand([3, 4, 6, 8], false),
            base.select(1, 2),
            base.slice(1, 0, 6, 2),
            // A dim of one element whose stride is anything: still contiguous.
            base.f_as_strided([4, 1, 8], [48, 1000, 1], 0).unwrap(),
            base.f_as_strided([2, 3], [1, 2], 0).unwrap(),
            Tensor::zeros([0, 5], (Kind::Float, Device::Cpu)),
            Tensor::zeros([5, 0, 3], (Kind::Float, Device::Cpu)).transpose(0, 2),
            Tensor::from(3.0f32),
        ];
        for v in &views {
            let f = described(v);
            assert!(f.present());
            assert_eq!(f.sizes(), v.size(), "{v:?}");
            assert_eq!(f.strides(), v.stride(), "{v:?}");
            assert_eq!(f.numel(), v.numel() as i64);
            assert_eq!(
                f.is_contiguous(),
                v.is_contiguous(),
                "{:?} {:?}",
                v.size(),
                v.stride()
            );
            assert_eq!(f.kind(), Some(Kind::Float));
            assert_eq!(f.device(), Device::Cpu);
            // A CPU tensor's data is never handed to a kernel.
            assert_eq!(f.addr(), 0);
            assert!(f.contiguous().is_err());
        }
    }

    #[test]
    fn every_dtype_torchfuse_reads_has_its_kind_and_others_none() {
        for (_, kind, _) in KINDS {
            let f = described(&Tensor::zeros([2], (kind, Device::Cpu)));
            assert_eq!(f.kind(), Some(kind));
        }
        let complex = described(&Tensor::zeros([2], (Kind::ComplexFloat, Device::Cpu)));
        assert_eq!((complex.kind(), complex.kind_name()), (None, "other"));
        let absent = TfTensor::ABSENT;
        assert!(absent.given().is_none());
        assert_eq!((absent.kind(), absent.kind_name()), (None, "none"));
        assert_eq!((absent.sizes(), absent.strides()), (&[][..], &[][..]));
        assert!(!absent.is_contiguous());
    }
}
