#include "cpu/conv_direct_cpu.h"

#include <algorithm>
#include <vector>

#include "cpu/convert.h"
#include "cpu/multiversion.h"
#include "cpu/thread_pool.h"

namespace jaxfuse::cpu {
namespace {

constexpr int64_t kBlockFloats = 16384;  // results handed to the epilogue at once (64 KiB)

// Taps [lo, hi) of one window dimension that land inside the input: tap t reads coordinate
// base + t * dilation, where base = output coordinate * stride - padding.
struct TapRange {
  int64_t lo, hi;
};

TapRange InsideTaps(int64_t base, int64_t dilation, int64_t taps, int64_t size) {
  const int64_t lo = base >= 0 ? 0 : (-base + dilation - 1) / dilation;
  const int64_t hi = base >= size ? 0 : std::min(taps, (size - 1 - base) / dilation + 1);
  return {std::min(lo, hi), hi};
}

// Filters as float32 [group][tap][input channel][group's output channel], so that the inner
// loop runs along output channels.
std::vector<float> PackFilters(const PlanSpec& spec, const void* w) {
  const ConvGeometry& g = spec.conv;
  const int64_t cg = spec.c / g.groups, kg = g.k / g.groups, taps = g.r * g.s;
  std::vector<float> packed(g.k * cg * taps);
  ParallelFor(g.k, [&](int64_t o) {
    const int64_t group = o / kg, within = o % kg;
    for (int64_t ci = 0; ci < cg; ++ci) {
      for (int64_t t = 0; t < taps; ++t) {
        const int64_t y = t / g.s, x = t % g.s;
        int64_t index = 0;
        switch (g.filter_layout) {
          case FilterLayout::kOIHW: index = ((o * cg + ci) * g.r + y) * g.s + x; break;
          case FilterLayout::kHWIO: index = ((y * g.s + x) * cg + ci) * g.k + o; break;
          case FilterLayout::kOHWI: index = ((o * g.r + y) * g.s + x) * cg + ci; break;
        }
        packed[((group * taps + t) * cg + ci) * kg + within] = LoadAsFloat(w, index, spec.dtype);
      }
    }
  });
  return packed;
}

// acc[p * K + k] = the convolution at output pixels (b, oy, ox0 + p), p < count.
JF_MULTIVERSION void ConvolvePixels(const PlanSpec& spec, const float* filters, const void* x,
                                    int64_t b, int64_t oy, int64_t ox0, int64_t count,
                                    float* acc) {
  const ConvGeometry& g = spec.conv;
  const int64_t cg = spec.c / g.groups, kg = g.k / g.groups, taps = g.r * g.s;
  const bool nhwc = spec.layout == Layout::kNHWC;
  const int64_t iy0 = oy * g.stride_h - g.pad_t;
  const TapRange rows = InsideTaps(iy0, g.dil_h, g.r, spec.h);
  std::fill(acc, acc + count * g.k, 0.0f);
  for (int64_t p = 0; p < count; ++p) {
    const int64_t ix0 = (ox0 + p) * g.stride_w - g.pad_l;
    const TapRange cols = InsideTaps(ix0, g.dil_w, g.s, spec.w);
    for (int64_t group = 0; group < g.groups; ++group) {
      float* __restrict out = acc + p * g.k + group * kg;
      for (int64_t y = rows.lo; y < rows.hi; ++y) {
        const int64_t iy = iy0 + y * g.dil_h;
        for (int64_t xt = cols.lo; xt < cols.hi; ++xt) {
          const int64_t ix = ix0 + xt * g.dil_w;
          const float* wt = filters + (group * taps + y * g.s + xt) * cg * kg;
          for (int64_t ci = 0; ci < cg; ++ci) {
            const int64_t ch = group * cg + ci;
            const int64_t at = nhwc ? ((b * spec.h + iy) * spec.w + ix) * spec.c + ch
                                    : ((b * spec.c + ch) * spec.h + iy) * spec.w + ix;
            const float v = LoadAsFloat(x, at, spec.dtype);
            const float* __restrict wr = wt + ci * kg;
            for (int64_t k = 0; k < kg; ++k) out[k] += v * wr[k];
          }
        }
      }
    }
  }
}

}  // namespace

void RunDirectConvolution(const PlanSpec& spec, const FusedParams& buf, const Epilogue& ep) {
  const std::vector<float> filters = PackFilters(spec, buf.w);
  const int64_t k = spec.out_c, oh = spec.out_h, ow = spec.out_w, plane = oh * ow;
  const int64_t per_block = std::clamp<int64_t>(kBlockFloats / k, 1, ow);
  const int64_t blocks_per_row = (ow + per_block - 1) / per_block;
  const bool nhwc = spec.layout == Layout::kNHWC;
  ParallelFor(spec.n * oh * blocks_per_row, [&](int64_t task) {
    const int64_t row = task / blocks_per_row, b = row / oh, oy = row % oh;
    const int64_t ox0 = task % blocks_per_row * per_block;
    const int64_t count = std::min(per_block, ow - ox0);
    thread_local std::vector<float> acc, transposed;
    acc.resize(count * k);
    ConvolvePixels(spec, filters.data(), buf.x, b, oy, ox0, count, acc.data());
    const int64_t pixel = oy * ow + ox0;
    if (nhwc) {  // a row per pixel, channels along it
      ep.Apply({acc.data(), count, k, k, (b * plane + pixel) * k, k, 0, false, pixel * k, k});
      return;
    }
    transposed.resize(count * k);  // a row per channel, pixels along it
    for (int64_t c = 0; c < k; ++c)
      for (int64_t p = 0; p < count; ++p) transposed[c * count + p] = acc[p * k + c];
    ep.Apply({transposed.data(), k, count, count, b * k * plane + pixel, plane, 0, true, pixel,
              plane});
  });
}

}  // namespace jaxfuse::cpu
