// Float32 vectors as GCC/Clang vector types, shared by the register tiles (conv_cpu.cc) and the
// 16-bit single pass (pass16_*.cc). Everything here is always inlined into its caller, so it
// takes the caller's instruction set (each of those files compiles its loops for several).
#pragma once

#include <cstring>

#include "cpu/multiversion.h"
#include "kernels/epilogue.h"

namespace jaxfuse::cpu {

typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

template <class V>
using MaskOf = decltype(V{} > V{});

template <class V>
JF_ALWAYS_INLINE V LoadVec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// The single-pass activations on vectors, branch-free (as activate() in kernels/epilogue.h,
// NaN inputs passing through; callers take the scalar path for a NaN clipped_relu alpha).
template <int Mode, class V>
JF_ALWAYS_INLINE V ActivateVec(V x, V alpha) {
  using M = MaskOf<V>;
  const V zero = V{};
  if constexpr (Mode == kRelu || Mode == kClippedRelu) {
    const V r = (V)((M)x & ~(x < zero));  // x < 0 ? 0 : x
    if constexpr (Mode == kRelu) return r;
    const M clip = r > alpha;  // false for NaN
    return (V)(((M)alpha & clip) | ((M)r & ~clip));
  } else if constexpr (Mode == kLeakyRelu) {
    const M positive = x > zero;
    return (V)(((M)x & positive) | ((M)(alpha * x) & ~positive));
  } else if constexpr (Mode == kHardswish || Mode == kHardsigmoid) {
    const V six = zero + 6.0f;
    V r = x + 3.0f;
    r = (V)((M)r & ~(r < zero));  // r < 0 ? 0 : r
    const M clip = r > six;       // false for NaN
    r = (V)(((M)six & clip) | ((M)r & ~clip)) / six;
    if constexpr (Mode == kHardswish) return x * r;
    return r;
  } else {
    return x;
  }
}

}  // namespace jaxfuse::cpu
