// The CPU convolution as an implicit GEMM. Output pixels x output channels are computed in
// register tiles (up to 14 pixels x 32 channels with AVX-512, 6 x 16 with AVX2), reading the
// input as float32 NHWC (the caller's buffer itself when it already is that and unpadded, else
// a padded copy, which UsesPaddedCopy bounds) and the filters as rows of one tile's channels (the caller's HWIO buffer
// itself when it can, else a packed copy). A tile covers part of one output row, or two whole
// rows when rows are short (7x7 layers), so small images keep the registers full. Each task
// owns a block of tiles and a range of channel blocks, sized so that its input rows and one
// channel block's filters stay in L2 while every tile of the block reuses them.
#include "cpu/conv_cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <unistd.h>
#endif

#include "cpu/conv_direct_cpu.h"
#include "cpu/convert.h"
#include "cpu/multiversion.h"
#include "cpu/thread_pool.h"
#include "cpu/vec.h"
#include "kernels/epilogue.h"

namespace jaxfuse::cpu {
namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Scratch = std::unique_ptr<float[], FreeDeleter>;

// 64-byte aligned and uninitialized: the packers write every element.
Scratch Allocate(int64_t floats) {
  // Sizes come from a validated plan, but a product of them can still be absurd: refuse
  // rather than let the byte count wrap around.
  if (floats < 0 || floats > (int64_t{1} << 60)) {
    throw std::runtime_error("jaxfuse CPU backend: scratch of " + std::to_string(floats) +
                             " floats is too large");
  }
  const size_t bytes = (static_cast<size_t>(floats) * sizeof(float) / 64 + 2) * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) {
    throw std::runtime_error("jaxfuse CPU backend: out of memory for " + std::to_string(bytes) +
                             " bytes of scratch");
  }
  return Scratch(static_cast<float*>(p));
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Filters read in place are copied per task above this size (about half of a small L2).
constexpr int64_t kCopyFilterBytes = 512 << 10;

// Bytes of L2 cache per core (what one task's working set should fit in).
int64_t L2Bytes() {
  static const int64_t bytes = [] {
#if defined(__linux__) && defined(_SC_LEVEL2_CACHE_SIZE)
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (size >= (64 << 10) && size <= (64 << 20)) return static_cast<int64_t>(size);
#endif
    return int64_t{1} << 20;
  }();
  return bytes;
}

// Sizes of one convolution, in the padded coordinates of the input view.
struct Conv {
  int64_t n, c, h, w, k, r, s, sh, sw, pt, pl, pb, pr, dh, dw, groups, cg, kg, hp, wp, oh, ow;
  bool nchw;

  explicit Conv(const PlanSpec& p)
      : n(p.n), c(p.c), h(p.h), w(p.w), k(p.conv.k), r(p.conv.r), s(p.conv.s),
        sh(p.conv.stride_h), sw(p.conv.stride_w), pt(p.conv.pad_t), pl(p.conv.pad_l),
        pb(p.conv.pad_b), pr(p.conv.pad_r), dh(p.conv.dil_h), dw(p.conv.dil_w),
        groups(p.conv.groups), cg(p.c / p.conv.groups), kg(p.conv.k / p.conv.groups),
        hp(p.h + p.conv.pad_t + p.conv.pad_b), wp(p.w + p.conv.pad_l + p.conv.pad_r),
        oh(p.out_h), ow(p.out_w), nchw(p.layout == Layout::kNCHW) {}

  int64_t taps() const { return r * s; }
};

// ---------------------------------------------------------------------------------------------
// Input: float32 NHWC in padded coordinates; element (b, y, x, ch) at
// data + b * image + y * row + x * c + ch.
struct InputView {
  const float* data;
  int64_t image, row;
};

// out[x * channels + ch] = convert(src[ch * plane + x]) for x < count, every channel.
template <class T, class Convert>
JF_ALWAYS_INLINE void TransposeChannels(const T* src, int64_t plane, int64_t channels,
                                        int64_t count, float* out, Convert convert) {
  constexpr int64_t kGroup = 16;
  for (int64_t c0 = 0; c0 < channels; c0 += kGroup) {
    const int64_t nc = std::min(kGroup, channels - c0);
    const T* s = src + c0 * plane;
    float* o = out + c0;
    if (nc == kGroup) {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = 0; c < kGroup; ++c) o[i * channels + c] = convert(s[c * plane + i]);
    } else {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = 0; c < nc; ++c) o[i * channels + c] = convert(s[c * plane + i]);
    }
  }
}

