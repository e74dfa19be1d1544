// The tanh GELU and its derivative, in fp32 from the stored value with the accurate tanhf:
// the one definition gelu.cu (the activation alone: GPT-2's) and swiglu.cu (GeGLU, the gate
// of Gemma's gated MLP) share.
//
//   gelu(x)  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//
// PyTorch's own gelu(approximate="tanh") computes the same expressions in fp32 with its
// products in another order (kappa (x x x) where this file has ((kappa x) x) x): the two agree
// to fp32 rounding, not bit for bit.
#ifndef TF_GELU_TANH_CUH
#define TF_GELU_TANH_CUH

// sqrt(2 / pi) and the cubic's coefficient, as PyTorch's kernel writes them (fp32).
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

__device__ __forceinline__ float tf_gelu_tanh(float x) {
  const float u = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}

__device__ __forceinline__ float tf_gelu_tanh_grad(float x) {
  const float x2 = x * x;
  const float t = tanhf(GELU_BETA * (x + GELU_KAPPA * x2 * x));
  const float left = 0.5f * (1.f + t);
  const float right = 0.5f * x * (1.f - t * t) * GELU_BETA * (1.f + 3.f * GELU_KAPPA * x2);
  return left + right;
}

#endif  // TF_GELU_TANH_CUH
