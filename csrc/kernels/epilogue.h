// The fused epilogue, written once for every backend: the C++ CPU kernels include it, and the
// runtime compiler (NVRTC / hiprtc) compiles it into every GPU kernel.
//
// Each output value of the chain is `v = conv_alpha * acc` (or the input value when the plan
// has no convolution), then the pointwise operators in plan order:
//   bias        v + b[c]
//   batchnorm   scale * (v - mean) * rsqrt(var + eps) + shift
//   side add    v + side_alpha * z
//   activation  f(v; alpha, beta, gamma), formulas from MIOpen's activation modes and jax.nn's
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__CUDACC_RTC__) || defined(__HIPCC_RTC__)
#define JF_HD __host__ __device__ __forceinline__
#define JF_DEVICE_COMPILE 1
#else
#include <cmath>
#define JF_HD inline __attribute__((always_inline))
#endif

namespace jaxfuse {

// The numbering of miopenActivationMode_t (then jax.nn's modes, appended), and of
// jaxfuse.ActivationMode.code.
enum ActivationMode : int {
  kPassthru = 0,
  kLogistic = 1,
  kTanh = 2,
  kRelu = 3,
  kSoftrelu = 4,
  kAbs = 5,
  kPower = 6,
  kClippedRelu = 7,
  kLeakyRelu = 8,
  kElu = 9,
  kSilu = 10,
  kGelu = 11,
  kGeluTanh = 12,
  kHardswish = 13,
  kHardsigmoid = 14,
  kMish = 15,
  kNumActivationModes = 16,
};

// Indices into the float32 scalars operand (jaxfuse/signature.py: SCALARS).
enum ScalarIndex : int {
  kConvAlpha = 0,
  kBnEpsilon = 1,
  kActAlpha = 2,
  kActBeta = 3,
  kActGamma = 4,
  kSideAlpha = 5,
  kNumScalars = 8,
};

JF_HD float jf_rsqrt(float x) {
#ifdef JF_DEVICE_COMPILE
  return rsqrtf(x);
#else
  return 1.0f / sqrtf(x);
#endif
}

// max(x, y) and min(x, y) with NaN in either giving NaN, as jnp.maximum / jnp.minimum do. On
// CUDA devices of sm_80 and later one instruction each (FMNMX.NAN) where the portable compare
// and select take two or three: the pointwise and depthwise kernels are issue bound.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIPCC_RTC__) && \
    !defined(__HIPCC__)
JF_HD float max_nan(float x, float y) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}
JF_HD float min_nan(float x, float y) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}
#else
// (x NaN: both comparisons are false and x comes back.) With a constant y these are the forms
// compilers turn into one vector max / min on CPUs (maxps(0, x) keeps a NaN x).
JF_HD float max_nan(float x, float y) { return x < y || y != y ? y : x; }
JF_HD float min_nan(float x, float y) { return x > y || y != y ? y : x; }
#endif

