//! The Rust side of `torchfuse_abi.h`: every struct and code that crosses between the C++ glue
//! and Rust, `#[repr(C)]` in the header's order. The test below compares every size, offset
//! and code with what the C++ compiler made of the header (`torchfuse_cxx_abi_layout`).

use std::ffi::{c_char, c_void};

/// `TF_STOCK`: PyTorch's own kernel must run the call, unchanged.
pub const TF_STOCK: i32 = 0;
/// `TF_FUSED`: done (a served call's outputs are in `TfOutputs`; a C++ call succeeded).
pub const TF_FUSED: i32 = 1;
/// `TF_ERROR`: bad input refused (or a C++ exception); the message says why.
pub const TF_ERROR: i32 = 2;
pub const TF_MESSAGE_BYTES: usize = 1024;

/// `TfStatus`: the answer of every call across the boundary.
#[repr(C)]
pub struct TfStatus {
    pub code: i32,
    pub message: [c_char; TF_MESSAGE_BYTES],
}

impl TfStatus {
    pub fn new() -> TfStatus {
        TfStatus {
            code: TF_STOCK,
            message: [0; TF_MESSAGE_BYTES],
        }
    }

    /// TF_ERROR with `message` (cut to fit, NUL-terminated).
    pub fn fail(&mut self, message: &str) {
        self.code = TF_ERROR;
        let n = message.len().min(TF_MESSAGE_BYTES - 1);
        for (slot, &b) in self.message.iter_mut().zip(&message.as_bytes()[..n]) {
            *slot = b as c_char;
        }
        self.message[n] = 0;
    }

    /// The message the other side wrote (empty if none).
    pub fn message(&self) -> String {
        let bytes: Vec<u8> = self
            .message
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Default for TfStatus {
    fn default() -> Self {
        TfStatus::new()
    }
}

/// `TfLaunch`: where a call runs, PyTorch's device index and current stream.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TfLaunch {
    pub device: i32,
    pub stream: *mut c_void,
}

/// `TfTensor`: one tensor, described once by the glue. All zeros: absent.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TfTensor {
    /// The `at::Tensor`, borrowed for the call; null: absent.
    pub handle: *const c_void,
    /// `data_ptr()` of a CUDA tensor; null otherwise.
    pub data: *mut c_void,
    /// `ndim` sizes, in the `at::Tensor`'s own array; null unless `strided`.
    pub sizes: *const i64,
    /// `ndim` strides (elements), in the `at::Tensor`'s own array; null unless `strided`.
    pub strides: *const i64,
    pub ndim: i64,
    pub numel: i64,
    /// `c10::ScalarType`.
    pub dtype: i16,
    /// CUDA device index; -1 for a tensor not on a CUDA device.
    pub device: i16,
    /// Strided, non-overlapping and dense.
    pub dense: u8,
    /// In a list call: same sizes as the list's reference tensor at its index, and the same
    /// strides on every dim of size > 1 (stock's rule: the element order is then the same).
    pub like_first: u8,
    /// Sizes or strides are a tracing compiler's symbols (SymInt, under torch.compile's dynamic
    /// shapes): `numel`, `data` and `dense` are unread zeros, and the call goes to stock.
    pub symbolic: u8,
    /// A strided layout, not nested, sizes not symbolic: `sizes`, `strides`, `ndim` and
    /// `numel` are read.
    pub strided: u8,
}

impl TfTensor {
    /// An absent tensor (an undefined one, or an optional argument not given).
    pub const ABSENT: TfTensor = TfTensor {
        handle: std::ptr::null(),
        data: std::ptr::null_mut(),
        sizes: std::ptr::null(),
        strides: std::ptr::null(),
        ndim: 0,
        numel: 0,
        dtype: 0,
        device: 0,
        dense: 0,
        like_first: 0,
        symbolic: 0,
        strided: 0,
    };

    pub fn present(&self) -> bool {
        !self.handle.is_null()
    }

    /// A present CUDA tensor with elements whose data the glue did not read: a tensor subclass
    /// or wrapper (a Python or functionalization key, or no storage: a torch.func wrapper).
    /// Its data pointer means nothing to a kernel.
    pub fn opaque(&self) -> bool {
        self.present()
            && self.device >= 0
            && self.strided != 0
            && self.numel > 0
            && self.data.is_null()
    }

