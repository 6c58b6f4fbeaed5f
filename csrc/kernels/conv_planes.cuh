// Depthwise convolution (one input and one output channel per group) with NCHW input and
// output: each (image, channel) plane is a 2-D stencil of its own, so a CTA works on whole
// planes' tiles and needs no other channel. Any filter layout (the R x S taps of a channel are
// read once a thread, through conv_direct.cuh's w_offset), strides, padding and dilation. The
// code generator (csrc/gpu/codegen.cc: PlanesCandidates) defines the tile constants; its
// tilings (kBH 4 or 8 rows a thread, kCW 1 or 2 columns, registers capped or not by kMinBlocks)
// are autotuning's candidates.
//
// A CTA computes a kTH x kTW tile of output pixels for kPlanes consecutive planes. It copies
// the tile's input window (halo and zero padding included, converted to fp32) into shared
// memory, consecutive threads on consecutive input columns, each thread a few rows with all
// its loads in flight together. Then each thread computes kBH x kCW outputs, kBH rows of kCW
// adjacent columns (the window values its outputs share are read once from shared memory), and
// stores them: consecutive threads on consecutive output columns. With two columns a thread
// (kCW 2) and planes of an even width, the window moves two values a load and a shared-memory
// access, and even-width outputs two a store (36 instructions an output against 50; MobileNet's
// fp16 112x112 layer at batch 64 70.9 -> 65.3 us, H100). Small planes are whole tiles, kPlanes
// of them a CTA. fp32 accumulation in the order conv_direct adds the taps. It replaces
// conv_direct, one thread an output reading its 9 inputs from global memory, which ran
// MobileNetV2's fp16 112x112 32-channel layer at batch 64 at 0.76x XLA's transposes around
// cuDNN's NHWC kernel (H100, 2026-11-27).
#pragma once

namespace jaxfuse {
namespace planes {

using namespace plan;

// Two consecutive elements as one aligned load or store.
template <typename E>
struct alignas(2 * sizeof(E)) Pair {
  E lo, hi;
};

// With two columns a thread and planes of an even width, the window is copied in pairs: its first
// column is then an even one, kShift before the tile's first input column (the tile's first
// output column is even, so the parity of that input column is the left padding's).
constexpr bool kPairFill = kCW == 2 && W % 2 == 0;
constexpr int kShift = kPairFill ? static_cast<int>((PL % 2 + 2) % 2) : 0;  // (PL < 0 too)
// The input window of a tile: rows and columns, and its row pitch in shared memory (even, so
// that pairs are 8-byte aligned).
constexpr int kWH = (kTH - 1) * SH + (R - 1) * DH + 1;
constexpr int kWW = (kTW - 1) * SW + (S - 1) * DW + 1 + kShift;
constexpr int kPitch = kPairFill ? (kWW + 1) / 2 * 2 : kWW;
constexpr int kColThreads = kTW / kCW;
constexpr int kRowThreads = kTH / kBH;
constexpr int kPlaneThreads = kColThreads * kRowThreads;
constexpr int kThreads = kPlaneThreads * kPlanes;
constexpr i64 kTilesH = (P + kTH - 1) / kTH, kTilesW = (Q + kTW - 1) / kTW;
constexpr i64 kPlaneCount = N * C;
// The window values one thread reads: kRowsRead rows of kSpan columns.
constexpr int kRowsRead = (kBH - 1) * SH + (R - 1) * DH + 1;
constexpr int kSpan = (kCW - 1) * SW + (S - 1) * DW + 1;
static_assert(G == C && K == C, "one input and one output channel per group");
static_assert(kTH % kBH == 0 && kTW % kCW == 0, "a tile is whole blocks of a thread's outputs");
static_assert(kCW == 1 || kCW == 2, "one or two columns a thread");
static_assert(kPlanes * kWH * kPitch * 4 <= 48 * 1024, "the windows fit static shared memory");

// kSpan consecutive values of a window row from `row[0]`: where the window is stored in pairs,
// a lone first value if `row` is at an odd column (kOdd), then pairs as 8-byte reads.
template <bool kOdd>
JF_DEVICE void read_span(const float* row, float (&v)[kSpan]) {
  constexpr int kFirst = kPairFill && kOdd ? 1 : 0;
  constexpr int kPairs = kPairFill ? (kSpan - kFirst) / 2 : 0;
  if (kFirst == 1) v[0] = row[0];
#pragma unroll
  for (int q = 0; q < kPairs; ++q) {
    const Pair<float> two = *reinterpret_cast<const Pair<float>*>(row + kFirst + 2 * q);
    v[kFirst + 2 * q] = two.lo;
    v[kFirst + 2 * q + 1] = two.hi;
  }
#pragma unroll
  for (int k = kFirst + 2 * kPairs; k < kSpan; ++k) v[k] = row[k];
}

}  // namespace planes
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::planes::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_planes(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::planes;
  using namespace jaxfuse::kernels;
  typedef Io::type T;
  alignas(16) __shared__ float window[kPlanes][kWH][kPitch];
  const Epilogue ep(p);
  const T* JF_RESTRICT x = static_cast<const T*>(p.x);
  const FilterIo::type* JF_RESTRICT w = static_cast<const FilterIo::type*>(p.w);
  T* JF_RESTRICT y = static_cast<T*>(p.y);

  // Tiles along W fastest, then along H, then groups of planes.
  i64 block = blockIdx.x;
  const int tile_w = static_cast<int>(block % kTilesW);
  block /= kTilesW;
  const int tile_h = static_cast<int>(block % kTilesH);
  const i64 plane0 = block / kTilesH * kPlanes;
  const int oh0 = tile_h * kTH, ow0 = tile_w * kTW;
  const int ih0 = oh0 * static_cast<int>(SH) - static_cast<int>(PT);
  const int iw0 = ow0 * static_cast<int>(SW) - static_cast<int>(PL) - kShift;  // (window column 0)

  // The thread's plane, its taps and its epilogue terms first: their loads do not wait for
  // the window, so their latency overlaps the window's.
  const int pl = threadIdx.x / kPlaneThreads, in_plane = threadIdx.x % kPlaneThreads;
  const int ty = in_plane / kColThreads, tx = in_plane % kColThreads;
  const i64 plane = plane0 + pl;
  const i64 c = (plane < kPlaneCount ? plane : plane0) % C;  // (a short last group's idle threads)
  float taps[R][S];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int s = 0; s < S; ++s) taps[r][s] = filter_value(w[w_offset(c, 0, r, s)]);
  }
  const auto terms = ep.channel(c);

  // The window: each thread copies its plane's window rows ty, ty + kRowThreads, ... at columns
  // (or pairs of columns) tx, tx + kColThreads, ...: all its loads in flight together, each at
  // a constant offset from one address a column. (A loop of one value a step spent about 50
  // instructions a value on index arithmetic: the kernel was bound by instruction issue at a
  // third of the copy bandwidth.)
  constexpr int kUnit = kPairFill ? 2 : 1;  // columns a load
  constexpr int kUnits = kPitch / kUnit;    // loads a window row
  constexpr int kFillRows = (kWH + kRowThreads - 1) / kRowThreads;
  constexpr int kFillCols = (kUnits + kColThreads - 1) / kColThreads;
  {
    const bool plane_ok = plane < kPlaneCount;
    const T* const x_plane = x + (plane_ok ? plane : plane0) * (H * W);
    float* const to = &window[pl][ty][tx * kUnit];
#pragma unroll
    for (int j = 0; j < kFillCols; ++j) {
      const int unit = tx + j * kColThreads, iw = iw0 + unit * kUnit;
      if (j * kColThreads + kColThreads > kUnits && unit >= kUnits) break;  // (idle columns)
      // (A pair is inside the row or outside it whole: its column and W are even.)
      const bool col_ok = plane_ok && iw >= 0 && iw < W;
      const T* const from = x_plane + (i64{ih0 + ty} * W + iw);  // (row i at i * kRowThreads * W)
      float v[kFillRows][kUnit];
#pragma unroll
      for (int i = 0; i < kFillRows; ++i) {
        const int ih = ih0 + ty + i * kRowThreads;
        const bool ok = col_ok && ih >= 0 && ih < H;
        if constexpr (kPairFill) {
          Pair<T> two{};
          if (ok) two = *reinterpret_cast<const Pair<T>*>(from + i * kRowThreads * W);
          v[i][0] = ok ? Io::load(two.lo) : 0.0f;
          v[i][kUnit - 1] = ok ? Io::load(two.hi) : 0.0f;
        } else {
          v[i][0] = ok ? Io::load(from[i * kRowThreads * W]) : 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < kFillRows; ++i) {
        if (i * kRowThreads + kRowThreads <= kWH || ty + i * kRowThreads < kWH) {
          float* const at = to + i * kRowThreads * kPitch + j * kColThreads * kUnit;
          if constexpr (kPairFill) {
            *reinterpret_cast<Pair<float>*>(at) = Pair<float>{v[i][0], v[i][kUnit - 1]};
          } else {
            *at = v[i][0];
          }
        }
      }
    }
  }
  // (The taps arrive with the window, not behind the barrier.)
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int s = 0; s < S; ++s) arrive_here(taps[r][s]);
  }
  __syncthreads();
  if (plane >= kPlaneCount) return;

  // Each window row the thread's outputs read is read once; output i takes row i * SH + r * DH
  // for tap row r, so its taps still add in conv_direct's order (r, then s).
  float acc[kBH][kCW];
