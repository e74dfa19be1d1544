// Registration (each family's entries, by entry code), the control ops, the ABI layout check,
// and the C entry points Rust calls.
#include "glue.h"

namespace torchfuse_glue {
namespace {

// A toggle control call's answer: TF_FUSED true, TF_STOCK false, TF_ERROR its message raised.
template <typename Call>
bool toggle_answer(Call call) {
  TfStatus status;
  status.code = TF_STOCK;
  status.message[0] = '\0';
  call(&status);
  status.message[TF_MESSAGE_BYTES - 1] = '\0';
  TORCH_CHECK(status.code != TF_ERROR, status.message);
  return status.code == TF_FUSED;
}

bool control_set_enabled(c10::string_view op, bool enabled) {
  return toggle_answer(
      [&](TfStatus* status) { torchfuse_rs_set_enabled(op.data(), op.size(), enabled, status); });
}

bool control_enabled(c10::string_view op) {
  return toggle_answer([&](TfStatus* status) { torchfuse_rs_enabled(op.data(), op.size(), status); });
}

std::string control_stats() {
  char* json = torchfuse_rs_stats_json();
  if (json == nullptr) return "{}";
  std::string s(json);
  torchfuse_rs_free_string(json);
  return s;
}

void control_reset_stats() { torchfuse_rs_reset_stats(); }

std::string control_doctor(c10::string_view arch) {
  char* json = torchfuse_rs_doctor_json(arch.data(), arch.size());
  TORCH_CHECK(json != nullptr, "torchfuse: the doctor's report could not be made");
  std::string text(json);
  torchfuse_rs_free_string(json);
  return text;
}

void control_note(c10::string_view message, bool debug) {
  torchfuse_rs_note(message.data(), message.size(), debug);
}

void control_serve_below_thresholds(bool serve) { torchfuse_rs_serve_below_thresholds(serve); }

void control_force_variant(c10::string_view name) {
  torchfuse_rs_force_variant(name.data(), name.size());
}

// Sends the dispatcher's "Overriding a previously registered kernel" warnings to our log.
class WarningsToLog : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    const std::string& msg = warning.msg();
    torchfuse_rs_torch_warning(msg.data(), msg.size());
  }
};

// The op each entry overrides or defines, in TfEntry order (the catalog's; the SDPA backend
// choice is a dispatch stub, not an op).
#define TF_ENTRY_NAME(id, op, family, key) op,
constexpr const char* kEntryNames[TF_ENTRY_COUNT] = {TF_FOR_EACH_ENTRY(TF_ENTRY_NAME)};
#undef TF_ENTRY_NAME

// The library an aten override registers its kernel with, by the catalog's key; none for a
// dispatch stub or torchfuse's own ops (their families register at each key the op needs).
torch::Library* library_for(TfKey key) {
  switch (key) {
    case TF_KEY_CUDA: return &aten_cuda_library();
    case TF_KEY_AUTOGRAD_CUDA: return &aten_autograd_cuda_library();
    default: return nullptr;
  }
}

