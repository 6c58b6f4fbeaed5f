// Depthwise convolution (one input and one output channel per group), NHWC activations, HWIO
// filters (R, S, 1, C), fp32 accumulation on CUDA cores. Two kernels; the code generator
// (csrc/gpu/codegen.cc) defines JF_DEPTHWISE_TILED and the tile constants for the first.
//
// jaxfuse_conv_depthwise (tiled): a CTA owns a kCS-channel slice of a kTH x kTW tile of output
// pixels. It copies the tile's input window, halo and zero padding included, into shared
// memory once (cp.async of kFill bytes, consecutive threads on consecutive bytes of a pixel's
// channels), then each thread computes a kBH x kBW block of output pixels for one 32-bit word
// of channels (2 fp16/bf16 channels or 1 fp32 channel): it walks the block's input rows, reads
// and converts each input word once, and adds it to every output of the block it touches
// (register blocking in both directions: (kBH - 1) * SH + R rows by (kBW - 1) * SW + S columns
// of reads for kBH * kBW outputs). The filter taps (as fp32) and the epilogue's per-channel
// terms are tabulated in shared memory once a CTA, a thread a channel, and each thread keeps
// its own in registers, the taps scaled by the chain's leading affine steps (the convolution's
// alpha, bias, batch norm) and the accumulators started at their shift, so that each output
// runs only the rest of the chain (the whole chain was about a fifth of the kernel's
// instructions). Each output word goes out as one 32-bit store; a warp's stores cover
// consecutive channels of a pixel. Needs C % kCS == 0 and
// buffers aligned to kFill bytes (4 or 16). No tensor cores: a dense MMA over a depthwise
// product multiplies other channels' (or positions') inputs by zero weights, and 0 * inf =
// NaN would leak across channels where the convolution has none.
//
// Copy engine (JF_DEPTHWISE_TMA, sm_90): one thread asks for a tile's whole window as a box
// of the input's tensor map (channels x columns x rows of one image, zeros outside the image)
// completing on a shared-memory barrier; the other threads go straight to the tables. The
// window's layout is the one cp.async builds.
//
// Walking (kWalk > 1): a CTA computes kWalk consecutive tiles of its slice (the next images'
// tiles, for small images) with two windows in shared memory: the next tile's window is copied
// while this one's outputs are computed, and the tables are built once for all of them. Small
// layers at large batch otherwise spend each short CTA waiting for its one window, behind a
// barrier, with the tables built again for a few thousand outputs.
//
// jaxfuse_conv_depthwise_vector (the kernel before the tiled one: for filters too large for the
// tiled kernel's registers, and one more candidate autotuning times): each thread computes one
// output pixel for 16 bytes of channels, reading input and filter taps as 16-byte vectors
// through L1. Needs C % (16 / sizeof(T)) == 0 and 16-byte aligned buffers.
#pragma once

#ifdef JF_DEPTHWISE_TMA
#include "tma.h"
#endif