    /// The first of `tensors` Rust cannot serve a call with, if any: sizes that are symbolic
    /// (see `symbolic`), or where the call `launches` kernels on the tensors' data, data that
    /// is `opaque` (a call that only decides, such as the SDPA backend choice a compiler's
    /// trace asks with fake tensors, reads their sizes and strides only).
    pub fn first_unreadable<'a>(tensors: &[&'a TfTensor], launches: bool) -> Option<&'a TfTensor> {
        let mut all = tensors.iter().copied();
        all.clone()
            .find(|t| t.symbolic != 0)
            .or_else(|| all.find(|t| launches && t.opaque()))
    }
}

/// `TfOutputs`: owned `at::Tensor*` a fused call hands back; null for an undefined tensor.
#[repr(C)]
pub struct TfOutputs {
    pub tensors: [*mut c_void; 3],
}

/// `TfNormCall`.
#[repr(C)]
pub struct TfNormCall {
    pub input: TfTensor,
    pub weight: TfTensor,
    pub bias: TfTensor,
    pub grad_out: TfTensor,
    pub mean: TfTensor,
    pub rstd: TfTensor,
    pub normalized_shape: *const i64,
    pub normalized_ndim: usize,
    pub eps: f64,
    pub has_eps: u8,
    pub rms: u8,
    pub y_dtype: i16,
    pub output_mask: u32,
}

/// `TfGeluCall`.
#[repr(C)]
pub struct TfGeluCall {
    pub input: TfTensor,
    pub grad_out: TfTensor,
    pub out_dtype: i16,
    pub unused: [u8; 6],
}

/// `TfColumnSumCall`.
#[repr(C)]
pub struct TfColumnSumCall {
    pub input: TfTensor,
    pub dims: *const i64,
    pub ndims: usize,
    pub has_dims: u8,
    pub keepdim: u8,
    pub has_dtype: u8,
    pub unused: u8,
    pub out_dtype: i16,
    pub unused2: [u8; 2],
}

/// `TfMixedAddCall`.
#[repr(C)]
pub struct TfMixedAddCall {
    pub self_: TfTensor,
    pub other: TfTensor,
    pub alpha_is_one: u8,
    pub unused: [u8; 7],
}

/// `TfLinearCall`.
#[repr(C)]
pub struct TfLinearCall {
    pub input: TfTensor,
    pub weight: TfTensor,
    pub bias: TfTensor,
    pub dtype: i16,
    pub weight_in_out: u8,
    pub casts_in_node: u8,
    pub unused: [u8; 4],
}

/// `TfCrossEntropyCall`.
#[repr(C)]
pub struct TfCrossEntropyCall {
    pub logits: TfTensor,
    pub target: TfTensor,
    pub grad_loss: TfTensor,
    pub lse: TfTensor,
    pub total_weight: TfTensor,
    pub ignore_index: i64,
    pub label_smoothing: f64,
    pub reduction: i32,
    pub out_dtype: i16,
    pub plan_only: u8,
    pub unused: u8,
}

/// `TfSwigluCall`.
#[repr(C)]
pub struct TfSwigluCall {
    pub gate: TfTensor,
    pub up: TfTensor,
    pub grad_out: TfTensor,
}

/// `TfRotaryCall`.
#[repr(C)]
pub struct TfRotaryCall {
    pub q: TfTensor,
    pub k: TfTensor,
    pub cos: TfTensor,
    pub sin: TfTensor,
    pub grad_q: TfTensor,
    pub grad_k: TfTensor,
    /// kv_copy: the view of x's sizes to write (absent: a new row-major tensor).
    pub out: TfTensor,
    pub unsqueeze_dim: i64,
    pub x_dtype: i16,
    /// 1: pairs (2p, 2p+1) rotate (rotate_every_two); 0: rotate_half's (j, j + d/2).
    pub interleaved: u8,
    /// 1: cos/sin's last dim r is less than the head dim: its first r features rotate, the rest
    /// pass through (GPT-NeoX's partial rotary, as one op: the original's split and cat).
    pub passthrough: u8,
    pub unused: [u8; 4],
}

/// `TfEmbeddingCall`.
#[repr(C)]
pub struct TfEmbeddingCall {
    pub weight: TfTensor,
    pub grad: TfTensor,
    pub indices: TfTensor,
    pub num_weights: i64,
    pub padding_idx: i64,
    pub scale_grad_by_freq: u8,
    pub unused: [u8; 7],
}

