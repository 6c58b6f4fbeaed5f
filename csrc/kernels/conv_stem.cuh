// Few-channel convolutions (a network's stem: 3 input channels, 7x7 or 3x3, stride 2) on
// tensor cores, fp16/bf16 NHWC, without gathering the reduction value by value.
//
// A tile is kBM consecutive output pixels of one output row, all output channels. Its input
// is R rows of one image, each a contiguous run of W * C values, and the tile reads one window
// of each: those windows are copied into shared memory as they lie in memory (4-byte cp.async,
// zero-filled outside the image), and the multiply reads A straight from them. The reduction
// is ordered so that a thread's A values sit at fixed offsets: one 16-wide k-step covers filter
// row r, 4 filter columns s = 4j + t and 4 channel slots c, where t = lane % 4 is the thread's
// column pair of the mma fragment; so kk = 2t + e is (s, c = e) and kk = 2t + 8 + e is
// (s, c = 2 + e). Slots past C and columns past S multiply zeros in B, and are read as zeros
// (an input's infinities must not meet them). C <= 4 channels; 7x7 filters then take 14
// k-steps, 3x3 ones 3.
//
// B, in that order, is built once per CTA as ready mma fragments (an 8-byte shared load per
// k-step, n-tile and thread); CTAs are persistent and copy the next tile's windows while they
// multiply the current one. The epilogue either stages the fp32 tile through shared memory
// (implicit_gemm.h: store_tile: 16-byte stores) or, with kStaged false, runs the chain on the
// accumulators in registers and stores each thread's two adjacent channels as one 4-byte word
// (NCHW output, kOutNHWC false: as two values, a plane apart):
// no 35 KB staging tile, so more CTAs fit (Nsight Compute on the 7x7/2 stem: 12% occupancy,
// the shared-memory pipe 72% busy). Rows past the output row are left out.
//
// From the code generator (namespace plan): kBM (64 or 128: 32 rows per warp), kBN (the
// output channels rounded up to 8, at most 128), kWarpsN (warps side by side along the
// channels, each its share of the n-tiles: more warps to hide latencies, fewer accumulators),
// kMinBlocks, kMmaDtype (1 fp16, 2 bf16), kStaged, and kWinPitch, kSmemBytes. It checks NHWC, one group, no dilation, C <= 4, K % 8 == 0 and
// W * C even (so no 4-byte word straddles an image row's end).
#pragma once

#include "implicit_gemm.h"
#include "mma.h"