template <int Mode>
JF_HD float activate(float x, float a, float b, float g) {
  if (Mode == kPassthru) return x;
  if (Mode == kLogistic) return 1.0f / (1.0f + expf(-x));
  if (Mode == kTanh) return b * tanhf(a * x);
  // NaN passes through, as jax.nn's does (x > 0 ? x : 0 would turn NaN into 0).
  if (Mode == kRelu) return max_nan(x, 0.0f);
  // log(1 + exp(x)) without overflow for large x.
  if (Mode == kSoftrelu) return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
  if (Mode == kAbs) return fabsf(x);
  if (Mode == kPower) {
    const float base = a + b * x;
    return base > 0.0f ? powf(base, g) : 0.0f;
  }
  // min(max(x, 0), a), NaN in x or in a passing through (as jnp.minimum and jnp.clip do).
  if (Mode == kClippedRelu) return min_nan(max_nan(x, 0.0f), a);
  if (Mode == kLeakyRelu) return x > 0.0f ? x : a * x;
  if (Mode == kElu) return x > 0.0f ? x : a * expm1f(x);
  // jax.nn's, without overflow to NaN for any finite x; at -inf each is -inf * 0 = NaN, as
  // jax.nn's formulas give. x / (1 + exp(-x)) is x * sigmoid(x) in one division.
  if (Mode == kSilu) return x / (1.0f + expf(-x));
  // 0.5 x erfc(-x / sqrt 2), as jax.nn.gelu(approximate=False) computes it (no 1 + erf(..)
  // cancelling to 0 for negative x).
  if (Mode == kGelu) return (0.5f * x) * erfcf(-x * 0.70710678118654752f);
  // 0.5 x (1 + tanh(u)) is x sigmoid(2u), which does not cancel for negative u (jax.nn's tanh
  // form rounds gelu_tanh(-5) to 0). x^3 may overflow to +-inf: then u is, and y is x or -0.
  if (Mode == kGeluTanh) {
    const float u = 0.79788456080286536f * (x + 0.044715f * (x * x * x));
    return x / (1.0f + expf(-2.0f * u));
  }
  // relu6(x + 3) / 6, NaN passing through as in clipped_relu; hardswish is x times it.
  if (Mode == kHardswish || Mode == kHardsigmoid) {
    const float r = min_nan(max_nan(x + 3.0f, 0.0f), 6.0f);
    return Mode == kHardswish ? x * (r / 6.0f) : r / 6.0f;
  }
  // x tanh(softplus(x)), softplus as softrelu computes it: for large x, tanh(x) == 1, y == x.
  if (Mode == kMish) return x * tanhf(fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
  return x;
}

// Runtime-dispatched form, for code paths that are not specialized on the mode.
JF_HD float activate_dynamic(int mode, float x, float a, float b, float g) {
  switch (mode) {
    case kLogistic: return activate<kLogistic>(x, a, b, g);
    case kTanh: return activate<kTanh>(x, a, b, g);
    case kRelu: return activate<kRelu>(x, a, b, g);
    case kSoftrelu: return activate<kSoftrelu>(x, a, b, g);
    case kAbs: return activate<kAbs>(x, a, b, g);
    case kPower: return activate<kPower>(x, a, b, g);
    case kClippedRelu: return activate<kClippedRelu>(x, a, b, g);
    case kLeakyRelu: return activate<kLeakyRelu>(x, a, b, g);
    case kElu: return activate<kElu>(x, a, b, g);
    case kSilu: return activate<kSilu>(x, a, b, g);
    case kGelu: return activate<kGelu>(x, a, b, g);
    case kGeluTanh: return activate<kGeluTanh>(x, a, b, g);
    case kHardswish: return activate<kHardswish>(x, a, b, g);
    case kHardsigmoid: return activate<kHardsigmoid>(x, a, b, g);
    case kMish: return activate<kMish>(x, a, b, g);
    default: return x;
  }
}

JF_HD bool jf_isfinite(float x) { return fabsf(x) <= 3.402823466e+38f; }  // false for NaN

// Batch-norm inference as v -> (v - center) * mul + add. Folded, it is one multiply-add:
// center = 0, mul = scale / sqrt(var + eps), add = shift - mean * mul. Where that fold is not
// finite (var + eps == 0, an infinite scale, an overflow), it would give inf - inf = NaN for
// the whole channel; such a channel keeps the formula's order instead (center = mean,
// add = shift), so it gives what scale * (v - mean) / sqrt(var + eps) + shift gives: +-inf,
// and NaN only where v == mean.
struct BnFold {
  float center, mul, add;
  // A plain multiply-add, which composes with neighbouring affine steps (CPU epilogue).
  JF_HD bool plain() const { return center == 0.0f && jf_isfinite(mul) && jf_isfinite(add); }
};

JF_HD BnFold bn_fold(float scale, float shift, float mean, float var, float eps) {
  const float mul = scale * jf_rsqrt(var + eps);
  const float add = shift - mean * mul;
  if (jf_isfinite(mul) && jf_isfinite(add)) return BnFold{0.0f, mul, add};
  return BnFold{mean, mul, shift};
}

JF_HD float bn_apply(float v, const BnFold& bn) { return (v - bn.center) * bn.mul + bn.add; }

}  // namespace jaxfuse