/// `TfAdamCall`.
#[repr(C)]
pub struct TfAdamCall {
    /// params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps.
    pub lists: [*const TfTensor; 6],
    pub lens: [usize; 6],
    /// The `.tensor_lr` overloads' lr on the device; absent: `lr` holds the value.
    pub lr_tensor: TfTensor,
    pub grad_scale: TfTensor,
    pub found_inf: TfTensor,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
    /// AdamW (`_fused_adamw_`): decay the param, not the gradient.
    pub decoupled: u8,
    pub amsgrad: u8,
    pub maximize: u8,
    pub unused: [u8; 5],
}

/// `TfAttentionCall`.
#[repr(C)]
pub struct TfAttentionCall {
    pub query: TfTensor,
    pub key: TfTensor,
    pub value: TfTensor,
    pub grad_out: TfTensor,
    pub output: TfTensor,
    pub logsumexp: TfTensor,
    pub dropout_p: f64,
    pub scale: f64,
    /// The backend choice only: stock's answer (1 flash, 2 efficient, 3 cuDNN; -1 error,
    /// 0 math).
    pub stock_choice: i64,
    pub has_scale: u8,
    pub is_causal: u8,
    pub has_mask: u8,
    pub nested: u8,
    pub return_debug_mask: u8,
    /// The user's SDPA backend flags are PyTorch's defaults.
    pub default_backends: u8,
    /// Deterministic algorithms are required (not warn-only): stock's default is then
    /// FlashAttention-2 with its deterministic backward, not cuDNN.
    pub deterministic: u8,
    pub unused: u8,
}

/// `c10::ScalarType` codes of the dtypes torchfuse reads or allocates.
pub const SCALAR_UINT8: i16 = 0;
pub const SCALAR_INT8: i16 = 1;
pub const SCALAR_INT16: i16 = 2;
pub const SCALAR_INT: i16 = 3;
pub const SCALAR_LONG: i16 = 4;
pub const SCALAR_HALF: i16 = 5;
pub const SCALAR_FLOAT: i16 = 6;
pub const SCALAR_DOUBLE: i16 = 7;
pub const SCALAR_BOOL: i16 = 11;
pub const SCALAR_BFLOAT16: i16 = 15;