namespace jaxfuse {
namespace stem {

using namespace plan;
using namespace implicit_gemm;

constexpr int kWarps = kBM / 32 * kWarpsN;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kNTiles = kBN / 8;                     // mma n-tiles (8 channels each)
constexpr int kWarpNTiles = kNTiles / kWarpsN;       // ... of one warp
static_assert(sizeof(FilterIo::type) == sizeof(Io::type), "filters in the plan's dtype");
static_assert(kNTiles % kWarpsN == 0, "whole n-tiles per warp");
constexpr int kColSteps = static_cast<int>((S + 3) / 4);  // k-steps per filter row
constexpr int kKSteps = static_cast<int>(R) * kColSteps;
constexpr i64 kSegments = (Q + kBM - 1) / kBM;       // tiles per output row
constexpr i64 kTiles = N * P * kSegments;
// A window: the input pixels one tile's filter row covers, and the columns of its last
// k-step's padding, in values; whole 4-byte words, one more for the tile's start parity.
constexpr int kWinPixels = (kBM - 1) * static_cast<int>(SW) + 4 * kColSteps;
constexpr int kWinWords = (kWinPixels * static_cast<int>(C) + 1) / 2 + 1;
static_assert(kWinPitch >= 2 * kWinWords && kWinPitch % 2 == 0, "window rows hold a window");
static_assert(C <= 4 && G == 1 && DH == 1 && DW == 1 && KG % 8 == 0 && kBN <= 128 &&
                  kBN >= KG && (W * C) % 2 == 0 && kNHWC,
              "the code generator offers this kernel only where it applies");
constexpr int kCPitch = kBN + 4;  // floats: the epilogue's staging tile

// Shared memory (dynamic): B's fragments, two window buffers, the staging tile.
constexpr int kBFragBytes = kKSteps * kNTiles * 32 * 8;
constexpr int kWinBytes = static_cast<int>(R) * kWinPitch * 2;
constexpr int kStageBytes = kStaged ? kBM * kCPitch * 4 : 0;
static_assert(kBFragBytes + 2 * kWinBytes + kStageBytes <= kSmemBytes, "shared memory");

// Filter value (r, s, c) of output channel k, 0 past the filter or the channels.
JF_DEVICE u16 filter_value(const Io::type* w, int r, int s, int c, int k) {
  if (s >= S || c >= C || k >= K) return 0;
  i64 at;
  if (kFilterLayout == kFilterHWIO) {
    at = ((i64(r) * S + s) * C + c) * K + k;
  } else if (kFilterLayout == kFilterOHWI) {
    at = ((i64(k) * R + r) * S + s) * C + c;
  } else {  // OIHW
    at = ((i64(k) * C + c) * R + r) * S + s;
  }
  return w[at];
}

// B's fragments in the k-step order above: for k-step (r, j), n-tile nt and lane (g, t),
// b0 = channels 0, 1 and b1 = channels 2, 3 of filter column s = 4j + t, output channel
// nt * 8 + g.
JF_DEVICE void fill_b_fragments(const Io::type* w, uint2* frags) {
  for (int i = threadIdx.x; i < kKSteps * kNTiles * 32; i += kThreads) {
    const int lane = i % 32, nt = (i / 32) % kNTiles, step = i / (32 * kNTiles);
    const int r = step / kColSteps, s = (step % kColSteps) * 4 + lane % 4;
    const int k = nt * 8 + lane / 4;
    frags[i] = make_uint2(pack_halves(filter_value(w, r, s, 0, k), filter_value(w, r, s, 1, k)),
                          pack_halves(filter_value(w, r, s, 2, k), filter_value(w, r, s, 3, k)));
  }
}

struct TilePlace {
  i64 image, p, q0;  // image, output row, first output column
  int w0;            // input column of the window's first pixel (negative in the padding)
};

JF_DEVICE TilePlace place(i64 tile) {
  TilePlace t;
  t.q0 = tile % kSegments * kBM;
  t.p = tile / kSegments % P;
  t.image = tile / (kSegments * P);
  t.w0 = static_cast<int>(t.q0 * SW) - static_cast<int>(PL);
  return t;
}

// Where the window's first value lies in its shared-memory row: the copies move aligned
// 4-byte words, so a window starting at an odd value index starts one value in.
JF_DEVICE int window_shift(const TilePlace& t) {
  return static_cast<int>((i64(t.w0) * C) & 1);
}

// Issues the copies of tile `t`'s R windows into `win` (zeros outside the image).
JF_DEVICE void copy_windows(const Io::type* x, const TilePlace& t, u16* win) {
  const i64 shift = window_shift(t);
  for (int i = threadIdx.x; i < static_cast<int>(R) * kWinWords; i += kThreads) {
    const int r = i / kWinWords, word = i % kWinWords;
    const i64 h = t.p * SH - PT + r;
    const i64 row = (t.image * H + h) * W * C;  // the image row's first value (even)
    // The word's first value, as an index within the image row (even: the row's values
    // start on a word).
    const i64 v = i64(t.w0) * C - shift + 2 * word;
    const bool inside = h >= 0 && h < H && v >= 0 && v + 2 <= W * C;
    const Io::type* src = inside ? x + row + v : x;
    mma::copy4_async(mma::smem_addr(win + r * kWinPitch + 2 * word), src, inside);
  }
  mma::commit_copies();
}

// Two values of window row `r` at value offset `at` as one fragment register; `second` false
// (a channel slot past C) reads a zero.
JF_DEVICE u32 pair(const u16* row, int at, bool first, bool second) {
  const u16 lo = first ? row[at] : u16(0);
  const u16 hi = second ? row[at + 1] : u16(0);
  return pack_halves(lo, hi);
}

}  // namespace stem
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::stem::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_stem(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::stem;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Epilogue::Channel terms[kBN];
  uint2* bfrag = reinterpret_cast<uint2*>(smem);
  u16* windows = reinterpret_cast<u16*>(smem + kBFragBytes);
  float* tile_out = reinterpret_cast<float*>(smem + kBFragBytes + 2 * kWinBytes);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const Epilogue ep(p);
  const Io::type* x = static_cast<const Io::type*>(p.x);
  Io::type* y = static_cast<Io::type*>(p.y);

  i64 tile = blockIdx.x;
  if (tile < kTiles) copy_windows(x, place(tile), windows);
  fill_b_fragments(static_cast<const Io::type*>(p.w), bfrag);
  fill_terms<kBN, kThreads>(ep, terms, 0, 0);

  for (int buf = 0; tile < kTiles; tile += gridDim.x, buf ^= 1) {
    const TilePlace here = place(tile);
    const i64 next = tile + gridDim.x;
    if (next < kTiles) {
      copy_windows(x, place(next), windows + (buf ^ 1) * kWinBytes / 2);
      mma::wait_copies<1>();
    } else {
      mma::wait_copies<0>();
    }
    __syncthreads();  // this tile's windows (and, the first time, B and the terms) are in

    const u16* win = windows + buf * kWinBytes / 2;
    const int shift = window_shift(here);
    // Value offsets of this thread's four rows (two 16-row mma tiles, rows g and g + 8) at
    // filter column t.
    int row_at[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int q = warp_m * 32 + mt * 16 + half * 8 + g;
        row_at[mt][half] = shift + (q * static_cast<int>(SW) + t) * static_cast<int>(C);
      }
    }
    float acc[2][kWarpNTiles][4] = {};
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const u16* row = win + r * kWinPitch;
#pragma unroll
      for (int j = 0; j < kColSteps; ++j) {
        const bool column = 4 * j + t < S;  // filter column 4j + t exists
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int at = row_at[mt][half] + 4 * j * static_cast<int>(C);
            a[mt][half] = pair(row, at, column, column && C > 1);          // channels 0, 1
            a[mt][2 + half] = pair(row, at + 2, column && C > 2, column && C > 3);  // 2, 3
          }
        }
        const uint2* b = bfrag + ((r * kColSteps + j) * kNTiles + warp_n * kWarpNTiles) * 32 + lane;
#pragma unroll
        for (int nt = 0; nt < kWarpNTiles; ++nt) {
          const uint2 bv = b[nt * 32];
          const u32 frag[2] = {bv.x, bv.y};
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) mma::mma_16x8x16<kMmaDtype>(acc[mt][nt], a[mt], frag);
        }
      }
    }

    const i64 m0 = (here.image * P + here.p) * Q + here.q0;
    const int rows = static_cast<int>(Q - here.q0 < kBM ? Q - here.q0 : kBM);
    if constexpr (!kStaged) {
      __syncthreads();  // every warp is done with this tile's windows
      // The chain on the accumulators: this thread's channels k, k + 1 of each n-tile, for its
      // four rows; the per-channel terms read once per n-tile.
#pragma unroll
      for (int nt = 0; nt < kWarpNTiles; ++nt) {
        const int k = (warp_n * kWarpNTiles + nt) * 8 + 2 * t;
        const Epilogue::Channel lo = terms[k], hi = terms[k + 1];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = warp_m * 32 + mt * 16 + half * 8 + g;
            if (row >= rows) continue;
            const i64 m = m0 + row;
            if constexpr (!kOutNHWC) {  // NCHW output: channels k and k + 1 are planes apart
              const i64 param = k * (P * Q) + m % (P * Q);
              const i64 out = m / (P * Q) * K * (P * Q) + param;
              y[out] = Io::store(ep.apply(acc[mt][nt][2 * half], lo, param, out));
              y[out + P * Q] = Io::store(
                  ep.apply(acc[mt][nt][2 * half + 1], hi, param + P * Q, out + P * Q));
              continue;
            }
            const i64 out = m * K + k, param = (m % (P * Q)) * K + k;
            float z0 = 0.0f, z1 = 0.0f;
            if constexpr (Epilogue::kSide) {
              const u32 z = *reinterpret_cast<const u32*>(static_cast<const Io::type*>(p.side) + out);
              z0 = Io::load(static_cast<u16>(z & 0xffff));
              z1 = Io::load(static_cast<u16>(z >> 16));
            }
            const float v0 = ep.apply_side(acc[mt][nt][2 * half], lo, param, z0);
            const float v1 = ep.apply_side(acc[mt][nt][2 * half + 1], hi, param + 1, z1);
            *reinterpret_cast<u32*>(y + out) = pack_halves(Io::store(v0), Io::store(v1));
          }
        }
      }
      continue;
    }
    // The accumulators through the staging tile, then the chain and 16-byte stores.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kWarpNTiles; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = warp_m * 32 + mt * 16 + half * 8 + g;
          const int col = (warp_n * kWarpNTiles + nt) * 8 + 2 * t;
          *reinterpret_cast<float2*>(tile_out + row * kCPitch + col) =
              make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
        }
      }
    }
    __syncthreads();
    if constexpr (kOutNHWC) {
      store_tile<kBM, kBN, kCPitch, kThreads>(ep, tile_out, terms, m0, 0, 0, y, m0 + rows);
    } else {
      store_tile_planes<kBM, kBN, kCPitch, kThreads, 0>(ep, tile_out, terms, m0, 0, 0, y,
                                                        m0 + rows);
    }
    __syncthreads();  // the staging tile and this tile's windows are free again
  }
}
