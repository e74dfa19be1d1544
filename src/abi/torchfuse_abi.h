// torchfuse_abi.h: the one definition of everything that crosses between the C++ glue
// (src/abi/glue/) and Rust (src/abi/types.rs mirrors it; a cargo test compares every size, offset
// and code with what the C++ compiler makes of this file: torchfuse_cxx_abi_layout).
//
// Protocol.
// - Every call from C++ into Rust for an aten op is `torchfuse_rs_<family>(entry, launch,
//   call, out, status)`: the entry says which override it is, `call` is the family's struct
//   below, `out` receives the outputs Rust allocated. Rust answers in `status->code`:
//   TF_STOCK (PyTorch's own kernel must run the call, unchanged), TF_FUSED (done: the outputs
//   are in `out`), or TF_ERROR (bad input refused; `status->message` says why and the glue
//   raises it as PyTorch's error). Rust catches every panic and answers TF_STOCK.
// - Every call from Rust into C++ (registration, allocation) takes a TfStatus too: the glue
//   catches every C++ exception and answers TF_ERROR with its message; TF_FUSED means done.
// - Tensors cross as TfTensor: facts read once by the glue (so per-tensor work in Rust is
//   plain memory reads) and the borrowed at::Tensor itself (`handle`), valid for the call.
//   Outputs cross the other way as owned `at::Tensor*` in TfOutputs.
#ifndef TORCHFUSE_ABI_H
#define TORCHFUSE_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The override points (`TfEntry`: `Entry` in Rust), numbered as the op catalog
// (src/catalog.toml) lists them; the build generates this header from it.
#include "torchfuse_catalog.h"

// Status codes.
#define TF_STOCK 0
#define TF_FUSED 1
#define TF_ERROR 2

#define TF_MESSAGE_BYTES 1024

typedef struct TfStatus {
  int32_t code;
  char message[TF_MESSAGE_BYTES];  // NUL-terminated; set with TF_ERROR
} TfStatus;

// Where a call runs: PyTorch's device index and its current stream there.
typedef struct TfLaunch {
  int32_t device;  // -1: not a CUDA call
  void* stream;    // cudaStream_t
} TfLaunch;

// One tensor. An absent (undefined, or an empty optional) tensor is all zeros. Everything
// Rust reads of a tensor is here (its sizes and strides point into the at::Tensor's own
// arrays, valid for the call); `handle` is only for making new tensors from it (a contiguous
// copy).
typedef struct TfTensor {
  const void* handle;      // the at::Tensor, borrowed for the call; null: absent
  void* data;              // data_ptr() of a CUDA tensor; null otherwise
  const int64_t* sizes;    // ndim sizes; null unless `strided`
  const int64_t* strides;  // ndim strides, in elements; null unless `strided`
  int64_t ndim;
  int64_t numel;
  int16_t dtype;       // c10::ScalarType
  int16_t device;      // CUDA device index; -1: not a CUDA tensor
  uint8_t dense;       // strided, non-overlapping and dense
  uint8_t like_first;  // in a list call: same sizes as the list's reference tensor at its
                       // index, same strides on every dim of size > 1 (stock's rule)
  uint8_t symbolic;    // sizes or strides are a tracing compiler's symbols (SymInt, under
                       // torch.compile's dynamic shapes): numel, data and dense are not read,
                       // and the call goes to stock
  uint8_t strided;     // a strided layout, not nested, sizes not symbolic: sizes, strides,
                       // ndim and numel are read
} TfTensor;

// Outputs a fused call hands back: owned at::Tensor*, null for an undefined tensor.
typedef struct TfOutputs {
  void* tensors[3];
} TfOutputs;