// Registers one entry: the schemas of torchfuse's own ops it defines (the catalog's), then
// its kernels, by its family's register_<family> (the catalog says which).
void register_entry(uint32_t entry) {
#define TF_DEFINE(id, schema) \
  if (entry == TF_ENTRY_##id) torchfuse_ops().def(schema);
  TF_FOR_EACH_SCHEMA(TF_DEFINE)
#undef TF_DEFINE
  bool registered = false;
  switch (entry) {
#define TF_REGISTER(id, op, family, key) \
  case TF_ENTRY_##id: registered = register_##family(entry, op, library_for(key)); break;
    TF_FOR_EACH_ENTRY(TF_REGISTER)
#undef TF_REGISTER
    default: break;
  }
  TORCH_CHECK(registered, "torchfuse: unknown entry ", entry);
}

// Runs `body`, turning any C++ exception into TF_ERROR with its message.
template <class Body>
void protect(TfStatus* status, Body body) {
  try {
    body();
    status->code = TF_FUSED;
  } catch (const std::exception& e) {
    status->code = TF_ERROR;
    std::strncpy(status->message, e.what(), TF_MESSAGE_BYTES - 1);
    status->message[TF_MESSAGE_BYTES - 1] = '\0';
  }
}

// Every size and offset of torchfuse_abi.h, and the c10::ScalarType codes Rust uses, in the
// order src/abi/types.rs lists them.
#define TF_FIELD(type, field) static_cast<int64_t>(offsetof(type, field))
const std::vector<int64_t>& abi_layout() {
  static const std::vector<int64_t> layout = {
      sizeof(TfStatus), TF_FIELD(TfStatus, message), TF_MESSAGE_BYTES,
      TF_STOCK, TF_FUSED, TF_ERROR, TF_ENTRY_COUNT,
      sizeof(TfLaunch), TF_FIELD(TfLaunch, stream),
      sizeof(TfTensor), TF_FIELD(TfTensor, data), TF_FIELD(TfTensor, sizes),
      TF_FIELD(TfTensor, strides), TF_FIELD(TfTensor, ndim), TF_FIELD(TfTensor, numel),
      TF_FIELD(TfTensor, dtype), TF_FIELD(TfTensor, device), TF_FIELD(TfTensor, dense),
      TF_FIELD(TfTensor, like_first), TF_FIELD(TfTensor, symbolic),
      TF_FIELD(TfTensor, strided),
      sizeof(TfOutputs),
      sizeof(TfNormCall), TF_FIELD(TfNormCall, weight), TF_FIELD(TfNormCall, bias),
      TF_FIELD(TfNormCall, grad_out), TF_FIELD(TfNormCall, mean), TF_FIELD(TfNormCall, rstd),
      TF_FIELD(TfNormCall, normalized_shape), TF_FIELD(TfNormCall, normalized_ndim),
      TF_FIELD(TfNormCall, eps), TF_FIELD(TfNormCall, has_eps), TF_FIELD(TfNormCall, rms),
      TF_FIELD(TfNormCall, y_dtype),
      TF_FIELD(TfNormCall, output_mask),
      sizeof(TfGeluCall), TF_FIELD(TfGeluCall, grad_out), TF_FIELD(TfGeluCall, out_dtype),
      sizeof(TfCrossEntropyCall), TF_FIELD(TfCrossEntropyCall, target),
      TF_FIELD(TfCrossEntropyCall, grad_loss), TF_FIELD(TfCrossEntropyCall, lse),
      TF_FIELD(TfCrossEntropyCall, total_weight), TF_FIELD(TfCrossEntropyCall, ignore_index),
      TF_FIELD(TfCrossEntropyCall, label_smoothing), TF_FIELD(TfCrossEntropyCall, reduction),
      TF_FIELD(TfCrossEntropyCall, out_dtype), TF_FIELD(TfCrossEntropyCall, plan_only),
      sizeof(TfSwigluCall), TF_FIELD(TfSwigluCall, up), TF_FIELD(TfSwigluCall, grad_out),
      sizeof(TfRotaryCall), TF_FIELD(TfRotaryCall, k), TF_FIELD(TfRotaryCall, cos),
      TF_FIELD(TfRotaryCall, sin), TF_FIELD(TfRotaryCall, grad_q), TF_FIELD(TfRotaryCall, grad_k),
      TF_FIELD(TfRotaryCall, out), TF_FIELD(TfRotaryCall, unsqueeze_dim), TF_FIELD(TfRotaryCall, x_dtype),
      TF_FIELD(TfRotaryCall, interleaved),
      sizeof(TfEmbeddingCall), TF_FIELD(TfEmbeddingCall, grad),
      TF_FIELD(TfEmbeddingCall, indices), TF_FIELD(TfEmbeddingCall, num_weights),
      TF_FIELD(TfEmbeddingCall, padding_idx), TF_FIELD(TfEmbeddingCall, scale_grad_by_freq),
      sizeof(TfColumnSumCall), TF_FIELD(TfColumnSumCall, dims), TF_FIELD(TfColumnSumCall, ndims),
      TF_FIELD(TfColumnSumCall, has_dims), TF_FIELD(TfColumnSumCall, keepdim),
      TF_FIELD(TfColumnSumCall, has_dtype), TF_FIELD(TfColumnSumCall, out_dtype),
      sizeof(TfMixedAddCall), TF_FIELD(TfMixedAddCall, other),
      TF_FIELD(TfMixedAddCall, alpha_is_one),
      sizeof(TfLinearCall), TF_FIELD(TfLinearCall, weight), TF_FIELD(TfLinearCall, bias),
      TF_FIELD(TfLinearCall, dtype), TF_FIELD(TfLinearCall, weight_in_out),
      sizeof(TfAdamCall), TF_FIELD(TfAdamCall, lens), TF_FIELD(TfAdamCall, lr_tensor),
      TF_FIELD(TfAdamCall, grad_scale), TF_FIELD(TfAdamCall, found_inf),
      TF_FIELD(TfAdamCall, lr), TF_FIELD(TfAdamCall, beta1), TF_FIELD(TfAdamCall, beta2),
      TF_FIELD(TfAdamCall, weight_decay), TF_FIELD(TfAdamCall, eps),
      TF_FIELD(TfAdamCall, decoupled), TF_FIELD(TfAdamCall, amsgrad),
      TF_FIELD(TfAdamCall, maximize),
      sizeof(TfAttentionCall), TF_FIELD(TfAttentionCall, key), TF_FIELD(TfAttentionCall, value),
      TF_FIELD(TfAttentionCall, grad_out), TF_FIELD(TfAttentionCall, output),
      TF_FIELD(TfAttentionCall, logsumexp), TF_FIELD(TfAttentionCall, dropout_p),
      TF_FIELD(TfAttentionCall, scale), TF_FIELD(TfAttentionCall, stock_choice),
      TF_FIELD(TfAttentionCall, has_scale), TF_FIELD(TfAttentionCall, is_causal),
      TF_FIELD(TfAttentionCall, has_mask), TF_FIELD(TfAttentionCall, nested),
      TF_FIELD(TfAttentionCall, return_debug_mask), TF_FIELD(TfAttentionCall, default_backends),
      TF_FIELD(TfAttentionCall, deterministic),
      static_cast<int64_t>(at::kByte), static_cast<int64_t>(at::kChar),
      static_cast<int64_t>(at::kShort), static_cast<int64_t>(at::kInt),
      static_cast<int64_t>(at::kLong), static_cast<int64_t>(at::kHalf),
      static_cast<int64_t>(at::kFloat), static_cast<int64_t>(at::kDouble),
      static_cast<int64_t>(at::kBool), static_cast<int64_t>(at::kBFloat16),
  };
  return layout;
}
#undef TF_FIELD

}  // namespace
}  // namespace torchfuse_glue

