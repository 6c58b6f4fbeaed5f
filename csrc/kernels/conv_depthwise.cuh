// Depthwise convolution (one input and one output channel per group), NHWC: each thread
// computes one output pixel for 16 bytes' worth of consecutive channels, reading input and
// filter taps as 16-byte vectors; neighbouring threads share input rows through L1. Filters
// are HWIO (R, S, 1, C). Requires C % lanes == 0 and 16-byte aligned buffers.
#pragma once

namespace jaxfuse {
namespace depthwise {

using namespace plan;
typedef Io::type T;
constexpr int kLanes = sizeof(Vec16) / sizeof(T);
constexpr i64 kChannelVectors = C / kLanes;
constexpr i64 kWork = N * P * Q * kChannelVectors;
static_assert(C % kLanes == 0 && K == C && G == C, "depthwise, whole channel vectors");

}  // namespace depthwise
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(256) jaxfuse_conv_depthwise(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::depthwise;
  const Epilogue ep(p);
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  T* y = static_cast<T*>(p.y);
  for (i64 item = global_thread_index(); item < kWork; item += global_thread_count()) {
    const i64 cv = item % kChannelVectors, pixel = item / kChannelVectors;
    const i64 ow = pixel % Q, oh = (pixel / Q) % P, n = pixel / (P * Q);
    const i64 c0 = cv * kLanes;
    float acc[kLanes];
#pragma unroll
    for (int j = 0; j < kLanes; ++j) acc[j] = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const i64 ih = oh * SH - PT + r * DH;
      if (ih < 0 || ih >= H) continue;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const i64 iw = ow * SW - PL + s * DW;
        if (iw < 0 || iw >= W) continue;
        const Vec16 xv = *reinterpret_cast<const Vec16*>(x + ((n * H + ih) * W + iw) * C + c0);
        const Vec16 wv = *reinterpret_cast<const Vec16*>(w + (r * S + s) * C + c0);
        const T* xs = reinterpret_cast<const T*>(&xv);
        const T* ws = reinterpret_cast<const T*>(&wv);
#pragma unroll
        for (int j = 0; j < kLanes; ++j) acc[j] += Io::load(xs[j]) * Io::load(ws[j]);
      }
    }
    const i64 out = pixel * K + c0;
    Vec16 packed;
    T* lanes = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < kLanes; ++j) {
      lanes[j] = Io::store(ep.apply(acc[j], ep.channel(c0 + j), out % kPerSample + j, out + j));
    }
    *reinterpret_cast<Vec16*>(y + out) = packed;
  }
}