// One padded row of the copy: zeros outside the input, the input (converted) inside.
JF_MULTIVERSION void PackInputRow(const PlanSpec& spec, const Conv& cv, const void* x,
                                  int64_t b, int64_t y, float* dst) {
  const int64_t ih = y - cv.pt;
  const int64_t x0 = std::max<int64_t>(0, cv.pl), iw0 = std::max<int64_t>(0, -cv.pl);
  const int64_t count = std::max<int64_t>(0, std::min(cv.w - iw0, cv.wp - x0));
  if (ih < 0 || ih >= cv.h || count == 0) {
    std::memset(dst, 0, cv.wp * cv.c * sizeof(float));
    return;
  }
  std::memset(dst, 0, x0 * cv.c * sizeof(float));
  std::memset(dst + (x0 + count) * cv.c, 0, (cv.wp - x0 - count) * cv.c * sizeof(float));
  float* out = dst + x0 * cv.c;
  if (!cv.nchw) {
    LoadRow(x, ((b * cv.h + ih) * cv.w + iw0) * cv.c, spec.dtype, count * cv.c, out);
    return;
  }
  // NCHW: sixteen channels at a time, so that each pixel's run of channels is written whole
  // while the sixteen channel rows are read as sequential streams.
  const int64_t plane = cv.h * cv.w;
  const int64_t first = b * cv.c * plane + ih * cv.w + iw0;
  switch (spec.dtype) {
    case DType::kF32:
      TransposeChannels(static_cast<const float*>(x) + first, plane, cv.c, count, out,
                        [](float v) { return v; });
      break;
    case DType::kF16:
      TransposeChannels(static_cast<const uint16_t*>(x) + first, plane, cv.c, count, out,
                        [](uint16_t v) { return HalfToFloatSelect(v); });
      break;
    case DType::kBF16:
      TransposeChannels(static_cast<const uint16_t*>(x) + first, plane, cv.c, count, out,
                        [](uint16_t v) { return Bf16ToFloat(v); });
      break;
  }
}

// The caller's buffer when it is float32 NHWC and nothing needs padding (negative padding
// only crops, which is an offset); else a padded float32 NHWC copy with `slack` spare floats.
InputView PrepareInput(const PlanSpec& spec, const Conv& cv, const void* x, int64_t slack,
                       Scratch* holder) {
  const bool direct = slack == 0 && !cv.nchw && spec.dtype == DType::kF32 && cv.pt <= 0 &&
                      cv.pb <= 0 && cv.pl <= 0 && cv.pr <= 0;
  if (direct) {
    const float* origin = static_cast<const float*>(x) + (-cv.pt * cv.w - cv.pl) * cv.c;
    return {origin, cv.h * cv.w * cv.c, cv.w * cv.c};
  }
  *holder = Allocate(cv.n * cv.hp * cv.wp * cv.c + slack);
  float* xp = holder->get();
  std::memset(xp + cv.n * cv.hp * cv.wp * cv.c, 0, slack * sizeof(float));
  ParallelFor(cv.n * cv.hp, [&](int64_t row) {
    PackInputRow(spec, cv, x, row / cv.hp, row % cv.hp, xp + row * cv.wp * cv.c);
  });
  return {xp, cv.hp * cv.wp * cv.c, cv.wp * cv.c};
}

// ---------------------------------------------------------------------------------------------
// Filters: for group g, channel block kb (nb output channels), tap t = y * s + x and input
// channel ci, the nb weights at element g * group + kb * block + (t * cg + ci) * ci_stride of
// data: a packed float32 copy, or the caller's HWIO buffer itself (in its dtype).
struct FilterView {
  const void* data;
  DType dtype;
  int64_t group, block, ci_stride;
  bool in_place;
  const float* floats() const { return static_cast<const float*>(data); }
};

constexpr int64_t kMaxBlockChannels = 32;  // the widest channel block (2 AVX-512 vectors)

// One channel block, packed as [tap][ci][nb], zero past the group's last channel.
JF_MULTIVERSION void PackFilterBlock(const PlanSpec& spec, const Conv& cv, const void* w,
                                     int64_t nb, int64_t kblocks, int64_t blk, float* dst) {
  const int64_t gi = blk / kblocks, kb = blk % kblocks;
  const int64_t valid = std::min(nb, cv.kg - kb * nb);
  const int64_t rows = cv.taps() * cv.cg;  // (tap, ci) pairs
  const FilterLayout layout = spec.conv.filter_layout;
  if (layout == FilterLayout::kHWIO) {
    for (int64_t i = 0; i < rows; ++i) {
      float* d = dst + i * nb;
      LoadRow(w, i * cv.k + gi * cv.kg + kb * nb, spec.dtype, valid, d);
      std::memset(d + valid, 0, (nb - valid) * sizeof(float));
    }
    return;
  }
  // OIHW / OHWI: one output channel's weights are contiguous. Transpose them in chunks: nb
  // sequential source streams in, whole destination rows out.
  constexpr int64_t kChunk = 64;
  alignas(64) float tmp[kMaxBlockChannels * kChunk];
  const int64_t taps = cv.taps();
  for (int64_t i0 = 0; i0 < rows; i0 += kChunk) {
    const int64_t len = std::min(kChunk, rows - i0);
    for (int64_t j = 0; j < nb; ++j) {
      float* t = tmp + j * kChunk;
      if (j < valid) {
        LoadRow(w, (gi * cv.kg + kb * nb + j) * rows + i0, spec.dtype, len, t);
      } else {
        std::memset(t, 0, len * sizeof(float));
      }
    }
    for (int64_t ii = 0; ii < len; ++ii) {
      const int64_t i = i0 + ii;  // OIHW: (ci, tap); OHWI: (tap, ci)
      const int64_t row = layout == FilterLayout::kOHWI ? i : (i % taps) * cv.cg + i / taps;
      float* d = dst + row * nb;
      for (int64_t j = 0; j < nb; ++j) d[j] = tmp[j * kChunk + ii];
    }
  }
}