#pragma unroll
  for (int i = 0; i < kBH; ++i) {
#pragma unroll
    for (int k = 0; k < kCW; ++k) acc[i][k] = 0.0f;
  }
  const float* const rows = &window[pl][ty * kBH * SH][kShift + tx * kCW * SW];
#pragma unroll
  for (int wr = 0; wr < kRowsRead; ++wr) {
    float v[kSpan];
    read_span<kShift == 1>(rows + wr * kPitch, v);  // (tx * kCW * SW is even)
#pragma unroll
    for (int i = 0; i < kBH; ++i) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (i * SH + r * DH != wr) continue;
#pragma unroll
        for (int s = 0; s < S; ++s) {
#pragma unroll
          for (int k = 0; k < kCW; ++k) acc[i][k] += v[k * SW + s * DW] * taps[r][s];
        }
      }
    }
  }
  const int ow = ow0 + tx * kCW;
  if (ow >= Q) return;
#pragma unroll
  for (int i = 0; i < kBH; ++i) {
    const int oh = oh0 + ty * kBH + i;
    if (oh >= P) continue;
    const i64 idx = (plane * P + oh) * Q + ow;
    const i64 at = idx % kPerSample;
    if constexpr (kCW == 2 && Q % 2 == 0) {  // (ow even, so ow + 1 < Q and the pair aligned)
      *reinterpret_cast<Pair<T>*>(y + idx) =
          Pair<T>{Io::store(ep.apply(acc[i][0], terms, at, idx)),
                  Io::store(ep.apply(acc[i][kCW - 1], terms, at + 1, idx + 1))};
    } else {
#pragma unroll
      for (int k = 0; k < kCW; ++k) {
        if (k == 0 || ow + k < Q) y[idx + k] = Io::store(ep.apply(acc[i][k], terms, at + k, idx + k));
      }
    }
  }
}
