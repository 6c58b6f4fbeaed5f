// Direct convolution: one output element per thread, every geometry the plan API accepts
// (strides, asymmetric or negative padding, dilation, groups, any filter layout). The
// reference GPU path: always applicable, exact fp32 accumulation, and the fallback when a
// faster kernel does not apply (e.g. misaligned buffers).
#pragma once

namespace jaxfuse {
namespace kernels {

using namespace plan;

JF_DEVICE i64 x_offset(i64 n, i64 c, i64 h, i64 w) {
  return kNHWC ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
}

// Filter element (output channel k, input channel ci within its group, tap r, s).
JF_DEVICE i64 w_offset(i64 k, i64 ci, i64 r, i64 s) {
  if (kFilterLayout == kFilterOIHW) return ((k * CG + ci) * R + r) * S + s;
  if (kFilterLayout == kFilterHWIO) return ((r * S + s) * CG + ci) * K + k;
  return ((k * R + r) * S + s) * CG + ci;  // OHWI
}

}  // namespace kernels
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(256) jaxfuse_conv_direct(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::kernels;
  typedef Io::type T;
  const Epilogue ep(p);
  const T* JF_RESTRICT x = static_cast<const T*>(p.x);
  const FilterIo::type* JF_RESTRICT w = static_cast<const FilterIo::type*>(p.w);
  T* JF_RESTRICT y = static_cast<T*>(p.y);
  for (i64 idx = global_thread_index(); idx < kOutElements; idx += global_thread_count()) {
    // Consecutive threads write consecutive output elements, in the output's own layout.
    i64 n, k, oh, ow, t = idx;
    if (kOutNHWC) {
      k = t % K; t /= K;
      ow = t % Q; t /= Q;
      oh = t % P; n = t / P;
    } else {
      ow = t % Q; t /= Q;
      oh = t % P; t /= P;
      k = t % K; n = t / K;
    }
    const i64 group = k / KG;
    float acc = 0.0f;
    for (int r = 0; r < R; ++r) {
      const i64 ih = oh * SH - PT + r * DH;
      if (ih < 0 || ih >= H) continue;
      for (int s = 0; s < S; ++s) {
        const i64 iw = ow * SW - PL + s * DW;
        if (iw < 0 || iw >= W) continue;
        for (i64 ci = 0; ci < CG; ++ci) {
          acc += Io::load(x[x_offset(n, group * CG + ci, ih, iw)]) *
                 filter_value(w[w_offset(k, ci, r, s)]);
        }
      }
    }
    y[idx] = Io::store(ep.apply(acc, ep.channel(k), idx % kPerSample, idx));
  }
}