// HWIO filters whose groups fill whole channel blocks are read in place (float16 / bfloat16
// ones through the per-task copy, which converts); others are packed here.
FilterView PrepareFilter(const PlanSpec& spec, const Conv& cv, const void* w, int64_t nb,
                         Scratch* holder) {
  if (spec.conv.filter_layout == FilterLayout::kHWIO && cv.kg % nb == 0) {
    return {w, spec.dtype, cv.kg, nb, cv.k, true};
  }
  const int64_t kblocks = CeilDiv(cv.kg, nb);
  const int64_t block = cv.taps() * cv.cg * nb;
  *holder = Allocate(cv.groups * kblocks * block);
  float* wp = holder->get();
  ParallelFor(cv.groups * kblocks, [&](int64_t blk) {
    PackFilterBlock(spec, cv, w, nb, kblocks, blk, wp + blk * block);
  });
  return {wp, DType::kF32, kblocks * block, block, nb, false};
}

// ---------------------------------------------------------------------------------------------
// Register tiles.

// A vector width and the most pixels per tile that fit the register file with two vectors of
// channels per pixel (accumulators + filter vectors + one broadcast).
template <class V, int MaxPix>
struct Config {
  using Vec = V;
  static constexpr int kLanes = sizeof(V) / sizeof(float);
  static constexpr int kMaxPix = MaxPix;
};
using Avx512 = Config<Vec16, 14>;  // 28 accumulators of 32 zmm
using Avx2 = Config<Vec8, 6>;      // 12 of 16 ymm
using Portable = Config<Vec4, 6>;  // 12 of 16 xmm (32 NEON registers on Arm)

// What a tile reads: the input at the first tap for its first pixel in each of its two
// segments (a segment is a run of pixels along one output row), and a channel block's filters.
struct TileArgs {
  const float* x0;
  const float* x1;
  int64_t pixel;       // floats between neighbouring pixels of a segment (stride * c)
  const float* w;      // the block's weights at tap 0, input channel 0
  int64_t w_row;       // floats between consecutive reduction rows of the weights
  const int64_t* tap_x;  // per tap: offset in the input, and in the weights
  const int64_t* tap_w;
  int64_t taps, inner;   // taps, and reduction length per tap (contiguous in input and weights)
};

// acc[M0 + M1][NV] = sum over taps and the inner reduction of input * weights, stored to out
// as [pixel][NV * lanes]. Pixels 7.. of the first segment get their own base pointer so the
// compiler can address every pixel from a few registers without spilling.
template <class V, int NV, int M0, int M1>
JF_ALWAYS_INLINE void TileKernel(const TileArgs& a, float* out) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  V acc[M0 + M1][NV];
  for (int p = 0; p < M0 + M1; ++p)
    for (int v = 0; v < NV; ++v) acc[p][v] = V{};
  const int64_t ps = a.pixel;
  for (int64_t t = 0; t < a.taps; ++t) {
    const float* p0 = a.x0 + a.tap_x[t];
    const float* p0h = M0 > 7 ? p0 + 7 * ps : p0;  // pixels 7.. (when there are)
    const float* p1 = a.x1 + a.tap_x[t];
    const float* wr = a.w + a.tap_w[t];
    for (int64_t i = 0; i < a.inner; ++i) {
      V wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = LoadVec<V>(wr + v * kLanes);
      for (int p = 0; p < M0; ++p) {
        const float xv = p < 7 ? p0[p * ps] : p0h[(p - 7) * ps];
        for (int v = 0; v < NV; ++v) acc[p][v] += xv * wv[v];
      }
      for (int p = 0; p < M1; ++p) {
        const float xv = p1[p * ps];
        for (int v = 0; v < NV; ++v) acc[M0 + p][v] += xv * wv[v];
      }
      ++p0;
      ++p0h;
      ++p1;
      wr += a.w_row;
    }
  }
  for (int p = 0; p < M0 + M1; ++p)
    for (int v = 0; v < NV; ++v) std::memcpy(out + (p * NV + v) * kLanes, &acc[p][v], sizeof(V));
}

// A per-thread buffer that grows to the largest size asked for (kept between calls).
float* ThreadScratch(int64_t floats) {
  thread_local Scratch buffer;
  thread_local int64_t capacity = 0;
  if (floats > capacity) {
    buffer = Allocate(floats);
    capacity = floats;
  }
  return buffer.get();
}

// Copies channel blocks [k0, k1) of group gi into dst as [block][row][nb], reading each
// filter row's blocks as one contiguous run.
struct Job;
void CopyFilterBlocks(const Job& job, int64_t gi, int64_t k0, int64_t k1, float* dst);