namespace jaxfuse {
namespace depthwise {

using namespace plan;
typedef Io::type T;

#ifdef JF_DEPTHWISE_TILED

template <bool Narrow>
struct IndexType {
  typedef int type;
};
template <>
struct IndexType<false> {
  typedef i64 type;
};

constexpr int kCh = 4 / static_cast<int>(sizeof(T));  // channels per 32-bit word
constexpr int kThreadsC = kCS / kCh;                   // threads across a slice's channels
constexpr int kBlocksH = kTH / kBH, kBlocksW = kTW / kBW;
constexpr int kInRows = (kBH - 1) * SH + (R - 1) * DH + 1;  // one thread's input window
constexpr int kInCols = (kBW - 1) * SW + (S - 1) * DW + 1;
constexpr int kTileRows = (kTH - 1) * SH + (R - 1) * DH + 1;  // the CTA's, in shared memory
constexpr int kTileCols = (kTW - 1) * SW + (S - 1) * DW + 1;
constexpr i64 kTilesH = (P + kTH - 1) / kTH, kTilesW = (Q + kTW - 1) / kTW;
constexpr i64 kTiles = N * kTilesH * kTilesW;
constexpr i64 kSlices = C / kCS;
constexpr int kWindows = kWalk > 1 ? 2 : 1;  // walking: copy the next while computing this
static_assert(kWalk >= 1, "tiles a CTA");
constexpr int kFillElems = kFill / static_cast<int>(sizeof(T));
constexpr int kChunksPerPixel = kCS / kFillElems;
constexpr int kChunks = kTileRows * kTileCols * kChunksPerPixel;
constexpr int kFillSteps = (kChunks + kThreads - 1) / kThreads;
// Offsets within one image in 32 bits where every one computed fits, in bytes: the output's,
// and the input's over the rows and columns tiles reach (padding included, however large).
constexpr i64 kLastH = (kTilesH * kTH - 1) * SH - PT + (R - 1) * DH;  // the last row read
constexpr i64 kLastW = (kTilesW * kTW - 1) * SW - PL + (S - 1) * DW;
constexpr i64 kReachH = (PT < 0 ? -PT : PT) + (kLastH < 0 ? -kLastH : kLastH) + 1;
constexpr i64 kReachW = (PL < 0 ? -PL : PL) + (kLastW < 0 ? -kLastW : kLastW) + 1;
typedef IndexType<((kReachH * W * C + kReachW * C) * sizeof(T) < (i64(1) << 31)) &&
                  (P * Q * K * sizeof(T) < (i64(1) << 31))>::type Idx;
constexpr Idx kW = W, kC = C, kQ = Q, kK = K;
// base + offset for an offset known to be >= 0 (one 32x64-bit multiply-add in 32 bits).
template <typename Pointer>
JF_DEVICE Pointer advance(Pointer base, Idx offset) {
  if constexpr (sizeof(Idx) == 4) return base + static_cast<u32>(offset);
  return base + offset;
}
// CTA and tile numbers in 32 bits where they fit.
typedef IndexType<(kTiles * kSlices < (i64(1) << 31))>::type TileIdx;

static_assert(sizeof(FilterIo::type) == sizeof(Io::type), "filters in the plan's dtype");
static_assert(K == C && G == C, "depthwise, multiplier 1");
static_assert(kNHWC && kOutNHWC, "NHWC in and out (codegen: IsDepthwise)");
static_assert(C % kCS == 0 && kCS % kCh == 0 && kCS % kFillElems == 0, "whole slices");
static_assert((kFill == 16 || kFill == 4) && (C * sizeof(T)) % kFill == 0, "aligned copies");
static_assert(kTH % kBH == 0 && kTW % kBW == 0, "whole blocks per tile");
static_assert(kThreads == kThreadsC * kBlocksH * kBlocksW, "one thread per (word, block)");
// Shared memory: the tile's input window (two when walking), then the slice's taps (fp32,
// tap-major) and per-channel epilogue terms, tabulated once a CTA; with the copy engine, from
// a 128-byte aligned base, windows 128-byte aligned, and a barrier per window last.
#ifdef JF_DEPTHWISE_TMA
constexpr bool kTma = true;
#else
constexpr bool kTma = false;
#endif
constexpr int kWindowBytes = kTileRows * kTileCols * kCS * static_cast<int>(sizeof(T));
constexpr int kWindowPitch = kTma ? (kWindowBytes + 127) / 128 * 128 : kWindowBytes;
constexpr int kTapsOffset = kWindows * kWindowPitch;
constexpr int kTermsOffset = kTapsOffset + R * S * kCS * 4;
constexpr int kBarriersOffset = (kTermsOffset + kCS * 20 + 7) / 8 * 8;
static_assert(kWindowPitch % 16 == 0 || kWindows == 1, "the second window 16-byte aligned");
static_assert(sizeof(Epilogue::Channel) == 20, "the code generator sizes the table so");
static_assert(kSmemBytes == (kTma ? 128 + kBarriersOffset + 8 * kWindows : kTermsOffset + kCS * 20),
              "shared memory: windows, taps, terms (and barriers)");

// The 32-bit shared-memory address of a generic pointer into shared memory.
JF_DEVICE u32 shared_address(const void* p) {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 addr;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(p));
  return addr;
#else
  return 0;
#endif
}

// kFill bytes global -> shared at byte `offset` of the tile (`smem`, address `smem_addr`),
// zeros where `valid` is false (padding, beyond the input).
JF_DEVICE void copy_async(unsigned char* smem, u32 smem_addr, int offset,
                          const unsigned char* src, bool valid) {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  (void)smem;
  if (kFill == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr + offset),
                 "l"(src), "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr + offset),
                 "l"(src), "r"(valid ? 4 : 0));
  }