// native_layer_norm[_backward], _fused_rms_norm[_backward], torchfuse::hf_rms_norm (input,
// weight, eps), torchfuse::norm_cast[_backward] (over the last dim; `rms`, y's `y_dtype`).
typedef struct TfNormCall {
  TfTensor input;
  TfTensor weight;
  TfTensor bias;  // LayerNorm only
  TfTensor grad_out;  // backward only
  TfTensor mean;      // LayerNorm backward only
  TfTensor rstd;      // backward only
  const int64_t* normalized_shape;
  size_t normalized_ndim;
  double eps;
  uint8_t has_eps;      // _fused_rms_norm's eps is optional
  uint8_t rms;          // norm_cast: RMSNorm (1) or LayerNorm (0)
  int16_t y_dtype;      // norm_cast: y's (and the backward's dy's) c10::ScalarType
  uint32_t output_mask;  // backward: bit i asks for output i
} TfNormCall;

// torchfuse::gelu_tanh (input, out_dtype) and gelu_tanh_backward (grad_out, input).
typedef struct TfGeluCall {
  TfTensor input;
  TfTensor grad_out;  // backward only
  int16_t out_dtype;  // forward: the output's c10::ScalarType
  uint8_t unused[6];
} TfGeluCall;

// torchfuse::cross_entropy's and aten::cross_entropy_loss's forward (logits, target) and backward (grad_loss, logits, target,
// lse, total_weight): class-index targets, no class weights.
typedef struct TfCrossEntropyCall {
  TfTensor logits;
  TfTensor target;
  TfTensor grad_loss;     // backward only
  TfTensor lse;           // backward only: the forward's fp32 log-sum-exp a row
  TfTensor total_weight;  // backward only: the forward's count of rows not ignored (fp32)
  int64_t ignore_index;
  double label_smoothing;
  int32_t reduction;  // at::Reduction: 0 none, 1 mean, 2 sum
  int16_t out_dtype;  // forward: the loss's c10::ScalarType (what the logits are cast to first)
  // Forward, nonzero: whether a kernel would serve the call, decided and not launched or
  // counted (a compiler's trace of static sizes: its graph then calls the op at run time).
  uint8_t plan_only;
  uint8_t unused;
} TfCrossEntropyCall;

// torchfuse::silu_mul (gate, up) and silu_mul_backward (grad_out, gate, up).
typedef struct TfSwigluCall {
  TfTensor gate;
  TfTensor up;
  TfTensor grad_out;  // backward only
} TfSwigluCall;

// torchfuse::rotary (q, k, cos, sin, unsqueeze_dim, interleaved, passthrough) and
// rotary_backward (grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype, interleaved, passthrough);
// kv_copy's rows copy (x in q, the copy's dtype in x_dtype).
typedef struct TfRotaryCall {
  TfTensor q, k;            // forward only
  TfTensor cos, sin;
  TfTensor grad_q, grad_k;  // backward only
  TfTensor out;  // kv_copy: the view of x's sizes to write (absent: a new row-major tensor)
  int64_t unsqueeze_dim;
  int16_t x_dtype;  // backward: q's and k's c10::ScalarType, the gradients' dtype
  uint8_t interleaved;  // 1: pairs (2p, 2p+1) rotate (rotate_every_two); 0: rotate_half's (j, j+d/2)
  uint8_t passthrough;  // 1: cos/sin's last dim r < the head dim: the first r rotate, the rest pass
  uint8_t unused[4];
} TfRotaryCall;

// embedding (weight, indices) and embedding_dense_backward (grad, indices, ...).
typedef struct TfEmbeddingCall {
  TfTensor weight;  // forward
  TfTensor grad;    // backward
  TfTensor indices;
  int64_t num_weights;  // backward
  int64_t padding_idx;  // backward
  uint8_t scale_grad_by_freq;
  uint8_t unused[7];
} TfEmbeddingCall;

// aten::sum.dim_IntList (input, dim, keepdim, dtype): Rust serves the sums over a contiguous
// input's leading dims.
typedef struct TfColumnSumCall {
  TfTensor input;
  const int64_t* dims;  // `dim`'s values as given (null and 0 where dim is None)
  size_t ndims;
  uint8_t has_dims;   // dim is not None
  uint8_t keepdim;
  uint8_t has_dtype;  // dtype is given: `out_dtype`
  uint8_t unused;
  int16_t out_dtype;  // c10::ScalarType
  uint8_t unused2[2];
} TfColumnSumCall;

