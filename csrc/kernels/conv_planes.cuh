// Depthwise convolution (one input and one output channel per group) with NCHW input and
// output: each (image, channel) plane is a 2-D stencil of its own, so a CTA works on whole
// planes' tiles and needs no other channel. Any filter layout (the R x S taps of a channel are
// read once a thread, through conv_direct.cuh's w_offset), strides, padding and dilation. The
// code generator (csrc/gpu/codegen.cc: PlanesCandidates) defines the tile constants; its
// tilings (kBH 4 or 8, registers capped or not by kMinBlocks) are autotuning's candidates.
//
// A CTA computes a kTH x kTW tile of output pixels for kPlanes consecutive planes. It copies
// the tile's input window (halo and zero padding included, converted to fp32) into shared
// memory, consecutive threads on consecutive input columns, each thread a few rows with all
// its loads in flight together. Then each thread computes kBH outputs of one column, one below
// the other (the rows its outputs share are read once from shared memory), and stores them:
// consecutive threads on consecutive output columns. Small planes are whole tiles, kPlanes of
// them a CTA. fp32 accumulation in the order conv_direct adds the taps. It replaces
// conv_direct, one thread an output reading its 9 inputs from global memory, which ran
// MobileNetV2's fp16 112x112 32-channel layer at batch 64 at 0.76x XLA's transposes around
// cuDNN's NHWC kernel (H100, 2026-11-27).
#pragma once

namespace jaxfuse {
namespace planes {

using namespace plan;

// The input window of a tile: rows and columns.
constexpr int kWH = (kTH - 1) * SH + (R - 1) * DH + 1;
constexpr int kWW = (kTW - 1) * SW + (S - 1) * DW + 1;
constexpr int kRowThreads = kTH / kBH;
constexpr int kPlaneThreads = kTW * kRowThreads;
constexpr int kThreads = kPlaneThreads * kPlanes;
constexpr i64 kTilesH = (P + kTH - 1) / kTH, kTilesW = (Q + kTW - 1) / kTW;
constexpr i64 kPlaneCount = N * C;
static_assert(G == C && K == C, "one input and one output channel per group");
static_assert(kTH % kBH == 0, "a tile's rows are whole blocks of a thread's outputs");
static_assert(kPlanes * kWH * kWW * 4 <= 48 * 1024, "the windows fit static shared memory");

}  // namespace planes
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::planes::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_planes(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::planes;
  using namespace jaxfuse::kernels;
  typedef Io::type T;
  __shared__ float window[kPlanes][kWH][kWW];
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
  const int iw0 = ow0 * static_cast<int>(SW) - static_cast<int>(PL);

  // The thread's plane, its taps and its epilogue terms first: their loads do not wait for
  // the window, so their latency overlaps the window's.
  const int pl = threadIdx.x / kPlaneThreads, in_plane = threadIdx.x % kPlaneThreads;
  const int ty = in_plane / kTW, tx = in_plane % kTW;
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
  // tx, tx + kTW, ...: all its loads in flight together, each at a constant offset from one
  // address a column. (A loop of one value a step spent about 50 instructions a value on index
  // arithmetic: the kernel was bound by instruction issue at a third of the copy bandwidth.)
  constexpr int kFillRows = (kWH + kRowThreads - 1) / kRowThreads;
  constexpr int kFillCols = (kWW + kTW - 1) / kTW;
  {
    const bool plane_ok = plane < kPlaneCount;
    const T* const x_plane = x + (plane_ok ? plane : plane0) * (H * W);
    float* const to = &window[pl][ty][tx];
#pragma unroll
    for (int j = 0; j < kFillCols; ++j) {
      const int col = tx + j * kTW, iw = iw0 + col;
      if (j * kTW + kTW > kWW && col >= kWW) break;  // (the last step's idle columns)
      const bool col_ok = plane_ok && iw >= 0 && iw < W;
      const T* const from = x_plane + (i64{ih0 + ty} * W + iw);  // (row i at i * kRowThreads * W)
      float v[kFillRows];
#pragma unroll
      for (int i = 0; i < kFillRows; ++i) {
        const int ih = ih0 + ty + i * kRowThreads;
        v[i] = 0.0f;
        if (col_ok && ih >= 0 && ih < H) v[i] = Io::load(from[i * kRowThreads * W]);
      }
#pragma unroll
      for (int i = 0; i < kFillRows; ++i) {
        if (i * kRowThreads + kRowThreads <= kWH || ty + i * kRowThreads < kWH) {
          to[i * kRowThreads * kWW + j * kTW] = v[i];
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

  float acc[kBH];
#pragma unroll
  for (int i = 0; i < kBH; ++i) {
    acc[i] = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        acc[i] += window[pl][(ty * kBH + i) * SH + r * DH][tx * SW + s * DW] * taps[r][s];
      }
    }
  }
  const int ow = ow0 + tx;
  if (ow >= Q) return;
#pragma unroll
  for (int i = 0; i < kBH; ++i) {
    const int oh = oh0 + ty * kBH + i;
    if (oh < P) {
      const i64 idx = (plane * P + oh) * Q + ow;
      y[idx] = Io::store(ep.apply(acc[i], terms, idx % kPerSample, idx));
    }
  }
}