// Calls TileKernel for a one-segment tile of m pixels, or a two-segment tile of m + m.
template <class Cfg, int NV, int... M>
JF_ALWAYS_INLINE void TileSingle(int m, const TileArgs& a, float* out,
                                 std::integer_sequence<int, M...>) {
  (void)((m == M + 1 && (TileKernel<typename Cfg::Vec, NV, M + 1, 0>(a, out), true)) || ...);
}
template <class Cfg, int NV, int... M>
JF_ALWAYS_INLINE void TilePair(int m, const TileArgs& a, float* out,
                               std::integer_sequence<int, M...>) {
  (void)((m == M + 1 && (TileKernel<typename Cfg::Vec, NV, M + 1, M + 1>(a, out), true)) || ...);
}

// ---------------------------------------------------------------------------------------------
// The work: tiles over flat output rows (b * oh + oy), tasks over blocks of tiles x groups x
// ranges of channel blocks.

struct Segment {
  int64_t row, x0;
  int m;
};

struct Job {
  const Conv* cv;
  const Epilogue* ep;
  // NHWC float32 with a single-pass chain: full channel blocks go from the tile to the output
  // in one pass over registers (StoreTileSinglePass), else through Epilogue::Apply.
  const SinglePass* single;
  float* y;
  const float* side;
  InputView in;
  FilterView wt;
  std::vector<int64_t> tap_x, tap_w;
  int64_t inner;
  // Filters read in place but too large for L2 are first copied, per task, into a contiguous
  // buffer: the in-place rows are a whole filter row apart, a pattern that reaches DRAM at a
  // fraction of its bandwidth while the tiles run, but streams well in a plain copy loop.
  bool copy_filters;
  int64_t filter_rows;          // (tap, ci) rows of one channel block
  int64_t copy_group;           // channel blocks copied at once when a task's do not fit L2
  std::vector<int64_t> tap_w_copy;  // tap_w for the copy's layout
  int64_t nb, kblocks;
  int max_pix;
  bool pairs;         // a tile is two whole output rows
  int64_t per_row;    // tiles per output row (when not pairs)
  int64_t tiles, tile_block, kb_split, tasks;
  // Each tile runs every channel block before the next tile (NHWC output rows are written
  // whole, the tile's input stays in L1) when the task's filters fit in L2; else each
  // channel block runs every tile (its filters stay in L1/L2).
  bool tiles_outer;

  // The tile's segments; the second has m == 0 when the tile has one.
  void Segments(int64_t t, Segment* s0, Segment* s1) const {
    if (pairs) {
      *s0 = {2 * t, 0, static_cast<int>(cv->ow)};
      const bool second = 2 * t + 1 < cv->n * cv->oh;
      *s1 = {2 * t + 1, 0, second ? static_cast<int>(cv->ow) : 0};
      return;
    }
    const int64_t row = t / per_row, piece = t % per_row;
    const int64_t x0 = piece * cv->ow / per_row, x1 = (piece + 1) * cv->ow / per_row;
    *s0 = {row, x0, static_cast<int>(x1 - x0)};
    *s1 = {row, 0, 0};
  }

  const float* SegmentInput(const Segment& s, int64_t gi) const {
    const int64_t b = s.row / cv->oh, oy = s.row % cv->oh;
    return in.data + b * in.image + oy * cv->sh * in.row + s.x0 * cv->sw * cv->c + gi * cv->cg;
  }

  // NHWC: epilogue and store for one segment's results, tile[p * nb + j] for channel ch0 + j.
  void StoreNhwc(float* tile, const Segment& s, int64_t ch0, int64_t nch) const {
    const int64_t b = s.row / cv->oh, oy = s.row % cv->oh, plane = cv->oh * cv->ow;
    const int64_t pix = oy * cv->ow + s.x0;
    ep->Apply({tile, s.m, nch, nb, (b * plane + pix) * cv->k + ch0, cv->k, ch0, false,
               pix * cv->k + ch0, cv->k});
  }
};

// NCHW: gathers one channel block's results for consecutive pixels of an output row,
// transposed to a row per channel, so the epilogue runs along many pixels at once.
class NchwRows {
 public:
  static constexpr int kCap = 64;  // pixels per row of the buffer

  NchwRows(const Job& job, float* buffer) : job_(job), buf_(buffer) {}

  void Add(const float* tile, int64_t ld, const Segment& s, int64_t ch0, int64_t nch) {
    if (m_ > 0 && (s.row != row_ || s.x0 != x0_ + m_ || m_ + s.m > kCap || ch0 != ch0_)) Flush();
    if (m_ == 0) {
      row_ = s.row;
      x0_ = s.x0;
      ch0_ = ch0;
      nch_ = nch;
    }
    for (int64_t j = 0; j < nch; ++j)
      for (int p = 0; p < s.m; ++p) buf_[j * kCap + m_ + p] = tile[p * ld + j];
    m_ += s.m;
  }

  void Flush() {
    if (m_ == 0) return;
    const Conv& cv = *job_.cv;
    const int64_t b = row_ / cv.oh, oy = row_ % cv.oh, plane = cv.oh * cv.ow;
    const int64_t pix = oy * cv.ow + x0_;
    job_.ep->Apply({buf_, nch_, m_, kCap, (b * cv.k + ch0_) * plane + pix, plane, ch0_, true,
                    ch0_ * plane + pix, plane});
    m_ = 0;
  }