// aten::add.Tensor (self, other, alpha): Rust serves an fp32 tensor plus a 16-bit one of the
// same shape, alpha 1 (the glue sends only calls of two dtypes).
typedef struct TfMixedAddCall {
  TfTensor self;
  TfTensor other;
  uint8_t alpha_is_one;  // alpha == 1 (a real number): the sum needs no multiply
  uint8_t unused[7];
} TfMixedAddCall;

// torchfuse::linear_cast (input, weight, bias, dtype, weight_in_out): whether its one autograd
// node may run (stock's kernels under it; no outputs come back), or stock's nodes must.
typedef struct TfLinearCall {
  TfTensor input;
  TfTensor weight;
  TfTensor bias;          // absent: none
  int16_t dtype;          // the casts' c10::ScalarType (autocast's)
  uint8_t weight_in_out;  // the weight is [in, out] (HF Conv1D's), not nn.Linear's [out, in]
  uint8_t casts_in_node;  // the glue casts the weight (and bias) inside the node (`weight_cast`)
  uint8_t unused[4];
} TfLinearCall;

// _fused_adam_ / _fused_adamw_ (float or tensor lr).
typedef struct TfAdamCall {
  // params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps; `like_first`
  // compares each tensor with the param at its index.
  const TfTensor* lists[6];
  size_t lens[6];
  TfTensor lr_tensor;  // a device lr; absent: `lr` holds the value
  TfTensor grad_scale;
  TfTensor found_inf;
  double lr, beta1, beta2, weight_decay, eps;
  uint8_t decoupled;  // AdamW
  uint8_t amsgrad;
  uint8_t maximize;
  uint8_t unused[5];
} TfAdamCall;

// One scaled_dot_product_attention call as the flash backend sees it: the backend choice,
// the forward and the backward.
typedef struct TfAttentionCall {
  TfTensor query, key, value;
  TfTensor grad_out, output, logsumexp;  // backward only
  double dropout_p;
  double scale;
  int64_t stock_choice;  // backend choice only: stock's answer (1 flash, 2 efficient, 3 cuDNN)
  uint8_t has_scale;
  uint8_t is_causal;
  uint8_t has_mask;
  uint8_t nested;
  uint8_t return_debug_mask;
  uint8_t default_backends;  // the user's SDPA backend flags are PyTorch's defaults
  uint8_t deterministic;     // deterministic algorithms required (not warn-only)
  uint8_t unused;
} TfAttentionCall;

// ---------------------------------------------------------------- implemented in Rust

void torchfuse_rs_norm(uint32_t entry, const TfLaunch* launch, const TfNormCall* call,
                       TfOutputs* out, TfStatus* status);
void torchfuse_rs_embedding(uint32_t entry, const TfLaunch* launch, const TfEmbeddingCall* call,
                            TfOutputs* out, TfStatus* status);
// Updates the params and moments in place: no outputs.
void torchfuse_rs_adam(uint32_t entry, const TfLaunch* launch, const TfAdamCall* call,
                       TfOutputs* out, TfStatus* status);
// Backend choice: TF_FUSED = flash, served by torchfuse. Forward: out = output, logsumexp.
// Backward: out = dq, dk, dv.
void torchfuse_rs_attention(uint32_t entry, const TfLaunch* launch, const TfAttentionCall* call,
                            TfOutputs* out, TfStatus* status);

// torchfuse::gelu_tanh: out = y. Its backward: out = dx.
void torchfuse_rs_gelu(uint32_t entry, const TfLaunch* launch, const TfGeluCall* call,
                       TfOutputs* out, TfStatus* status);

// The cross-entropy forward (torchfuse::cross_entropy, aten::cross_entropy_loss): out = loss, lse
// (fp32 [rows]), total_weight (fp32, 0-d).
// Its backward: out = grad_logits.
void torchfuse_rs_cross_entropy(uint32_t entry, const TfLaunch* launch,
                                const TfCrossEntropyCall* call, TfOutputs* out, TfStatus* status);