using namespace torchfuse_glue;

extern "C" {

__attribute__((visibility("default"))) void torchfuse_cxx_register(uint32_t entry,
                                                                    TfStatus* status) {
  protect(status, [&] {
    WarningsToLog handler;
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    register_entry(entry);
  });
}

// Unfilled: aten's `empty` also fills a new tensor when deterministic algorithms are on
// (fill_uninitialized_memory), a whole extra write of an output the kernel overwrites anyway.
__attribute__((visibility("default"))) void* torchfuse_cxx_empty_unfilled(
    const int64_t* sizes, size_t ndim, int16_t scalar_type, int16_t device, TfStatus* status) {
  at::Tensor* tensor = nullptr;
  protect(status, [&] {
    tensor = new at::Tensor(at::detail::empty_cuda(
        c10::IntArrayRef(sizes, ndim), static_cast<c10::ScalarType>(scalar_type),
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)), std::nullopt));
  });
  return tensor;
}

__attribute__((visibility("default"))) void torchfuse_cxx_define_control_ops(TfStatus* status) {
  protect(status, [] {
    static torch::Library* lib =
        new torch::Library(torch::Library::DEF, "torchfuse", std::nullopt, kRegistrationFile, 0);
    lib->def("set_enabled(str op, bool enabled) -> bool", &control_set_enabled);
    lib->def("enabled(str op) -> bool", &control_enabled);
    lib->def("stats() -> str", &control_stats);
    lib->def("reset_stats() -> ()", &control_reset_stats);
    lib->def("doctor(str arch=\"\") -> str", &control_doctor);
    // The launcher's Python hook reports its substitutions here, to torchfuse's log.
    lib->def("note(str message, bool debug=False) -> ()", &control_note);
    // Test hook: kernels also serve shapes below their measured thresholds.
    lib->def("_serve_below_thresholds(bool serve) -> ()", &control_serve_below_thresholds);
    // Benchmark hook: serve the named variant's op with it ("" clears).
    lib->def("_force_variant(str name) -> ()", &control_force_variant);
  });
}

__attribute__((visibility("default"))) size_t torchfuse_cxx_abi_layout(int64_t* out,
                                                                       size_t cap) {
  const std::vector<int64_t>& layout = abi_layout();
  for (size_t i = 0; i < layout.size() && i < cap; ++i) out[i] = layout[i];
  return layout.size();
}

// The glue's description of one tensor (null: absent), as every override makes it: the
// Rust tests compare it with what libtorch says of the tensor.
__attribute__((visibility("default"))) void torchfuse_cxx_describe(const void* tensor,
                                                                   TfTensor* out) {
  *out = tensor == nullptr ? absent() : describe(*static_cast<const at::Tensor*>(tensor));
}

__attribute__((visibility("default"))) const char* torchfuse_cxx_entry_name(uint32_t entry) {
  return entry < TF_ENTRY_COUNT ? kEntryNames[entry] : nullptr;
}

__attribute__((visibility("default"))) size_t torchfuse_cxx_libtorch_file(char* out, size_t cap) {
  try {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) == 0 ||
        info.dli_fname == nullptr)
      return 0;
    const size_t len = std::strlen(info.dli_fname);
    if (cap > 0) {
      std::strncpy(out, info.dli_fname, cap - 1);
      out[cap - 1] = '\0';
    }
    return len;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