 private:
  const Job& job_;
  float* buf_;
  int64_t row_ = 0, x0_ = 0, ch0_ = 0, nch_ = 0;
  int m_ = 0;
};

template <class V, int NV, int Mode, bool kSide>
JF_ALWAYS_INLINE void SinglePassPixels(const float* tile, int m, float* y, const float* z,
                                       int64_t pixel, const V* scale, const V* shift,
                                       float side_alpha, float alpha) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  const V a = V{} + alpha;
  for (int p = 0; p < m; ++p) {
    for (int v = 0; v < NV; ++v) {
      V x = LoadVec<V>(tile + (p * NV + v) * kLanes) * scale[v] + shift[v];
      if constexpr (kSide) x += side_alpha * LoadVec<V>(z + p * pixel + v * kLanes);
      x = ActivateVec<Mode>(x, a);
      std::memcpy(y + p * pixel + v * kLanes, &x, sizeof(V));
    }
  }
}

// A full channel block of one segment, NHWC float32, single-pass chain.
template <class V, int NV>
JF_ALWAYS_INLINE void StoreTileSinglePass(const Job& job, const float* tile, const Segment& s,
                                          int64_t ch0) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  const SinglePass& f = *job.single;
  const Conv& cv = *job.cv;
  const int64_t at = (s.row * cv.ow + s.x0) * cv.k + ch0;
  V scale[NV], shift[NV];
  for (int v = 0; v < NV; ++v) {
    scale[v] = LoadVec<V>(f.scale + ch0 + v * kLanes);
    shift[v] = LoadVec<V>(f.shift + ch0 + v * kLanes);
  }
  float* y = job.y + at;
  const float* z = f.side ? job.side + at : nullptr;
  const float sa = f.side_alpha, a = f.alpha;
#define JF_PIXELS(MODE, SIDE) \
  return SinglePassPixels<V, NV, MODE, SIDE>(tile, s.m, y, z, cv.k, scale, shift, sa, a)
  switch (f.activation + (f.side ? kNumActivationModes : 0)) {
    case kRelu: JF_PIXELS(kRelu, false);
    case kClippedRelu: JF_PIXELS(kClippedRelu, false);
    case kLeakyRelu: JF_PIXELS(kLeakyRelu, false);
    case kHardswish: JF_PIXELS(kHardswish, false);
    case kHardsigmoid: JF_PIXELS(kHardsigmoid, false);
    case kPassthru: JF_PIXELS(kPassthru, false);
    case kNumActivationModes + kRelu: JF_PIXELS(kRelu, true);
    case kNumActivationModes + kClippedRelu: JF_PIXELS(kClippedRelu, true);
    case kNumActivationModes + kLeakyRelu: JF_PIXELS(kLeakyRelu, true);
    case kNumActivationModes + kHardswish: JF_PIXELS(kHardswish, true);
    case kNumActivationModes + kHardsigmoid: JF_PIXELS(kHardsigmoid, true);
    default: JF_PIXELS(kPassthru, true);
  }
#undef JF_PIXELS
}

template <class Cfg, int NV>
JF_ALWAYS_INLINE void RunTask(const Job& job, int64_t task) {
  constexpr int kNb = NV * Cfg::kLanes;
  constexpr int kMax = Cfg::kMaxPix;
  alignas(64) float tile[kMax * kNb];
  alignas(64) float rows_buffer[kNb * NchwRows::kCap];
  NchwRows nchw(job, rows_buffer);
  const Conv& cv = *job.cv;
  const int64_t per_tb = cv.groups * job.kb_split;
  const int64_t tb = task / per_tb, gi = (task % per_tb) / job.kb_split;
  const int64_t piece = task % job.kb_split;
  const int64_t t0 = tb * job.tile_block, t1 = std::min(job.tiles, t0 + job.tile_block);
  const int64_t k0 = piece * job.kblocks / job.kb_split;
  const int64_t k1 = (piece + 1) * job.kblocks / job.kb_split;
  TileArgs a;
  a.pixel = cv.sw * cv.c;
  a.w_row = job.wt.ci_stride;
  a.tap_x = job.tap_x.data();
  a.tap_w = job.tap_w.data();
  a.taps = static_cast<int64_t>(job.tap_x.size());
  a.inner = job.inner;
  // Filters copied per task: all its channel blocks at once when they fit L2 (tiles outer),
  // else a group at a time (as many blocks as fit half of L2, at least one), which bounds the
  // per-thread buffer while keeping the copy's reads long.
  float* copy = nullptr;
  int64_t copied = k0;  // first channel block in `copy`
  const int64_t group = job.tiles_outer ? k1 - k0 : job.copy_group;
  if (job.copy_filters) {
    copy = ThreadScratch(std::min(group, k1 - k0) * job.filter_rows * kNb);
    if (job.tiles_outer) CopyFilterBlocks(job, gi, k0, k1, copy);
    a.w_row = kNb;
    a.tap_w = job.tap_w_copy.data();
  }
  auto run_tile = [&](int64_t kb, int64_t t) __attribute__((always_inline)) {
    a.w = copy ? copy + (kb - copied) * job.filter_rows * kNb
               : job.wt.floats() + gi * job.wt.group + kb * job.wt.block;
    const int64_t ch0 = gi * cv.kg + kb * kNb, nch = std::min<int64_t>(kNb, cv.kg - kb * kNb);
    Segment s0, s1;
    job.Segments(t, &s0, &s1);
    a.x0 = job.SegmentInput(s0, gi);
    a.x1 = s1.m ? job.SegmentInput(s1, gi) : a.x0;
    if (s1.m == 0) {
      TileSingle<Cfg, NV>(s0.m, a, tile, std::make_integer_sequence<int, kMax>());
    } else {
      TilePair<Cfg, NV>(s0.m, a, tile, std::make_integer_sequence<int, kMax / 2>());
    }
    if (cv.nchw) {
      nchw.Add(tile, kNb, s0, ch0, nch);
      if (s1.m) nchw.Add(tile + s0.m * kNb, kNb, s1, ch0, nch);
    } else if (job.single && nch == kNb) {
      using V = typename Cfg::Vec;
      StoreTileSinglePass<V, NV>(job, tile, s0, ch0);
      if (s1.m) StoreTileSinglePass<V, NV>(job, tile + s0.m * kNb, s1, ch0);
    } else {
      job.StoreNhwc(tile, s0, ch0, nch);
      if (s1.m) job.StoreNhwc(tile + s0.m * kNb, s1, ch0, nch);
    }
  };
  if (job.tiles_outer) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t kb = k0; kb < k1; ++kb) run_tile(kb, t);
  } else {
    for (int64_t kb = k0; kb < k1; ++kb) {
      if (copy && (kb - k0) % group == 0) {
        CopyFilterBlocks(job, gi, kb, std::min(k1, kb + group), copy);
        copied = kb;
      }
      for (int64_t t = t0; t < t1; ++t) run_tile(kb, t);
    }
  }
  nchw.Flush();
}