// torchfuse::silu_mul: out = y. Its backward: out = dgate, dup.
void torchfuse_rs_swiglu(uint32_t entry, const TfLaunch* launch, const TfSwigluCall* call,
                         TfOutputs* out, TfStatus* status);

// sum.dim_IntList: out = the sum.
void torchfuse_rs_column_sum(uint32_t entry, const TfLaunch* launch, const TfColumnSumCall* call,
                             TfOutputs* out, TfStatus* status);

// add.Tensor: out = the sum.
void torchfuse_rs_mixed_add(uint32_t entry, const TfLaunch* launch, const TfMixedAddCall* call,
                            TfOutputs* out, TfStatus* status);

// torchfuse::linear_cast: TF_FUSED: the glue builds its node (no outputs).
void torchfuse_rs_linear(uint32_t entry, const TfLaunch* launch, const TfLinearCall* call,
                         TfOutputs* out, TfStatus* status);

// torchfuse::rotary: out = q_embed, k_embed. Its backward: out = dq, dk.
void torchfuse_rs_rotary(uint32_t entry, const TfLaunch* launch, const TfRotaryCall* call,
                         TfOutputs* out, TfStatus* status);

// Control ops (torch.ops.torchfuse.*). set_enabled: TF_FUSED when the op now runs through
// torchfuse, TF_STOCK when it does not, TF_ERROR for an unknown name.
void torchfuse_rs_set_enabled(const char* name, size_t len, uint8_t enabled, TfStatus* status);
// enabled: TF_FUSED when the op (a toggle's name) runs through torchfuse now, TF_STOCK when it
// does not, TF_ERROR for an unknown name.
void torchfuse_rs_enabled(const char* name, size_t len, TfStatus* status);
// JSON of the calls so far; free with torchfuse_rs_free_string. Null on failure.
char* torchfuse_rs_stats_json(void);
void torchfuse_rs_free_string(char* s);
// `torchfuse doctor`'s report from inside the library (JSON; free with torchfuse_rs_free_string;
// null on failure): versions, kernel cache, NVRTC, registry, toggles, one kernel of every
// family compiled for `arch` (e.g. "sm_90a"; empty: sm_90a).
char* torchfuse_rs_doctor_json(const char* arch, size_t len);
void torchfuse_rs_reset_stats(void);
// A message from the Python side, to torchfuse's log at info (debug: at debug).
void torchfuse_rs_note(const char* msg, size_t len, uint8_t debug);
void torchfuse_rs_torch_warning(const char* msg, size_t len);
void torchfuse_rs_serve_below_thresholds(uint8_t serve);
void torchfuse_rs_force_variant(const char* name, size_t len);

// ---------------------------------------------------------------- implemented in C++

// Registers one entry: an aten op's override at the CUDA key, or one of torchfuse's own ops.
void torchfuse_cxx_register(uint32_t entry, TfStatus* status);
// Defines the torch.ops.torchfuse control namespace.
void torchfuse_cxx_define_control_ops(TfStatus* status);
// A new CUDA tensor from PyTorch's caching allocator on its current stream, never filled;
// an owned at::Tensor*, or null (status says why).
void* torchfuse_cxx_empty_unfilled(const int64_t* sizes, size_t ndim, int16_t scalar_type,
                                   int16_t device, TfStatus* status);
// The layout of this file as the C++ compiler sees it, for the cargo test that compares it
// with Rust's: writes up to `cap` numbers (see glue/registration.cpp) and returns how many
// there are.
size_t torchfuse_cxx_abi_layout(int64_t* out, size_t cap);
// The file the running torch's libc10 was loaded from, into `out` (NUL-terminated, cut to
// `cap`); returns its full length, 0 when unknown.
size_t torchfuse_cxx_libtorch_file(char* out, size_t cap);
// The op (aten's with overload, or torchfuse::name) an entry overrides or defines.
const char* torchfuse_cxx_entry_name(uint32_t entry);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TORCHFUSE_ABI_H
