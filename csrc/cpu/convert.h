// Scalar conversions between float32 and the 16-bit float formats, round-to-nearest-even,
// with NaN, infinity and subnormals handled (no reliance on compiler _Float16 support).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/plan_spec.h"

namespace jaxfuse::cpu {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t FloatToHalf(float f) {
  uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t out;
  if (u >= 0x47800000u) {  // >= 65536, infinity or NaN
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // result is subnormal or zero: let float addition round
    const uint32_t magic = 126u << 23;  // 0.5: aligns the half's subnormal step with the ulp
    out = FloatBits(BitsFloat(u) + BitsFloat(magic)) - magic;
  } else {  // normal: rebias the exponent, round the 13 dropped bits to nearest even
    const uint32_t odd = (u >> 13) & 1u;
    u += (uint32_t(15 - 127) << 23) + 0xfffu + odd;
    out = u >> 13;
  }
  return static_cast<uint16_t>(out | sign);
}

// Branch-free forms of the conversions above, bit-identical to them (NaN payloads aside: every
// NaN becomes the canonical quiet NaN), written so that loops over rows vectorize.
inline float HalfToFloatSelect(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  // Subnormal: (2^-14 + m * 2^-24) - 2^-14, exact. Blended with masks rather than selects so
  // that the compiler keeps the loop branch-free (and vectorizes it).
  const uint32_t subnormal =
      FloatBits(BitsFloat((113u << 23) | (mantissa << 13)) - BitsFloat(113u << 23));
  const uint32_t special = 0x7f800000u | (mantissa << 13);
  const uint32_t normal = ((exponent + 112) << 23) | (mantissa << 13);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(exponent == 0);
  const uint32_t is_special = 0u - static_cast<uint32_t>(exponent == 31);
  const uint32_t bits = (subnormal & is_sub) | (special & is_special) |
                        (normal & ~(is_sub | is_special));
  return BitsFloat(sign | bits);
}

inline uint16_t FloatToHalfSelect(float f) {
  const uint32_t bits = FloatBits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t u = bits & 0x7fffffffu;
  const uint32_t special = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  const uint32_t magic = 126u << 23;
  const uint32_t subnormal = FloatBits(BitsFloat(u) + BitsFloat(magic)) - magic;
  const uint32_t normal = (u + (uint32_t(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= 0x47800000u ? special : u < 0x38800000u ? subnormal : normal;
  return static_cast<uint16_t>(out | sign);
}

inline uint16_t FloatToBf16Select(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// Rows of float16 <-> float32: F16C where the CPU has it, else the branch-free forms above.
void HalfRowToFloat(const uint16_t* src, int64_t n, float* dst);
void FloatRowToHalf(const float* src, int64_t n, uint16_t* dst);

inline float LoadAsFloat(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[index];
    case DType::kF16: return HalfToFloat(static_cast<const uint16_t*>(base)[index]);
    case DType::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
  }
  return 0.0f;
}

// Row conversions, inlined into the caller so that they vectorize for its target.
// Converts `count` elements starting at `index` to float32.
inline void LoadRow(const void* base, int64_t index, DType dtype, int64_t count, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(base) + index, count * sizeof(float));
      break;
    case DType::kF16:
      HalfRowToFloat(static_cast<const uint16_t*>(base) + index, count, out);
      break;
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + index;
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(src[i]);
      break;
    }
  }
}

// Stores `count` float32 values at elements `index`.. of `base`, rounding to its dtype.
inline void StoreRow(const float* values, int64_t count, DType dtype, void* base, int64_t index) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(static_cast<float*>(base) + index, values, count * sizeof(float));
      break;
    case DType::kF16:
      FloatRowToHalf(values, count, static_cast<uint16_t*>(base) + index);
      break;
    case DType::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + index;
      for (int64_t i = 0; i < count; ++i) dst[i] = FloatToBf16Select(values[i]);
      break;
    }
  }
}

}  // namespace jaxfuse::cpu