void CopyFilterBlocks(const Job& job, int64_t gi, int64_t k0, int64_t k1, float* dst) {
  const int64_t rows = job.filter_rows, nb = job.nb;
  const int64_t first = gi * job.wt.group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t kb = k0; kb < k1; ++kb) {
      LoadRow(job.wt.data, first + kb * job.wt.block + r * job.wt.ci_stride, job.wt.dtype, nb,
              dst + ((kb - k0) * rows + r) * nb);
    }
  }
}

template <class Cfg>
JF_ALWAYS_INLINE void RunTaskAnyWidth(const Job& job, int64_t task) {
  if (job.nb == Cfg::kLanes) {
    RunTask<Cfg, 1>(job, task);
  } else {
    RunTask<Cfg, 2>(job, task);
  }
}

#ifdef JF_HAVE_X86_LEVELS
JF_TARGET_AVX512 void RunTaskAvx512(const Job& job, int64_t task) {
  RunTaskAnyWidth<Avx512>(job, task);
}
JF_TARGET_AVX2 void RunTaskAvx2(const Job& job, int64_t task) { RunTaskAnyWidth<Avx2>(job, task); }
#endif
void RunTaskPortable(const Job& job, int64_t task) { RunTaskAnyWidth<Portable>(job, task); }

// Splits the work into tasks of a block of tiles x a range of channel blocks. A block of tiles
// is at most what keeps its input rows in half of L2 (a few MiB when one channel block's
// filters alone are that large: deep layers then reuse each filter block over many tiles).
// Among the splits that give every thread several tasks, it takes the one that moves the
// fewest bytes: every block of tiles reads all its channel blocks' filters, every channel
// range reads all its tiles' input.
void PlanTasks(Job* job) {
  const Conv& cv = *job->cv;
  const int64_t rows = cv.n * cv.oh;
  job->pairs = 2 * cv.ow <= job->max_pix;
  job->per_row = job->pairs ? 1 : CeilDiv(cv.ow, job->max_pix);
  job->tiles = job->pairs ? CeilDiv(rows, 2) : rows * job->per_row;
  const double rows_per_tile = job->pairs ? 2.0 : 1.0 / static_cast<double>(job->per_row);
  const double row_bytes = static_cast<double>(cv.wp * cv.c * sizeof(float));
  const double eff_h = static_cast<double>((cv.r - 1) * cv.dh + 1);
  auto input_bytes = [&](int64_t tiles) {
    return (static_cast<double>(tiles) * rows_per_tile * cv.sh + eff_h) * row_bytes;
  };
  const int64_t block_filter_bytes = job->filter_rows * job->nb * sizeof(float);
  const bool deep = block_filter_bytes > L2Bytes() / 4;
  const double budget = deep ? 4.0 * (1 << 20) : static_cast<double>(L2Bytes()) / 2;
  int64_t most = 1;  // tiles per block
  while (most < job->tiles && input_bytes(most * 2) <= budget) most *= 2;
  most = std::min(most, job->tiles);
  const int64_t threads = NumThreads();
  const int64_t flops = 2 * rows * cv.ow * cv.k * cv.cg * cv.taps();
  // At least ~2 MFLOP per task, so that tiny layers do not pay for waking threads.
  const int64_t wanted = std::max<int64_t>(
      1, std::min<int64_t>(threads > 1 ? 4 * threads : 1, flops / (2 << 20)));
  const double filters = static_cast<double>(block_filter_bytes * job->kblocks * cv.groups);
  const double inputs = input_bytes(job->tiles);
  double best = -1;
  for (int64_t split = 1;; split = std::min(job->kblocks, split * 2)) {
    const int64_t blocks_wanted = CeilDiv(wanted, cv.groups * split);
    const int64_t tb = std::min(most, std::max<int64_t>(1, job->tiles / blocks_wanted));
    const int64_t blocks = CeilDiv(job->tiles, tb);
    const double moved = static_cast<double>(blocks) * filters + static_cast<double>(split) * inputs;
    if (best < 0 || moved < best) {
      best = moved;
      job->tile_block = tb;
      job->kb_split = split;
    }
    if (split == job->kblocks) break;
  }
  job->tasks = CeilDiv(job->tiles, job->tile_block) * cv.groups * job->kb_split;
  const int64_t task_filter_bytes = CeilDiv(job->kblocks, job->kb_split) * block_filter_bytes;
  job->tiles_outer = !cv.nchw && task_filter_bytes <= L2Bytes() / 2;
  job->copy_group = std::max<int64_t>(1, L2Bytes() / 2 / block_filter_bytes);
}