#else
  (void)smem_addr;
  if (kFill == 16) {
    Vec16 v = {{0u, 0u, 0u, 0u}};
    if (valid) v = *reinterpret_cast<const Vec16*>(src);
    *reinterpret_cast<Vec16*>(smem + offset) = v;
  } else {
    *reinterpret_cast<u32*>(smem + offset) = valid ? *reinterpret_cast<const u32*>(src) : 0u;
  }
#endif
}

// The copies issued since the last commit form one group; wait_copies<n> returns once at most
// n groups are still in flight.
JF_DEVICE void commit_copies() {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int Pending>
JF_DEVICE void wait_copies() {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

// One 32-bit word of channels <-> kCh floats (channel c in the low half for 16-bit types).
JF_DEVICE void unpack(u32 word, float (&v)[kCh]) {
  if constexpr (kCh == 1) {
    v[0] = bits_to_float(word);
  } else if constexpr (kDtype == 2) {
    v[0] = bits_to_float(word << 16);
    v[1] = bits_to_float(word & 0xffff0000u);
  } else {
    v[0] = Io::load(static_cast<u16>(word & 0xffffu));
    v[1] = Io::load(static_cast<u16>(word >> 16));
  }
}

JF_DEVICE u32 pack(const float (&v)[kCh]) {
  if constexpr (kCh == 1) {
    return float_to_bits(v[0]);
  } else {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 word;  // one instruction for both channels; the same rounding as Io::store
    if constexpr (kDtype == 2) {
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(v[1]), "f"(v[0]));
    } else {
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(v[1]), "f"(v[0]));
    }
    return word;
#else
    return u32(Io::store(v[0])) | (u32(Io::store(v[1])) << 16);
#endif
  }
}

// Issues the copies of the input window of a tile (rows from ih0, columns from iw0) of the
// slice at byte `x_slice` (x + n * H * W * C + first channel) into shared memory at `smem`
// (address `smem_addr`), pixel-major, kCS channels a pixel; the caller commits and waits.
// Chunk i (kFill bytes) is byte i * kFill of the tile: row i / kRowChunks, column and part of
// the pixel from i % kRowChunks. When kThreads is a multiple of kRowChunks, a thread's
// column and part are the same at every step and only its row advances.
constexpr int kRowChunks = kTileCols * kChunksPerPixel;
constexpr Idx kRowBytes = kW * kC * Idx(sizeof(T)), kPixelBytes = kC * Idx(sizeof(T));
JF_DEVICE void fill_tile(unsigned char* smem, u32 smem_addr, const unsigned char* x_slice,
                         int ih0, int iw0, int tid) {
  if constexpr (kThreads % kRowChunks == 0) {
    constexpr int kRowsPerStep = kThreads >= kRowChunks ? kThreads / kRowChunks : 1;
    constexpr int kSteps = (kTileRows + kRowsPerStep - 1) / kRowsPerStep;
    const int rc = static_cast<unsigned>(tid) % kRowChunks;
    const int row = static_cast<unsigned>(tid) / kRowChunks;
    const int iw = iw0 + static_cast<unsigned>(rc) / kChunksPerPixel;
    const bool column_valid = static_cast<unsigned>(iw) < static_cast<unsigned>(W);
    const Idx first = Idx(ih0 + row) * kRowBytes + Idx(iw) * kPixelBytes +
                      (static_cast<unsigned>(rc) % kChunksPerPixel) * kFill;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      if (kTileRows % kRowsPerStep != 0 && step == kSteps - 1 &&
          row + step * kRowsPerStep >= kTileRows) {
        break;
      }
      const int ih = ih0 + row + step * kRowsPerStep;
      const bool valid = column_valid && static_cast<unsigned>(ih) < static_cast<unsigned>(H);
      const Idx offset = first + Idx(step * kRowsPerStep) * kRowBytes;
      copy_async(smem, smem_addr, (tid + step * kThreads) * kFill,
                 advance(x_slice, valid ? offset : 0), valid);
    }
  } else {
#pragma unroll
    for (int step = 0; step < kFillSteps; ++step) {
      const int i = tid + step * kThreads;
      if (kChunks % kThreads != 0 && step == kFillSteps - 1 && i >= kChunks) break;
      const int row = static_cast<unsigned>(i) / kRowChunks;
      const int rc = static_cast<unsigned>(i) % kRowChunks;
      const int ih = ih0 + row, iw = iw0 + static_cast<unsigned>(rc) / kChunksPerPixel;
      const bool valid = static_cast<unsigned>(ih) < static_cast<unsigned>(H) &&
                         static_cast<unsigned>(iw) < static_cast<unsigned>(W);
      const Idx offset = Idx(ih) * kRowBytes + Idx(iw) * kPixelBytes +
                         (static_cast<unsigned>(rc) % kChunksPerPixel) * kFill;
      copy_async(smem, smem_addr, i * kFill, advance(x_slice, valid ? offset : 0), valid);
    }
  }
}

