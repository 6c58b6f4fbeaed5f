#include "cpu/convert.h"

#include "cpu/multiversion.h"

#ifdef JF_HAVE_X86_LEVELS
#include <immintrin.h>
#endif

namespace jaxfuse::cpu {
namespace {

void HalfRowPortable(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloatSelect(src[i]);
}
void FloatRowPortable(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalfSelect(src[i]);
}

#ifdef JF_HAVE_X86_LEVELS
// F16C converts exactly as the functions in convert.h do (NaN payloads aside), with every
// rounding to nearest even and subnormals kept whatever MXCSR says.
__attribute__((target("avx2,f16c"))) void HalfRowF16c(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = HalfToFloatSelect(src[i]);
}
__attribute__((target("avx2,f16c"))) void FloatRowF16c(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = FloatToHalfSelect(src[i]);
}
#endif

struct HalfRows {
  void (*to_float)(const uint16_t*, int64_t, float*) = HalfRowPortable;
  void (*to_half)(const float*, int64_t, uint16_t*) = FloatRowPortable;
};

const HalfRows& Rows() {
  static const HalfRows rows = [] {
    HalfRows r;
#ifdef JF_HAVE_X86_LEVELS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      r.to_float = HalfRowF16c;
      r.to_half = FloatRowF16c;
    }
#endif
    return r;
  }();
  return rows;
}

}  // namespace

void HalfRowToFloat(const uint16_t* src, int64_t n, float* dst) { Rows().to_float(src, n, dst); }
void FloatRowToHalf(const float* src, int64_t n, uint16_t* dst) { Rows().to_half(src, n, dst); }

}  // namespace jaxfuse::cpu