// ---------------------------------------------------------------------------------------------
// Depthwise (one input and one output channel per group): vectorized across channels.

constexpr int kDwLanes = 16;
constexpr int kDwPix = 8;
typedef float DwVec __attribute__((vector_size(kDwLanes * sizeof(float))));

JF_MULTIVERSION void DepthwiseRow(const Conv& cv, const InputView& in, const float* wdw,
                                  int64_t kpad, const Epilogue& ep, int64_t b, int64_t oy) {
  alignas(64) float vals[kDwPix * kDwLanes];
  alignas(64) float transposed[kDwLanes * kDwPix];
  const int64_t plane = cv.oh * cv.ow;
  for (int64_t k0 = 0; k0 < cv.k; k0 += kDwLanes) {
    const int64_t nch = std::min<int64_t>(kDwLanes, cv.k - k0);
    for (int64_t ox0 = 0; ox0 < cv.ow; ox0 += kDwPix) {
      const int m = static_cast<int>(std::min<int64_t>(kDwPix, cv.ow - ox0));
      for (int p = 0; p < m; ++p) {
        const float* xb = in.data + b * in.image + oy * cv.sh * in.row + (ox0 + p) * cv.sw * cv.c;
        DwVec acc = DwVec{};
        for (int64_t y = 0; y < cv.r; ++y)
          for (int64_t x = 0; x < cv.s; ++x)
            acc += LoadVec<DwVec>(xb + y * cv.dh * in.row + x * cv.dw * cv.c + k0) *
                   LoadVec<DwVec>(wdw + (y * cv.s + x) * kpad + k0);
        std::memcpy(vals + p * kDwLanes, &acc, sizeof(acc));
      }
      const int64_t pix = oy * cv.ow + ox0;
      if (!cv.nchw) {
        ep.Apply({vals, m, nch, kDwLanes, (b * plane + pix) * cv.k + k0, cv.k, k0, false,
                  pix * cv.k + k0, cv.k});
        continue;
      }
      for (int64_t j = 0; j < nch; ++j)
        for (int p = 0; p < m; ++p) transposed[j * kDwPix + p] = vals[p * kDwLanes + j];
      ep.Apply({transposed, nch, m, kDwPix, (b * cv.k + k0) * plane + pix, plane, k0, true,
                k0 * plane + pix, plane});
    }
  }
}

void RunDepthwise(const PlanSpec& spec, const Conv& cv, const FusedParams& buf,
                  const Epilogue& ep) {
  // Vector loads may read up to a vector past the last channel of the last pixel.
  Scratch xp, wdw;
  const InputView in = PrepareInput(spec, cv, buf.x, kDwLanes, &xp);
  const int64_t kpad = CeilDiv(cv.k, kDwLanes) * kDwLanes;
  wdw = Allocate(cv.taps() * kpad);
  std::memset(wdw.get(), 0, cv.taps() * kpad * sizeof(float));
  for (int64_t ko = 0; ko < cv.k; ++ko)
    for (int64_t y = 0; y < cv.r; ++y)
      for (int64_t x = 0; x < cv.s; ++x) {
        int64_t index = 0;
        switch (spec.conv.filter_layout) {
          case FilterLayout::kOIHW: index = (ko * cv.r + y) * cv.s + x; break;
          case FilterLayout::kHWIO: index = (y * cv.s + x) * cv.k + ko; break;
          case FilterLayout::kOHWI: index = (ko * cv.r + y) * cv.s + x; break;
        }
        wdw[(y * cv.s + x) * kpad + ko] = LoadAsFloat(buf.w, index, spec.dtype);
      }
  ParallelFor(cv.n * cv.oh, [&](int64_t t) {
    DepthwiseRow(cv, in, wdw.get(), kpad, ep, t / cv.oh, t % cv.oh);
  });
}