// A thread's block of outputs (from row oh0, column ow0, channel c of the sample at `y`,
// element `sample` of the output) through the chain: only the rest of it after the folded
// affine steps (Rest), or all of it.
template <bool Rest>
JF_DEVICE void store_block(const Epilogue& ep, T* y, const float (&acc)[kBH][kBW][kCh],
                           const Epilogue::Channel (&terms)[kCh], int oh0, int ow0, int c,
                           i64 sample) {
#pragma unroll
  for (int o = 0; o < kBH; ++o) {
    if (P % kBH != 0 && oh0 + o >= P) break;
#pragma unroll
    for (int q = 0; q < kBW; ++q) {
      if (Q % kBW != 0 && ow0 + q >= Q) break;
      const Idx param = (Idx(oh0 + o) * kQ + ow0 + q) * kK + c;  // offset within the sample
      float v[kCh];
#pragma unroll
      for (int j = 0; j < kCh; ++j) {
        if constexpr (Rest) {
          v[j] = ep.apply_rest(acc[o][q][j], terms[j], param + j, sample + param + j);
        } else {
          v[j] = ep.apply(acc[o][q][j], terms[j], param + j, sample + param + j);
        }
      }
      *reinterpret_cast<u32*>(y + param) = pack(v);
    }
  }
}

// Tile number -> its image, tile row and tile column.
struct TilePosition {
  i64 n;
  int th, tw;
};
JF_DEVICE TilePosition tile_position(TileIdx tile) {
  return {tile / TileIdx(kTilesW * kTilesH),
          static_cast<int>(tile / TileIdx(kTilesW) % TileIdx(kTilesH)),
          static_cast<int>(tile % TileIdx(kTilesW))};
}

// Tile `tile` of the slice starting at channel `channel0`: issues its window's copies into
// window `buffer`.
JF_DEVICE void fill_window(unsigned char* smem, const T* x, TileIdx tile, int channel0,
                           int buffer, int tid) {
  const TilePosition at = tile_position(tile);
  fill_tile(smem + buffer * kWindowPitch, shared_address(smem) + buffer * kWindowPitch,
            reinterpret_cast<const unsigned char*>(x + at.n * (H * W * C) + channel0),
            at.th * kTH * SH - PT, at.tw * kTW * SW - PL, tid);
}

#ifdef JF_DEPTHWISE_TMA
// The same window as one box copy through the input's map (`map`), completing on window
// `buffer`'s barrier; shared memory from the aligned base address `base`. One thread calls it.
JF_DEVICE void fill_window_bulk(u32 base, const void* map, TileIdx tile, int channel0,
                                int buffer) {
  const TilePosition at = tile_position(tile);
  const u32 bar = base + kBarriersOffset + 8 * buffer;
  tma::arrive_expect_bytes(bar, kWindowBytes);  // (zero-filled bytes count too)
  tma::load_box(base + buffer * kWindowPitch, map, channel0, at.tw * kTW * SW - PL,
                at.th * kTH * SH - PT, static_cast<int>(at.n), bar);
}
#endif

}  // namespace depthwise
}  // namespace jaxfuse

