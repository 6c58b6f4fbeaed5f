// jaxfuse_convert_many: many float conversions (float32, float16, bfloat16, any pair) in one
// launch. The host passes a table of segments (convert_table.h) by value; the grid walks the
// items of all segments with a grid-stride loop, so a few large filters and many small ones
// share the launch evenly.
//
// Every element is converted as XLA converts it: with the instructions XLA's code generator
// (LLVM's NVPTX backend) emits on NVIDIA GPUs, cvt.rn.bf16.f32 / cvt.rn.f16.f32 (round to
// nearest even) and cvt.f32.f16 / cvt.f32.bf16 (exact), denormals kept (no flush to zero), and
// between the two 16-bit types through float32 (exact), as XLA converts them, so results are
// bit-identical to the unfused program's.
// A fixed kernel, compiled once per device; it includes only portable.h and convert_table.h.
#pragma once

namespace jaxfuse {
namespace convert {

constexpr int kF32 = 0, kF16 = 1, kBF16 = 2;

// bfloat16 -> float32 is exact; on NVIDIA GPUs with the instruction LLVM selects for it
// (cvt.f32.bf16, sm_80+), so that even NaN payloads come out as XLA's do.
JF_DEVICE float widen_bf16(u16 h) {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float f;
  asm("cvt.f32.bf16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return bf16_to_float(h);
#endif
}

template <int Code>
JF_DEVICE float widen(u32 bits) {
  if (Code == kF32) return bits_to_float(bits);
  if (Code == kF16) return half_to_float(u16(bits));
  return widen_bf16(u16(bits));
}

template <int Code>
JF_DEVICE u32 narrow(float value) {
  if (Code == kF32) return float_to_bits(value);
  if (Code == kF16) return float_to_half(value);
  return float_to_bf16(value);
}

template <int Src, int Dst>
JF_DEVICE u32 convert(u32 bits) {
  return narrow<Dst>(widen<Src>(bits));
}

// Loads kConvertChunk elements of a 16-byte aligned buffer as raw bits, one per lane.
template <int Code>
JF_DEVICE void load_chunk(const void* base, i64 chunk, u32 (&lanes)[kConvertChunk]) {
  if (Code == kF32) {  // 32 bytes: two vectors
    const Vec16* p = static_cast<const Vec16*>(base) + 2 * chunk;
    const Vec16 a = p[0], b = p[1];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lanes[j] = a.v[j];
      lanes[4 + j] = b.v[j];
    }
  } else {  // 16 bytes: two 16-bit values per word, the lower one first
    const Vec16 a = static_cast<const Vec16*>(base)[chunk];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lanes[2 * j] = a.v[j] & 0xffffu;
      lanes[2 * j + 1] = a.v[j] >> 16;
    }
  }
}

template <int Code>
JF_DEVICE void store_chunk(void* base, i64 chunk, const u32 (&lanes)[kConvertChunk]) {
  if (Code == kF32) {
    Vec16 a, b;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a.v[j] = lanes[j];
      b.v[j] = lanes[4 + j];
    }
    Vec16* p = static_cast<Vec16*>(base) + 2 * chunk;
    p[0] = a;
    p[1] = b;
  } else {
    Vec16 a;
#pragma unroll
    for (int j = 0; j < 4; ++j) a.v[j] = (lanes[2 * j] & 0xffffu) | (lanes[2 * j + 1] << 16);
    static_cast<Vec16*>(base)[chunk] = a;
  }
}

template <int Code>
JF_DEVICE u32 load_one(const void* base, i64 i) {
  if (Code == kF32) return static_cast<const u32*>(base)[i];
  return static_cast<const u16*>(base)[i];
}

template <int Code>
JF_DEVICE void store_one(void* base, i64 i, u32 bits) {
  if (Code == kF32) {
    static_cast<u32*>(base)[i] = bits;
  } else {
    static_cast<u16*>(base)[i] = u16(bits);
  }
}

// One item of a segment: a whole chunk (vector loads and stores) or one element.
template <int Src, int Dst>
JF_DEVICE void convert_item(const ConvertSegment& s, i64 item, i64 chunks) {
  if (item < chunks) {
    u32 lanes[kConvertChunk];
    load_chunk<Src>(s.src, item, lanes);
#pragma unroll
    for (int j = 0; j < kConvertChunk; ++j) lanes[j] = convert<Src, Dst>(lanes[j]);
    store_chunk<Dst>(s.dst, item, lanes);
  } else {
    const i64 i = chunks * kConvertChunk + (item - chunks);
    store_one<Dst>(s.dst, i, convert<Src, Dst>(load_one<Src>(s.src, i)));
  }
}

JF_DEVICE void convert_item(const ConvertSegment& s, i64 item) {
  const int src = s.codes & 15, dst = (s.codes >> 4) & 15;
  const bool vectorized = (s.codes >> 8) & 1;
  const i64 chunks = vectorized ? s.elements / kConvertChunk : 0;
  switch (src * 3 + dst) {
    case kF32 * 3 + kF16: convert_item<kF32, kF16>(s, item, chunks); break;
    case kF32 * 3 + kBF16: convert_item<kF32, kBF16>(s, item, chunks); break;
    case kF16 * 3 + kF32: convert_item<kF16, kF32>(s, item, chunks); break;
    case kF16 * 3 + kBF16: convert_item<kF16, kBF16>(s, item, chunks); break;
    case kBF16 * 3 + kF32: convert_item<kBF16, kF32>(s, item, chunks); break;
    case kBF16 * 3 + kF16: convert_item<kBF16, kF16>(s, item, chunks); break;
    default: break;  // the host never sends a pair that is not a conversion
  }
}

}  // namespace convert
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(256) jaxfuse_convert_many(
    const jaxfuse::ConvertTable table) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  // Items grow along the loop, so the segment index only moves forward.
  int s = 0;
  for (i64 item = global_thread_index(); item < table.items; item += global_thread_count()) {
    while (s + 1 < table.count && item >= table.segments[s + 1].first) ++s;
    convert::convert_item(table.segments[s], item - table.segments[s].first);
  }
}