// Implemented in C++ (glue/registration.cpp).
extern "C" {
    pub fn torchfuse_cxx_register(entry: u32, status: *mut TfStatus);
    pub fn torchfuse_cxx_define_control_ops(status: *mut TfStatus);
    pub fn torchfuse_cxx_empty_unfilled(
        sizes: *const i64,
        ndim: usize,
        scalar_type: i16,
        device: i16,
        status: *mut TfStatus,
    ) -> *mut c_void;
    pub fn torchfuse_cxx_abi_layout(out: *mut i64, cap: usize) -> usize;
    pub fn torchfuse_cxx_describe(tensor: *const c_void, out: *mut TfTensor);
    pub fn torchfuse_cxx_entry_name(entry: u32) -> *const c_char;
    pub fn torchfuse_cxx_libtorch_file(out: *mut c_char, cap: usize) -> usize;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::Entry;
    use std::mem::{offset_of, size_of};

    /// The header's layout as Rust sees it, in `abi_layout`'s order (glue/registration.cpp).
    fn rust_layout() -> Vec<i64> {
        let n = |x: usize| x as i64;
        vec![
            n(size_of::<TfStatus>()),
            n(offset_of!(TfStatus, message)),
            n(TF_MESSAGE_BYTES),
            i64::from(TF_STOCK),
            i64::from(TF_FUSED),
            i64::from(TF_ERROR),
            n(Entry::ALL.len()),
            n(size_of::<TfLaunch>()),
            n(offset_of!(TfLaunch, stream)),
            n(size_of::<TfTensor>()),
            n(offset_of!(TfTensor, data)),
            n(offset_of!(TfTensor, sizes)),
            n(offset_of!(TfTensor, strides)),
            n(offset_of!(TfTensor, ndim)),
            n(offset_of!(TfTensor, numel)),
            n(offset_of!(TfTensor, dtype)),
            n(offset_of!(TfTensor, device)),
            n(offset_of!(TfTensor, dense)),
            n(offset_of!(TfTensor, like_first)),
            n(offset_of!(TfTensor, symbolic)),
            n(offset_of!(TfTensor, strided)),
            n(size_of::<TfOutputs>()),
            n(size_of::<TfNormCall>()),
            n(offset_of!(TfNormCall, weight)),
            n(offset_of!(TfNormCall, bias)),
            n(offset_of!(TfNormCall, grad_out)),
            n(offset_of!(TfNormCall, mean)),
            n(offset_of!(TfNormCall, rstd)),
            n(offset_of!(TfNormCall, normalized_shape)),
            n(offset_of!(TfNormCall, normalized_ndim)),
            n(offset_of!(TfNormCall, eps)),
            n(offset_of!(TfNormCall, has_eps)),
            n(offset_of!(TfNormCall, rms)),
            n(offset_of!(TfNormCall, y_dtype)),
            n(offset_of!(TfNormCall, output_mask)),
            n(size_of::<TfGeluCall>()),
            n(offset_of!(TfGeluCall, grad_out)),
            n(offset_of!(TfGeluCall, out_dtype)),
            n(size_of::<TfCrossEntropyCall>()),
            n(offset_of!(TfCrossEntropyCall, target)),
            n(offset_of!(TfCrossEntropyCall, grad_loss)),
            n(offset_of!(TfCrossEntropyCall, lse)),
            n(offset_of!(TfCrossEntropyCall, total_weight)),
            n(offset_of!(TfCrossEntropyCall, ignore_index)),
            n(offset_of!(TfCrossEntropyCall, label_smoothing)),
            n(offset_of!(TfCrossEntropyCall, reduction)),
            n(offset_of!(TfCrossEntropyCall, out_dtype)),
            n(offset_of!(TfCrossEntropyCall, plan_only)),
            n(size_of::<TfSwigluCall>()),
            n(offset_of!(TfSwigluCall, up)),
            n(offset_of!(TfSwigluCall, grad_out)),
            n(size_of::<TfRotaryCall>()),
            n(offset_of!(TfRotaryCall, k)),
            n(offset_of!(TfRotaryCall, cos)),
            n(offset_of!(TfRotaryCall, sin)),
            n(offset_of!(TfRotaryCall, grad_q)),
            n(offset_of!(TfRotaryCall, grad_k)),
            n(offset_of!(TfRotaryCall, out)),
            n(offset_of!(TfRotaryCall, unsqueeze_dim)),
            n(offset_of!(TfRotaryCall, x_dtype)),
            n(offset_of!(TfRotaryCall, interleaved)),
            n(size_of::<TfEmbeddingCall>()),
            n(offset_of!(TfEmbeddingCall, grad)),
            n(offset_of!(TfEmbeddingCall, indices)),
            n(offset_of!(TfEmbeddingCall, num_weights)),
            n(offset_of!(TfEmbeddingCall, padding_idx)),
            n(offset_of!(TfEmbeddingCall, scale_grad_by_freq)),
            n(size_of::<TfColumnSumCall>()),
            n(offset_of!(TfColumnSumCall, dims)),
            n(offset_of!(TfColumnSumCall, ndims)),
            n(offset_of!(TfColumnSumCall, has_dims)),
            n(offset_of!(TfColumnSumCall, keepdim)),
            n(offset_of!(TfColumnSumCall, has_dtype)),
            n(offset_of!(TfColumnSumCall, out_dtype)),
            n(size_of::<TfMixedAddCall>()),
            n(offset_of!(TfMixedAddCall, other)),
            n(offset_of!(TfMixedAddCall, alpha_is_one)),
            n(size_of::<TfLinearCall>()),
            n(offset_of!(TfLinearCall, weight)),
            n(offset_of!(TfLinearCall, bias)),
            n(offset_of!(TfLinearCall, dtype)),
            n(offset_of!(TfLinearCall, weight_in_out)),
            n(size_of::<TfAdamCall>()),
            n(offset_of!(TfAdamCall, lens)),
            n(offset_of!(TfAdamCall, lr_tensor)),
            n(offset_of!(TfAdamCall, grad_scale)),
            n(offset_of!(TfAdamCall, found_inf)),
            n(offset_of!(TfAdamCall, lr)),
            n(offset_of!(TfAdamCall, beta1)),
            n(offset_of!(TfAdamCall, beta2)),
            n(offset_of!(TfAdamCall, weight_decay)),
            n(offset_of!(TfAdamCall, eps)),
            n(offset_of!(TfAdamCall, decoupled)),
            n(offset_of!(TfAdamCall, amsgrad)),
            n(offset_of!(TfAdamCall, maximize)),
            n(size_of::<TfAttentionCall>()),
            n(offset_of!(TfAttentionCall, key)),
            n(offset_of!(TfAttentionCall, value)),
            n(offset_of!(TfAttentionCall, grad_out)),
            n(offset_of!(TfAttentionCall, output)),
            n(offset_of!(TfAttentionCall, logsumexp)),
            n(offset_of!(TfAttentionCall, dropout_p)),
            n(offset_of!(TfAttentionCall, scale)),
            n(offset_of!(TfAttentionCall, stock_choice)),
            n(offset_of!(TfAttentionCall, has_scale)),
            n(offset_of!(TfAttentionCall, is_causal)),
            n(offset_of!(TfAttentionCall, has_mask)),
            n(offset_of!(TfAttentionCall, nested)),
            n(offset_of!(TfAttentionCall, return_debug_mask)),
            n(offset_of!(TfAttentionCall, default_backends)),
            n(offset_of!(TfAttentionCall, deterministic)),
            i64::from(SCALAR_UINT8),
            i64::from(SCALAR_INT8),
            i64::from(SCALAR_INT16),
            i64::from(SCALAR_INT),
            i64::from(SCALAR_LONG),
            i64::from(SCALAR_HALF),
            i64::from(SCALAR_FLOAT),
            i64::from(SCALAR_DOUBLE),
            i64::from(SCALAR_BOOL),
            i64::from(SCALAR_BFLOAT16),
        ]
    }

    #[test]
    fn rust_and_cxx_agree_on_every_size_offset_and_code() {
        let mut cxx = vec![0i64; 256];
        // SAFETY: writes at most `cap` numbers into the buffer.
        let n = unsafe { torchfuse_cxx_abi_layout(cxx.as_mut_ptr(), cxx.len()) };
        assert!(n <= cxx.len());
        cxx.truncate(n);
        assert_eq!(rust_layout(), cxx);
    }

    #[test]
    fn entry_codes_name_the_same_ops_on_both_sides() {
        for entry in Entry::ALL {
            // SAFETY: a static NUL-terminated string, or null past the last entry.
            let name = unsafe { torchfuse_cxx_entry_name(entry as u32) };
            assert!(!name.is_null(), "{entry:?} has no C++ entry");
            // SAFETY: as above.
            let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
            assert_eq!(name, entry.aten_name());
        }
        // SAFETY: as above.
        assert!(unsafe { torchfuse_cxx_entry_name(Entry::ALL.len() as u32) }.is_null());
    }

    #[test]
    fn symbolic_sizes_come_first_and_opaque_data_only_where_kernels_launch() {
        let data = std::ptr::NonNull::<u8>::dangling().as_ptr().cast();
        let present = TfTensor {
            handle: data,
            data,
            numel: 8,
            strided: 1,
            ..TfTensor::ABSENT
        };
        let opaque = TfTensor {
            data: std::ptr::null_mut(),
            ..present
        };
        let symbolic = TfTensor {
            symbolic: 1,
            strided: 0,
            ..opaque
        };
        // An empty tensor's data may be null; a CPU tensor's always is: neither is opaque.
        let empty = TfTensor { numel: 0, ..opaque };
        let cpu = TfTensor {
            device: -1,
            ..opaque
        };
        assert!(opaque.opaque() && !present.opaque() && !empty.opaque() && !cpu.opaque());
        assert!(!TfTensor::ABSENT.opaque());
        let first = |ts: &[&TfTensor], launches| {
            TfTensor::first_unreadable(ts, launches).map(|t| (t.symbolic, t.opaque()))
        };
        assert_eq!(
            first(&[&present, &opaque, &symbolic], true),
            Some((1, false))
        );
        assert_eq!(first(&[&present, &opaque], true), Some((0, true)));
        assert_eq!(first(&[&present, &opaque], false), None);
        assert_eq!(first(&[&present, &empty, &cpu], true), None);
    }

    #[test]
    fn status_messages_are_cut_to_fit_and_terminated() {
        let mut status = TfStatus::new();
        assert_eq!(status.code, TF_STOCK);
        status.fail("refused: lists differ");
        assert_eq!(status.code, TF_ERROR);
        assert_eq!(status.message(), "refused: lists differ");
        status.fail(&"x".repeat(5000));
        assert_eq!(status.message().len(), TF_MESSAGE_BYTES - 1);
    }
}