#ifdef JF_DEPTHWISE_TMA
extern "C" __global__ void __launch_bounds__(jaxfuse::plan::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_depthwise(const __grid_constant__ jaxfuse::TmaParams args) {
  const jaxfuse::FusedParams& p = args.p;
#else
extern "C" __global__ void __launch_bounds__(jaxfuse::plan::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_depthwise(jaxfuse::FusedParams p) {
#endif
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::depthwise;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // (The copy engine writes to 128-byte aligned addresses: the code generator left the slack.)
  unsigned char* smem = kTma ? smem_raw + ((128u - (shared_address(smem_raw) & 127u)) & 127u)
                             : smem_raw;
  const Epilogue ep(p);
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  T* y = static_cast<T*>(p.y);

  const int tid = threadIdx.x;  // (non-negative: unsigned division where it divides)
  const TileIdx cta = blockIdx.x;
  const int slice = static_cast<int>(cta % TileIdx(kSlices));
  const TileIdx first_tile = cta / TileIdx(kSlices) * TileIdx(kWalk);
  const int count = static_cast<int>(
      kTiles % kWalk == 0 ? kWalk : min(TileIdx(kWalk), TileIdx(kTiles) - first_tile));
  const int tc = static_cast<unsigned>(tid) % kThreadsC;
  const int block = static_cast<unsigned>(tid) / kThreadsC;
  const int bi = static_cast<unsigned>(block) / kBlocksW;
  const int bj = static_cast<unsigned>(block) % kBlocksW;
  const int c = slice * kCS + tc * kCh;  // this thread's first channel

  // The first windows' copies go out before the tables are built, so the tables' loads wait
  // beside them rather than ahead of them.
#ifdef JF_DEPTHWISE_TMA
  (void)x;
  const u32 base = shared_address(smem);
  if (tid == 0) {
    for (int b = 0; b < kWindows; ++b) tma::barrier_init(base + kBarriersOffset + 8 * b, 1);
    tma::fence_barrier_init();
    fill_window_bulk(base, &args.x, first_tile, slice * kCS, 0);
    if (kWalk > 1 && count > 1) fill_window_bulk(base, &args.x, first_tile + 1, slice * kCS, 1);
  }
#else
  fill_window(smem, x, first_tile, slice * kCS, 0, tid);
  commit_copies();
  if (kWalk > 1) {
    if (count > 1) fill_window(smem, x, first_tile + 1, slice * kCS, 1, tid);
    commit_copies();
  }
#endif
  // The slice's filter taps (fp32) and epilogue terms, tabulated in shared memory by its first
  // kCS threads, then read into registers by all: each thread needs its word's channels'.
  float* tap_table = reinterpret_cast<float*>(smem + kTapsOffset);
  Epilogue::Channel* term_table = reinterpret_cast<Epilogue::Channel*>(smem + kTermsOffset);
  for (int i = tid; i < kCS; i += kThreads) {
#pragma unroll
    for (int t = 0; t < R * S; ++t) tap_table[t * kCS + i] = Io::load(w[t * C + slice * kCS + i]);
    term_table[i] = ep.channel(slice * kCS + i);
  }
#ifdef JF_DEPTHWISE_TMA
  __syncthreads();           // the tables are complete, the barriers initialized
  tma::wait(base + kBarriersOffset, 0);  // the first window has landed
#else
  wait_copies<kWindows - 1>();  // the first window has landed (the second may not have)
  __syncthreads();              // ... everyone's, and the tables are complete
#endif
  float taps[R * S][kCh];
#pragma unroll
  for (int t = 0; t < R * S; ++t)
#pragma unroll
    for (int j = 0; j < kCh; ++j) taps[t][j] = tap_table[t * kCS + tc * kCh + j];
  Epilogue::Channel terms[kCh];
#pragma unroll
  for (int j = 0; j < kCh; ++j) terms[j] = term_table[tc * kCh + j];
  // The chain's leading affine steps (alpha, bias, batch norm) folded into the taps and the
  // accumulators' start, so each output runs only the rest of the chain; a thread whose
  // channels do not allow it keeps the taps as they are and runs the whole chain.
  float scale[kCh], start[kCh];
  bool folded = true;
#pragma unroll
  for (int j = 0; j < kCh; ++j) folded = ep.leading_affine(terms[j], scale[j], start[j]) && folded;
#pragma unroll
  for (int j = 0; j < kCh; ++j) {
    if (!folded) {
      scale[j] = 1.0f;
      start[j] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < R * S; ++t) taps[t][j] *= scale[j];
  }

  for (int step = 0; step < count; ++step) {
    const TileIdx tile = first_tile + step;
    const auto [n, th, tw] = tile_position(tile);
    const int oh0 = th * kTH + bi * kBH, ow0 = tw * kTW + bj * kBW;  // this thread's block
    // A block wholly beyond the output's edge has nothing to compute (it still takes part in
    // the barriers below).
    if (oh0 < P && ow0 < Q) {
      float acc[kBH][kBW][kCh];
#pragma unroll
      for (int o = 0; o < kBH; ++o)
#pragma unroll
        for (int q = 0; q < kBW; ++q)
#pragma unroll
          for (int j = 0; j < kCh; ++j) acc[o][q][j] = start[j];
      // Input row i of the block feeds output row o through filter row r where o * SH + r * DH
      // == i: each row is read and converted once.
      const u32* window = reinterpret_cast<const u32*>(smem + (step % kWindows) * kWindowPitch) +
                          ((bi * kBH * SH) * kTileCols + bj * kBW * SW) * kThreadsC + tc;
#pragma unroll
      for (int i = 0; i < kInRows; ++i) {
        float in[kInCols][kCh];
#pragma unroll
        for (int col = 0; col < kInCols; ++col) {
          unpack(window[(i * kTileCols + col) * kThreadsC], in[col]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int d = i - r * DH;
          if (d < 0 || d % SH != 0 || d / SH >= kBH) continue;
          const int o = d / SH;
#pragma unroll
          for (int s = 0; s < S; ++s)
#pragma unroll
            for (int q = 0; q < kBW; ++q)
#pragma unroll
              for (int j = 0; j < kCh; ++j) {
                acc[o][q][j] = fmaf(in[q * SW + s * DW][j], taps[r * S + s][j], acc[o][q][j]);
              }
        }
      }

      const i64 sample = n * kPerSample;
      if (folded) {
        store_block<true>(ep, y + sample, acc, terms, oh0, ow0, c, sample);
      } else {
        store_block<false>(ep, y + sample, acc, terms, oh0, ow0, c, sample);
      }
    }
    if (kWalk > 1 && step + 1 < count) {
      __syncthreads();  // everyone is done with this window: refill it with tile step + 2
#ifdef JF_DEPTHWISE_TMA
      if (tid == 0 && step + 2 < count) {
        fill_window_bulk(base, &args.x, tile + 2, slice * kCS, step % 2);
      }
      // Tile step + 1's window has landed: its buffer's ((step + 1) / 2)-th fill.
      tma::wait(base + kBarriersOffset + 8 * ((step + 1) % 2), ((step + 1) / 2) & 1);
#else
      if (step + 2 < count) fill_window(smem, x, tile + 2, slice * kCS, step % 2, tid);
      commit_copies();
      wait_copies<1>();  // tile step + 1's window has landed
      __syncthreads();
#endif
    }
  }
}

#else  // !JF_DEPTHWISE_TILED

constexpr int kLanes = sizeof(Vec16) / sizeof(T);
constexpr i64 kChannelVectors = C / kLanes;
constexpr i64 kWork = N * P * Q * kChannelVectors;
static_assert(C % kLanes == 0 && K == C && G == C, "depthwise, whole channel vectors");
}  // namespace depthwise
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(256)
    jaxfuse_conv_depthwise_vector(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
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

#endif  // JF_DEPTHWISE_TILED