CpuLevel Level() {
  static const CpuLevel level = DetectCpuLevel();
  return level;
}

}  // namespace

CpuLevel DetectCpuLevel() {
  CpuLevel best = CpuLevel::kPortable;
#ifdef JF_HAVE_X86_LEVELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("bmi2")) {
    best = CpuLevel::kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
      best = CpuLevel::kAvx512;
    }
  }
#endif
  if (const char* cap = std::getenv("JAXFUSE_CPU_ISA")) {
    CpuLevel limit = best;
    if (std::strcmp(cap, "portable") == 0) limit = CpuLevel::kPortable;
    if (std::strcmp(cap, "avx2") == 0) limit = CpuLevel::kAvx2;
    best = std::min(best, limit);
  }
  return best;
}

bool UsesPaddedCopy(const PlanSpec& spec) {
  const ConvGeometry& g = spec.conv;
  const double padded = double(spec.n) * spec.c * double(spec.h + g.pad_t + g.pad_b) *
                        double(spec.w + g.pad_l + g.pad_r);
  const double tensors = double(spec.input_elements()) + double(spec.filter_elements()) +
                         double(spec.output_elements());
  // Ordinary padding (a few pixels, dilated "SAME") is a few percent of x; small problems
  // keep the fast path up to 4 MiB of copy whatever their padding.
  return padded <= 4 * tensors + double(1 << 20);
}

void RunConvolution(const PlanSpec& spec, const FusedParams& buf, const Epilogue& ep) {
  if (!UsesPaddedCopy(spec)) {
    RunDirectConvolution(spec, buf, ep);
    return;
  }
  const Conv cv(spec);
  if (cv.cg == 1 && cv.kg == 1) {
    RunDepthwise(spec, cv, buf, ep);
    return;
  }
  const CpuLevel level = Level();
  const int lanes = level == CpuLevel::kAvx512 ? 16 : level == CpuLevel::kAvx2 ? 8 : 4;
  Job job;
  job.cv = &cv;
  job.ep = &ep;
  job.single = !cv.nchw && spec.dtype == DType::kF32 ? ep.single_pass() : nullptr;
  // clipped_relu with a NaN alpha (all NaN) takes the scalar store: ActivateVec keeps one
  // comparison, as it had before NaN alphas propagated (a second one cost the tiles ~7%).
  const bool nan_clip = job.single && job.single->activation == kClippedRelu &&
                        job.single->alpha != job.single->alpha;
  if (nan_clip) job.single = nullptr;
  job.y = static_cast<float*>(buf.y);
  job.side = static_cast<const float*>(buf.side);
  job.max_pix = level == CpuLevel::kAvx512 ? Avx512::kMaxPix
                : level == CpuLevel::kAvx2 ? Avx2::kMaxPix
                                           : Portable::kMaxPix;
  // Two vectors of channels per pixel, one when a group has no more channels than a vector.
  job.nb = cv.kg <= lanes ? lanes : 2 * lanes;
  job.kblocks = CeilDiv(cv.kg, job.nb);
  Scratch xp, wp;
  job.in = PrepareInput(spec, cv, buf.x, 0, &xp);
  job.wt = PrepareFilter(spec, cv, buf.w, job.nb, &wp);
  // With one group and no horizontal dilation, a filter row's taps and channels are one
  // contiguous run in both the input and the weights: one long reduction per filter row.
  job.filter_rows = cv.taps() * cv.cg;
  job.copy_filters = job.wt.in_place &&
                     (job.wt.dtype != DType::kF32 ||
                      cv.k * job.filter_rows * static_cast<int64_t>(sizeof(float)) > kCopyFilterBytes);
  // Taps as (input offset, first filter row); rows are ci_stride apart in place, nb in a copy.
  std::vector<int64_t> tap_rows;
  if (cv.groups == 1 && cv.dw == 1) {
    job.inner = cv.s * cv.c;
    for (int64_t y = 0; y < cv.r; ++y) {
      job.tap_x.push_back(y * cv.dh * job.in.row);
      tap_rows.push_back(y * cv.s * cv.cg);
    }
  } else {
    job.inner = cv.cg;
    for (int64_t y = 0; y < cv.r; ++y)
      for (int64_t x = 0; x < cv.s; ++x) {
        job.tap_x.push_back(y * cv.dh * job.in.row + x * cv.dw * cv.c);
        tap_rows.push_back((y * cv.s + x) * cv.cg);
      }
  }
  for (int64_t row : tap_rows) {
    job.tap_w.push_back(row * job.wt.ci_stride);
    job.tap_w_copy.push_back(row * job.nb);
  }
  PlanTasks(&job);
  void (*run)(const Job&, int64_t) = RunTaskPortable;
#ifdef JF_HAVE_X86_LEVELS
  if (level == CpuLevel::kAvx512) run = RunTaskAvx512;
  if (level == CpuLevel::kAvx2) run = RunTaskAvx2;
#endif
  ParallelFor(job.tasks, [&](int64_t task) { run(job, task); });
}

}  // namespace jaxfuse::cpu
