// CPU fused chain. A convolution runs as an implicit GEMM over a zero-padded NHWC float32 copy
// of the input and a packed copy of the filters: each task computes a row of output pixels
// for a block of 16 output channels, kPix pixels at a time in vector registers, then hands the
// tile to the shared epilogue, which stores it once in the output's dtype and layout.
#include "cpu/fused_cpu.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "common/debug.h"
#include "cpu/convert.h"
#include "cpu/epilogue_cpu.h"
#include "cpu/thread_pool.h"

// Hot loops are compiled for several x86 levels and picked at load time, so one portable
// build uses AVX-512 or AVX2+FMA where the machine has them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JF_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JF_MULTIVERSION
#endif

namespace jaxfuse::cpu {
namespace {

constexpr int kVec = 16;  // output channels per register tile
constexpr int kPix = 6;   // output pixels per register tile
typedef float v16 __attribute__((vector_size(kVec * sizeof(float))));

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using Scratch = std::unique_ptr<float[], AlignedFree>;

Scratch Allocate(int64_t floats) {
  // Sizes come from a validated plan, but a product of them can still be absurd: refuse
  // rather than let the byte count wrap around.
  if (floats < 0 || floats > (int64_t{1} << 60)) {
    throw std::runtime_error("jaxfuse CPU backend: scratch of " + std::to_string(floats) +
                             " floats is too large");
  }
  const size_t bytes = ((static_cast<size_t>(floats) * sizeof(float) + 63) / 64 + 1) * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) {
    throw std::runtime_error("jaxfuse CPU backend: out of memory for " + std::to_string(bytes) +
                             " bytes of scratch");
  }
  std::memset(p, 0, bytes);
  return Scratch(static_cast<float*>(p));
}

inline v16 LoadV(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Sizes of one convolution, in the padded coordinates of the packed input.
struct Conv {
  int64_t n, c, h, w, k, r, s, sh, sw, pt, pl, dh, dw, groups, cg, kg, kblocks, hp, wp, oh, ow;
  bool nchw;

  explicit Conv(const PlanSpec& p)
      : n(p.n), c(p.c), h(p.h), w(p.w), k(p.conv.k), r(p.conv.r), s(p.conv.s),
        sh(p.conv.stride_h), sw(p.conv.stride_w), pt(p.conv.pad_t), pl(p.conv.pad_l),
        dh(p.conv.dil_h), dw(p.conv.dil_w), groups(p.conv.groups), cg(p.c / p.conv.groups),
        kg(p.conv.k / p.conv.groups), kblocks((kg + kVec - 1) / kVec),
        hp(p.h + p.conv.pad_t + p.conv.pad_b), wp(p.w + p.conv.pad_l + p.conv.pad_r),
        oh(p.out_h), ow(p.out_w), nchw(p.layout == Layout::kNCHW) {}

  // Where output pixel (b, y, x) channel ch lands, for the epilogue.
  RowPlace ChannelRow(int64_t b, int64_t y, int64_t x, int64_t ch) const {
    const int64_t plane = oh * ow;
    if (nchw) {
      return {ch, 1, ch * plane + y * ow + x, plane, ((b * k + ch) * oh + y) * ow + x, plane};
    }
    const int64_t pix = y * ow + x;
    return {ch, 1, pix * k + ch, 1, (b * oh + y) * ow * k + x * k + ch, 1};
  }
};

// Input -> float32 NHWC with explicit zero padding (negative padding crops).
void PackInput(const PlanSpec& spec, const Conv& cv, const void* x, float* xp) {
  ParallelFor(cv.n * cv.hp, [&](int64_t row) {
    const int64_t b = row / cv.hp, y = row % cv.hp, ih = y - cv.pt;
    float* dst = xp + row * cv.wp * cv.c;
    if (ih < 0 || ih >= cv.h) return;  // scratch starts zeroed
    const int64_t x0 = std::max<int64_t>(0, cv.pl), iw0 = std::max<int64_t>(0, -cv.pl);
    const int64_t count = std::min(cv.w - iw0, cv.wp - x0);
    if (count <= 0) return;
    if (!cv.nchw) {
      LoadRow(x, ((b * cv.h + ih) * cv.w + iw0) * cv.c, spec.dtype, count * cv.c,
              dst + x0 * cv.c);
      return;
    }
    float tmp[256];
    for (int64_t ch = 0; ch < cv.c; ++ch) {
      for (int64_t done = 0; done < count; done += 256) {
        const int64_t len = std::min<int64_t>(256, count - done);
        LoadRow(x, ((b * cv.c + ch) * cv.h + ih) * cv.w + iw0 + done, spec.dtype, len, tmp);
        for (int64_t i = 0; i < len; ++i) dst[(x0 + done + i) * cv.c + ch] = tmp[i];
      }
    }
  });
}

int64_t FilterIndex(const PlanSpec& spec, int64_t ko, int64_t ci, int64_t y, int64_t x) {
  const ConvGeometry& g = spec.conv;
  const int64_t cg = spec.c / g.groups;
  switch (g.filter_layout) {
    case FilterLayout::kOIHW: return ((ko * cg + ci) * g.r + y) * g.s + x;
    case FilterLayout::kHWIO: return ((y * g.s + x) * cg + ci) * g.k + ko;
    case FilterLayout::kOHWI: return ((ko * g.r + y) * g.s + x) * cg + ci;
  }
  return 0;
}

// Filters -> [group][k block][r][s][c in group][16 output channels], zero-filled past kg.
void PackFilter(const PlanSpec& spec, const Conv& cv, const void* w, float* wp) {
  ParallelFor(cv.groups * cv.kblocks, [&](int64_t blk) {
    const int64_t gi = blk / cv.kblocks, kb = blk % cv.kblocks;
    float* dst = wp + blk * cv.r * cv.s * cv.cg * kVec;
    for (int64_t y = 0; y < cv.r; ++y)
      for (int64_t x = 0; x < cv.s; ++x)
        for (int64_t ci = 0; ci < cv.cg; ++ci)
          for (int64_t j = 0; j < kVec && kb * kVec + j < cv.kg; ++j) {
            const int64_t ko = gi * cv.kg + kb * kVec + j;
            dst[((y * cv.s + x) * cv.cg + ci) * kVec + j] =
                LoadAsFloat(w, FilterIndex(spec, ko, ci, y, x), spec.dtype);
          }
  });
}

template <int P>
__attribute__((always_inline)) inline void GemmTile(const Conv& cv, const float* xbase,
                                                    const float* wblock, v16* acc) {
  for (int p = 0; p < P; ++p) acc[p] = v16{};
  const int64_t pix_stride = cv.sw * cv.c;
  for (int64_t y = 0; y < cv.r; ++y) {
    for (int64_t x = 0; x < cv.s; ++x) {
      const float* xs = xbase + (y * cv.dh * cv.wp + x * cv.dw) * cv.c;
      const float* ws = wblock + (y * cv.s + x) * cv.cg * kVec;
      for (int64_t ci = 0; ci < cv.cg; ++ci) {
        const v16 wv = LoadV(ws + ci * kVec);
        for (int p = 0; p < P; ++p) acc[p] += xs[p * pix_stride + ci] * wv;
      }
    }
  }
}

// One output row (b, oy) for one block of 16 output channels of group gi.
JF_MULTIVERSION __attribute__((flatten)) void ConvRow(const Conv& cv, const float* xp,
                                                      const float* wp, const Epilogue& ep,
                                                      int64_t b, int64_t oy, int64_t gi,
                                                      int64_t kb) {
  const float* wblock = wp + (gi * cv.kblocks + kb) * cv.r * cv.s * cv.cg * kVec;
  const int64_t ch0 = gi * cv.kg + kb * kVec;
  const int64_t nch = std::min<int64_t>(kVec, cv.kg - kb * kVec);
  v16 acc[kPix];
  alignas(64) float vals[kVec];
  for (int64_t ox = 0; ox < cv.ow; ox += kPix) {
    const float* xbase = xp + ((b * cv.hp + oy * cv.sh) * cv.wp + ox * cv.sw) * cv.c + gi * cv.cg;
    const int np = static_cast<int>(std::min<int64_t>(kPix, cv.ow - ox));
    switch (np) {
      case 6: GemmTile<6>(cv, xbase, wblock, acc); break;
      case 5: GemmTile<5>(cv, xbase, wblock, acc); break;
      case 4: GemmTile<4>(cv, xbase, wblock, acc); break;
      case 3: GemmTile<3>(cv, xbase, wblock, acc); break;
      case 2: GemmTile<2>(cv, xbase, wblock, acc); break;
      default: GemmTile<1>(cv, xbase, wblock, acc); break;
    }
    for (int p = 0; p < np; ++p) {
      std::memcpy(vals, &acc[p], sizeof(vals));
      ep.ApplyAndStore(vals, nch, cv.ChannelRow(b, oy, ox + p, ch0));
    }
  }
}

// Depthwise (one input and one output channel per group): vectorized across channels.
JF_MULTIVERSION __attribute__((flatten)) void DepthwiseRow(const Conv& cv, const float* xp,
                                                           const float* wdw, const Epilogue& ep,
                                                           int64_t b, int64_t oy) {
  alignas(64) float vals[kVec];
  const int64_t kpad = (cv.k + kVec - 1) / kVec * kVec;
  for (int64_t ox = 0; ox < cv.ow; ++ox) {
    const float* xbase = xp + ((b * cv.hp + oy * cv.sh) * cv.wp + ox * cv.sw) * cv.c;
    for (int64_t k0 = 0; k0 < cv.k; k0 += kVec) {
      v16 acc = v16{};
      for (int64_t y = 0; y < cv.r; ++y)
        for (int64_t x = 0; x < cv.s; ++x)
          acc += LoadV(xbase + (y * cv.dh * cv.wp + x * cv.dw) * cv.c + k0) *
                 LoadV(wdw + (y * cv.s + x) * kpad + k0);
      std::memcpy(vals, &acc, sizeof(vals));
      ep.ApplyAndStore(vals, std::min<int64_t>(kVec, cv.k - k0), cv.ChannelRow(b, oy, ox, k0));
    }
  }
}

void RunConv(const PlanSpec& spec, const FusedParams& buf, const Epilogue& ep) {
  const Conv cv(spec);
  // kVec floats of slack: vector loads past the last channel of the last pixel stay in bounds.
  Scratch xp = Allocate(cv.n * cv.hp * cv.wp * cv.c + kVec);
  PackInput(spec, cv, buf.x, xp.get());
  if (cv.cg == 1 && cv.kg == 1) {
    const int64_t kpad = (cv.k + kVec - 1) / kVec * kVec;
    Scratch wdw = Allocate(cv.r * cv.s * kpad);
    for (int64_t ko = 0; ko < cv.k; ++ko)
      for (int64_t y = 0; y < cv.r; ++y)
        for (int64_t x = 0; x < cv.s; ++x)
          wdw[(y * cv.s + x) * kpad + ko] =
              LoadAsFloat(buf.w, FilterIndex(spec, ko, 0, y, x), spec.dtype);
    ParallelFor(cv.n * cv.oh, [&](int64_t t) {
      DepthwiseRow(cv, xp.get(), wdw.get(), ep, t / cv.oh, t % cv.oh);
    });
    return;
  }
  Scratch wp = Allocate(cv.groups * cv.kblocks * cv.r * cv.s * cv.cg * kVec);
  PackFilter(spec, cv, buf.w, wp.get());
  const int64_t blocks = cv.groups * cv.kblocks;
  ParallelFor(cv.n * cv.oh * blocks, [&](int64_t t) {
    const int64_t blk = t % blocks, row = t / blocks;
    ConvRow(cv, xp.get(), wp.get(), ep, row / cv.oh, row % cv.oh, blk / cv.kblocks,
            blk % cv.kblocks);
  });
}

// No convolution: the epilogue over the input, in contiguous chunks.
void RunPointwise(const PlanSpec& spec, const FusedParams& buf, const Epilogue& ep) {
  constexpr int64_t kChunk = 2048;
  const int64_t plane = spec.h * spec.w;
  if (spec.layout == Layout::kNCHW) {
    const int64_t chunks_per_plane = (plane + kChunk - 1) / kChunk;
    ParallelFor(spec.n * spec.c * chunks_per_plane, [&](int64_t t) {
      const int64_t bc = t / chunks_per_plane, start = (t % chunks_per_plane) * kChunk;
      const int64_t ch = bc % spec.c, len = std::min(kChunk, plane - start);
      alignas(64) float vals[kChunk];
      const int64_t offset = bc * plane + start;
      LoadRow(buf.x, offset, spec.dtype, len, vals);
      ep.ApplyAndStore(vals, len, {ch, 0, ch * plane + start, 1, offset, 1});
    });
    return;
  }
  const int64_t pixels = spec.n * plane;
  const int64_t per_task = std::max<int64_t>(1, kChunk / spec.c);
  ParallelFor((pixels + per_task - 1) / per_task, [&](int64_t t) {
    alignas(64) float vals[kChunk];  // a pixel's channels, kChunk at a time
    for (int64_t pix = t * per_task; pix < std::min(pixels, (t + 1) * per_task); ++pix) {
      for (int64_t c0 = 0; c0 < spec.c; c0 += kChunk) {
        const int64_t offset = pix * spec.c + c0, len = std::min(kChunk, spec.c - c0);
        LoadRow(buf.x, offset, spec.dtype, len, vals);
        ep.ApplyAndStore(vals, len, {c0, 1, (pix % plane) * spec.c + c0, 1, offset, 1});
      }
    }
  });
}

}  // namespace

std::string Approx(double value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", value);
  return buf;
}

// The convolution reads a zero-padded float32 copy of the input. With strides or dilation
// that skip most of a huge padding, that copy could be far larger than anything the
// convolution reads (gigabytes of zeros, or more than the address space); such plans are
// refused. Ordinary padding (a few pixels, or dilated "SAME" padding) is far below the bound.
void CheckSupported(const PlanSpec& spec) {
  if (!spec.has_conv) return;
  const Conv cv(spec);
  const double padded = double(cv.n) * cv.hp * cv.wp * cv.c;
  const double reads = double(cv.n) * cv.c * (double(cv.oh) * cv.ow * cv.r * cv.s + cv.h * cv.w);
  if (padded > 16 * reads + double(1 << 24)) {
    throw std::invalid_argument(
        "jaxfuse CPU backend: the padding (" + std::to_string(spec.conv.pad_t) + ", " +
        std::to_string(spec.conv.pad_b) + ", " + std::to_string(spec.conv.pad_l) + ", " +
        std::to_string(spec.conv.pad_r) + ") is too large for a " + std::to_string(cv.h) + "x" +
        std::to_string(cv.w) + " input with strides " + std::to_string(cv.sh) + "x" +
        std::to_string(cv.sw) + ": the padded copy of the input would hold " + Approx(padded) +
        " values, almost all never read");
  }
}

void RunFused(const PlanSpec& spec, const FusedParams& buffers) {
  if (spec.output_elements() == 0) return;
  CheckSupported(spec);
  if (PoisonOutputs()) {
    std::memset(buffers.y, 0xff, spec.output_elements() * dtype_size(spec.dtype));
  }
  const Epilogue ep(spec, buffers);
  if (spec.has_conv) {
    RunConv(spec, buffers, ep);
  } else {
    RunPointwise(spec, buffers, ep);
  }
}

}  // namespace jaxfuse::cpu
