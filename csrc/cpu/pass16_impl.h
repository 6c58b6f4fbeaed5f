// The 16-bit single pass (pass16.h) as templates over the vector width. Included by one file per
// instruction set, each compiled with that set's flags (CMakeLists.txt), so everything here is
// in an unnamed namespace: each file keeps its own copies, and no AVX-512 code can be linked
// into a caller of the AVX2 entry.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/epilogue_cpu.h"
#include "cpu/vec.h"
#include "kernels/epilogue.h"

namespace jaxfuse::cpu {
namespace {

// A vector of L float32 lanes, the same lanes as uint32 and as the 16-bit values in memory.
template <int L>
struct Lanes;

template <>
struct Lanes<16> {
  using F = Vec16;
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
#ifdef __AVX512F__
  static JF_ALWAYS_INLINE F HalfToFloat(H h) {
    __m256i bits;
    std::memcpy(&bits, &h, sizeof bits);
    return (F)_mm512_cvtph_ps(bits);
  }
  static JF_ALWAYS_INLINE H FloatToHalf(F f) {
    const __m256i bits = _mm512_cvtps_ph((__m512)f, _MM_FROUND_TO_NEAREST_INT);
    H h;
    std::memcpy(&h, &bits, sizeof h);
    return h;
  }
#endif
};

template <>
struct Lanes<8> {
  using F = Vec8;
  typedef uint32_t U __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
#ifdef __F16C__
  static JF_ALWAYS_INLINE F HalfToFloat(H h) {
    __m128i bits;
    std::memcpy(&bits, &h, sizeof bits);
    return (F)_mm256_cvtph_ps(bits);
  }
  static JF_ALWAYS_INLINE H FloatToHalf(F f) {
    const __m128i bits = _mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT);
    H h;
    std::memcpy(&h, &bits, sizeof h);
    return h;
  }
#endif
};

// 16-bit values <-> float32 lanes. bfloat16 rounds to nearest even and keeps NaNs NaN (quieted),
// as FloatToBf16Select in convert.h; float16 through F16C, as HalfRowToFloat / FloatRowToHalf.
template <int L, DType D>
JF_ALWAYS_INLINE typename Lanes<L>::F Load16(const uint16_t* p) {
  using T = Lanes<L>;
  typename T::H h;
  std::memcpy(&h, p, sizeof h);
  if constexpr (D == DType::kF16) {
    return T::HalfToFloat(h);
  } else {
    return (typename T::F)(__builtin_convertvector(h, typename T::U) << 16);
  }
}

template <int L, DType D>
JF_ALWAYS_INLINE void Store16(uint16_t* p, typename Lanes<L>::F f) {
  using T = Lanes<L>;
  typename T::H h;
  if constexpr (D == DType::kF16) {
    h = T::FloatToHalf(f);
  } else {
    const typename T::U u = (typename T::U)f;
    const typename T::U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const typename T::U quiet = (u >> 16) | 0x40u;
    h = __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded,
                                typename T::H);
  }
  std::memcpy(p, &h, sizeof h);
}

template <int L, DType D, bool kFromInput, bool kSide, int kAct, bool kPerRow>
void Rows(const Block& b, const FastArgs& f) {
  using V = typename Lanes<L>::F;
  const auto* x = static_cast<const uint16_t*>(f.input);
  const auto* z = static_cast<const uint16_t*>(f.side);
  auto* y = static_cast<uint16_t*>(f.y);
  const V alpha = V{} + f.alpha;
  // One vector: x * scale + shift (+ side_alpha * z), activated.
  auto step = [&](V u, V s, V t, const uint16_t* zp) {
    u = u * s + t;
    if constexpr (kSide) u += f.side_alpha * Load16<L, D>(zp);
    return ActivateVec<kAct>(u, alpha);
  };
  for (int64_t r = 0; r < b.rows; ++r) {
    const int64_t at = b.offset + r * b.out_row;
    const float* v = b.values + r * b.ld;
    const float* sc = f.scale + b.channel + (kPerRow ? r : 0);
    const float* sh = f.shift + b.channel + (kPerRow ? r : 0);
    V s = V{} + sc[0], t = V{} + sh[0];
    int64_t c = 0;
    for (; c + L <= b.cols; c += L) {
      const V u = kFromInput ? Load16<L, D>(x + at + c) : LoadVec<V>(v + c);
      if constexpr (!kPerRow) {
        s = LoadVec<V>(sc + c);
        t = LoadVec<V>(sh + c);
      }
      Store16<L, D>(y + at + c, step(u, s, t, kSide ? z + at + c : nullptr));
    }
    if (c == b.cols) continue;
    // The last partial vector through zero-filled copies.
    const int64_t n = b.cols - c;
    alignas(64) uint16_t in[L] = {}, side[L] = {}, out[L];
    alignas(64) float vals[L] = {}, scales[L] = {}, shifts[L] = {};
    if (kFromInput) std::memcpy(in, x + at + c, n * sizeof(uint16_t));
    if (!kFromInput) std::memcpy(vals, v + c, n * sizeof(float));
    if (kSide) std::memcpy(side, z + at + c, n * sizeof(uint16_t));
    if constexpr (!kPerRow) {
      std::memcpy(scales, sc + c, n * sizeof(float));
      std::memcpy(shifts, sh + c, n * sizeof(float));
      s = LoadVec<V>(scales);
      t = LoadVec<V>(shifts);
    }
    const V u = kFromInput ? Load16<L, D>(in) : LoadVec<V>(vals);
    Store16<L, D>(out, step(u, s, t, side));
    std::memcpy(y + at + c, out, n * sizeof(uint16_t));
  }
}

template <int L, DType D, bool kFromInput, bool kSide, int kAct>
JF_ALWAYS_INLINE void RowsFor(const Block& b, const FastArgs& f) {
  if (b.channel_per_row) {
    Rows<L, D, kFromInput, kSide, kAct, true>(b, f);
  } else {
    Rows<L, D, kFromInput, kSide, kAct, false>(b, f);
  }
}

template <int L, DType D, bool kFromInput>
bool ByChain(const Block& b, const FastArgs& f, bool side, int act) {
#define JF_CHAIN(ACT)                                        \
  case ACT:                                                  \
    side ? RowsFor<L, D, kFromInput, true, ACT>(b, f)        \
         : RowsFor<L, D, kFromInput, false, ACT>(b, f);      \
    return true
  switch (act) {
    JF_CHAIN(kPassthru);
    JF_CHAIN(kRelu);
    JF_CHAIN(kClippedRelu);
    JF_CHAIN(kLeakyRelu);
    JF_CHAIN(kHardswish);
    JF_CHAIN(kHardsigmoid);
    default: return false;
  }
#undef JF_CHAIN
}

template <int L>
bool Pass16Lanes(const Block& b, const FastArgs& f, DType dtype, bool from_input, bool side,
                 int act) {
  // NHWC rows narrower than a vector: the portable loops pack several rows per conversion.
  if (!b.channel_per_row && b.cols < L) return false;
  // A NaN clipped_relu alpha: ActivateVec's one comparison would not propagate it.
  if (act == kClippedRelu && f.alpha != f.alpha) return false;
  if (dtype == DType::kF16) {
    return from_input ? ByChain<L, DType::kF16, true>(b, f, side, act)
                      : ByChain<L, DType::kF16, false>(b, f, side, act);
  }
  if (dtype == DType::kBF16) {
    return from_input ? ByChain<L, DType::kBF16, true>(b, f, side, act)
                      : ByChain<L, DType::kBF16, false>(b, f, side, act);
  }
  return false;
}

}  // namespace
}  // namespace jaxfuse::cpu
