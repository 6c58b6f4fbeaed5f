// Implicit-GEMM convolution on tensor cores with warp-level mma.sync (sm_80 and newer):
// fp16/bf16 NHWC activations (16x8x16 multiplies), or fp32 ones through TF32 (16x8x8
// multiplies, operands rounded to TF32 as they leave shared memory, as lax's default precision
// allows on GPUs), fp32 accumulation. (On sm_90 the code generator prefers conv_wgmma.cuh for
// 16-bit plans; this kernel serves Ampere, fp32, and the shapes wgmma's tiles do not fit.)
//
// Each pipeline stage copies the BM x BK slice of A (one filter tap, BK consecutive channels:
// contiguous 16-byte runs, zero-filled in the padding) and the BK x BN slice of B into shared
// memory with cp.async; kStages - 1 stages are in flight while the warps multiply the oldest.
// Rows are padded by 16 bytes so ldmatrix reads hit distinct banks. The epilogue stages the
// fp32 tile through shared memory (implicit_gemm.h: store_tile).
//
// Few input channels (the 3-channel stem): the reduction index kk = (r, s, c) is flattened and
// zero-padded to whole k-tiles, and A is gathered element by element through registers (a
// tap's 3 channels are not a 16-byte run), prefetched one k-tile ahead; B (HWIO, whose rows
// are exactly kk) still streams in with cp.async.
//
// Tile sizes come from the code generator (namespace plan: kBM, kBN, kBK, kWarpsM, kWarpsN,
// kStages, kMinBlocks, kSmemBytes); it also checks KG % 8 == 0 (and HWIO filters when
// CG % kBK != 0), and the host falls back to the direct kernel for buffers that are not
// 16-byte aligned.
#pragma once

#include "implicit_gemm.h"
#include "mma.h"

namespace jaxfuse {
namespace igemm {

using namespace plan;
using namespace implicit_gemm;

constexpr bool kTf32 = kDtype == 0;
// Shared memory holds the operands as stored: 16-bit values, or fp32 ones (TF32 plans).
typedef Io::type Elem;
constexpr int kChunk = 16 / static_cast<int>(sizeof(Elem));  // elements per 16-byte copy
constexpr int kKStep = kTf32 ? 8 : 16;                          // k of one mma instruction
constexpr int kThreads = kWarpsM * kWarpsN * kWarpSize;
constexpr int kWM = kBM / kWarpsM, kWN = kBN / kWarpsN;  // one warp's tile
constexpr int kFragsM = kWM / 16, kFragsN = kWN / 8;     // mma tiles per warp
constexpr bool kGatherA = CG % kBK != 0;  // few channels: flattened, gathered reduction
constexpr i64 kReduction = kTaps * CG;
constexpr int kKTiles = static_cast<int>((kReduction + kBK - 1) / kBK);

// Shared memory, in elements: A stored [m][kk]; B stored [kk][k] for HWIO filters (read with
// transposing ldmatrix, or per element for TF32) or [k][kk] otherwise. Rows are padded by 16
// bytes (kk-contiguous rows: distinct banks for ldmatrix, and for TF32's per-element fragment
// reads, whose 8 rows x 4 columns then fall in 32 banks) or by 8 elements ([kk][k] rows:
// TF32 reads 4 rows x 8 columns, so rows must be 8 banks apart).
constexpr int kAPitch = kBK + kChunk;
constexpr int kBPitch = kFiltersKMajor ? kBK + kChunk : kBN + 8;
constexpr int kATile = kBM * kAPitch;
constexpr int kBTile = kFiltersKMajor ? kBN * kBPitch : kBK * kBPitch;
constexpr int kStage = kATile + kBTile;
constexpr int kCPitch = kBN + 4;  // floats: the epilogue's staging tile

// 16-byte chunks per stage, and per thread (rounded up: tiles whose chunks do not split
// evenly over the threads leave the last round partly idle, e.g. 16x64 B slices on 256 threads).
constexpr int kAChunksPerRow = kBK / kChunk;
constexpr int kAChunkCount = kBM * kAChunksPerRow, kBChunkCount = kBK * kBN / kChunk;
constexpr int kAChunks = (kAChunkCount + kThreads - 1) / kThreads;
constexpr int kBChunks = (kBChunkCount + kThreads - 1) / kThreads;
// Gathered A: each thread fills kGatherRun consecutive kk of one row.
constexpr int kGatherThreadsPerRow = kThreads / kBM;
constexpr int kGatherRun = kBK / (kGatherThreadsPerRow > 0 ? kGatherThreadsPerRow : 1);

static_assert(kWM % 16 == 0 && kWN % 16 == 0, "warp tiles are whole 16x16 fragments");
static_assert(kBK % 16 == 0, "whole mma k-steps");
static_assert(!kGatherA || (!kFiltersKMajor && kStages == 2), "gathered A: HWIO, two stages");
static_assert(!kGatherA || (kThreads % kBM == 0 && kGatherRun % 8 == 0), "one row per thread");
static_assert(!kGatherA || !kTf32, "gathered A: 16-bit values");
static_assert(KG % kChunk == 0 && (kGatherA || C % kChunk == 0), "16-byte rows");
static_assert(kStages * kStage * static_cast<int>(sizeof(Elem)) <= kSmemBytes &&
              kBM * kCPitch * 4 <= kSmemBytes, "shared memory budget");

// Gathered A: this thread's kGatherRun consecutive kk of its row, into registers.
JF_DEVICE void gather_a(const Io::type* x, const PixelRow& row, int kt, i64 channel0, int tid,
                        u16 (&values)[kGatherRun]) {
  const i64 kk0 = i64(kt) * kBK + (tid % kGatherThreadsPerRow) * kGatherRun;
#pragma unroll
  for (int j = 0; j < kGatherRun; ++j) {
    const i64 kk = kk0 + j;
    const int tap = static_cast<int>(kk / CG);
    const Io::type* src = kk < kReduction
        ? a_source(x, row, tap / static_cast<int>(S), tap % static_cast<int>(S),
                   channel0 + kk % CG)
        : nullptr;
    values[j] = src ? *src : u16(0);
  }
}

JF_DEVICE void store_gathered_a(u16* sa, int tid, const u16 (&values)[kGatherRun]) {
  u16* dst = sa + (tid / kGatherThreadsPerRow) * kAPitch + (tid % kGatherThreadsPerRow) * kGatherRun;
#pragma unroll
  for (int j = 0; j < kGatherRun; j += 8) {
    Vec16 packed;
#pragma unroll
    for (int e = 0; e < 8; ++e) reinterpret_cast<u16*>(&packed)[e] = values[j + e];
    *reinterpret_cast<Vec16*>(dst + j) = packed;
  }
}

JF_DEVICE void load_a(const Io::type* x, Elem* sa, const PixelRow* rows, int kt,
                      i64 channel0, int tid) {
  const int kk0 = kt * kBK;
  const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
  const int r = tap / static_cast<int>(S), s = tap % static_cast<int>(S);
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int chunk = tid + i * kThreads;
    if (kAChunkCount % kThreads != 0 && chunk >= kAChunkCount) break;
    const int row = chunk / kAChunksPerRow, col = chunk % kAChunksPerRow * kChunk;
    const Io::type* src = a_source(x, rows[i], r, s, channel0 + c0 + col);
    mma::copy16_async(mma::smem_addr(sa + row * kAPitch + col), src ? src : x, src);
  }
}

JF_DEVICE void load_b(const Io::type* w, Elem* sb, int kt, i64 group, int n0, int tid) {
  const i64 kk0 = i64(kt) * kBK;
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int chunk = tid + i * kThreads;
    if (kBChunkCount % kThreads != 0 && chunk >= kBChunkCount) break;
    int row, col, k;
    i64 kk;
    if (kFiltersKMajor) {  // [k][kk]: a row is one output channel
      row = chunk / (kBK / kChunk), col = chunk % (kBK / kChunk) * kChunk;
      k = n0 + row, kk = kk0 + col;
    } else {  // [kk][k]: a row is one (tap, c)
      row = chunk / (kBN / kChunk), col = chunk % (kBN / kChunk) * kChunk;
      k = n0 + col, kk = kk0 + row;
    }
    const bool ok = k < KG && kk < kReduction;
    const Io::type* src =
        ok ? w + b_offset(group, static_cast<int>(kk / CG), kk % CG, k) : w;
    mma::copy16_async(mma::smem_addr(sb + row * kBPitch + col), src, ok);
  }
}

// TF32: one k8 step per instruction, fragments read element by element (ldmatrix moves 16-bit
// values). Lane (g, t) = (lane / 4, lane % 4) holds A[g][t], A[g + 8][t], A[g][t + 4],
// A[g + 8][t + 4] and B[t][g], B[t + 4][g] of its 16x8 and 8x8 tiles.
JF_DEVICE void multiply_stage_tf32(const Elem* sa, const Elem* sb,
                                   float (&acc)[kFragsM][kFragsN][4], int warp_m, int warp_n,
                                   int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < kBK; ks += 8) {
    u32 a[kFragsM][4];
    u32 b[kFragsN][2];
#pragma unroll
    for (int fm = 0; fm < kFragsM; ++fm) {
      const Elem* base = sa + (warp_m * kWM + fm * 16 + g) * kAPitch + ks + t;
      a[fm][0] = mma::to_tf32(base[0]);
      a[fm][1] = mma::to_tf32(base[8 * kAPitch]);
      a[fm][2] = mma::to_tf32(base[4]);
      a[fm][3] = mma::to_tf32(base[8 * kAPitch + 4]);
    }
#pragma unroll
    for (int fn = 0; fn < kFragsN; ++fn) {
      const int n = warp_n * kWN + fn * 8 + g;
      if (kFiltersKMajor) {  // [k][kk]
        b[fn][0] = mma::to_tf32(sb[n * kBPitch + ks + t]);
        b[fn][1] = mma::to_tf32(sb[n * kBPitch + ks + t + 4]);
      } else {  // [kk][k]
        b[fn][0] = mma::to_tf32(sb[(ks + t) * kBPitch + n]);
        b[fn][1] = mma::to_tf32(sb[(ks + t + 4) * kBPitch + n]);
      }
    }
#pragma unroll
    for (int fm = 0; fm < kFragsM; ++fm) {
#pragma unroll
      for (int fn = 0; fn < kFragsN; ++fn) mma::mma_16x8x8_tf32(acc[fm][fn], a[fm], b[fn]);
    }
  }
}

JF_DEVICE void multiply_stage(const Elem* sa, const Elem* sb,
                              float (&acc)[kFragsM][kFragsN][4], int warp_m, int warp_n,
                              int lane) {
#pragma unroll
  for (int ks = 0; ks < kBK; ks += 16) {
    u32 a[kFragsM][4];
    u32 b[kFragsN][2];
#pragma unroll
    for (int fm = 0; fm < kFragsM; ++fm) {
      const int row = warp_m * kWM + fm * 16 + (lane % 16);
      const int col = ks + (lane / 16) * 8;
      mma::load_matrices<false>(a[fm], mma::smem_addr(sa + row * kAPitch + col));
    }
#pragma unroll
    for (int fn = 0; fn < kFragsN; fn += 2) {
      u32 r[4];
      if (kFiltersKMajor) {
        const int nrow = warp_n * kWN + fn * 8 + (lane % 8) + (lane / 16) * 8;
        const int kcol = ks + ((lane / 8) % 2) * 8;
        mma::load_matrices<false>(r, mma::smem_addr(sb + nrow * kBPitch + kcol));
      } else {
        const int krow = ks + (lane % 8) + ((lane / 8) % 2) * 8;
        const int ncol = warp_n * kWN + fn * 8 + (lane / 16) * 8;
        mma::load_matrices<true>(r, mma::smem_addr(sb + krow * kBPitch + ncol));
      }
      b[fn][0] = r[0];
      b[fn][1] = r[1];
      b[fn + 1][0] = r[2];
      b[fn + 1][1] = r[3];
    }
#pragma unroll
    for (int fm = 0; fm < kFragsM; ++fm) {
#pragma unroll
      for (int fn = 0; fn < kFragsN; ++fn) mma::mma_16x8x16<kDtype>(acc[fm][fn], a[fm], b[fn]);
    }
  }
}

// The multiply for this plan's element type.
JF_DEVICE void multiply(const Elem* sa, const Elem* sb, float (&acc)[kFragsM][kFragsN][4],
                        int warp_m, int warp_n, int lane) {
  if (kTf32) {
    multiply_stage_tf32(sa, sb, acc, warp_m, warp_n, lane);
  } else {
    multiply_stage(sa, sb, acc, warp_m, warp_n, lane);
  }
}

}  // namespace igemm
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::igemm::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_igemm(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::igemm;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Epilogue::Channel terms[kBN];

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const auto [m0, n0, group] = tile_coords<kBM, kBN>(blockIdx.x);

  const Epilogue ep(p);
  const Io::type* x = static_cast<const Io::type*>(p.x);
  const Io::type* w = static_cast<const Io::type*>(p.w);
  fill_terms<kBN, kThreads>(ep, terms, n0, group);
  PixelRow rows[kGatherA ? 1 : kAChunks];
  if (kGatherA) {
    rows[0] = pixel_row(m0 + tid / kGatherThreadsPerRow);
  } else {
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) rows[i] = pixel_row(m0 + (tid + i * kThreads) / kAChunksPerRow);
  }

  Elem* stages = reinterpret_cast<Elem*>(smem);
  const i64 channel0 = group * CG;
  float acc[kFragsM][kFragsN][4];
#pragma unroll
  for (int fm = 0; fm < kFragsM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kFragsN; ++fn)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[fm][fn][e] = 0.0f;

  if (kGatherA) {
    // Two stages; the next k-tile's A is gathered into registers while this one multiplies.
    u16 values[kGatherRun];
    gather_a(x, rows[0], 0, channel0, tid, values);
    load_b(w, stages + kATile, 0, group, n0, tid);
    mma::commit_copies();
    for (int kt = 0; kt < kKTiles; ++kt) {
      Elem* stage = stages + (kt % 2) * kStage;
      store_gathered_a(reinterpret_cast<u16*>(stage), tid, values);
      mma::wait_copies<0>();
      __syncthreads();  // stage kt complete; the other stage's last readers are done
      if (kt + 1 < kKTiles) {
        gather_a(x, rows[0], kt + 1, channel0, tid, values);
        load_b(w, stages + ((kt + 1) % 2) * kStage + kATile, kt + 1, group, n0, tid);
      }
      mma::commit_copies();
      multiply(stage, stage + kATile, acc, warp_m, warp_n, lane);
    }
  } else {
  // Pipeline: kStages - 1 k-tiles in flight ahead of the one being multiplied.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < kKTiles) {
      load_a(x, stages + st * kStage, rows, st, channel0, tid);
      load_b(w, stages + st * kStage + kATile, st, group, n0, tid);
    }
    mma::commit_copies();
  }
  for (int kt = 0; kt < kKTiles; ++kt) {
    mma::wait_copies<kStages - 2>();
    __syncthreads();  // stage kt is visible to all; stage kt - 1 is free to refill
    const int next = kt + kStages - 1;
    if (next < kKTiles) {
      Elem* stage = stages + (next % kStages) * kStage;
      load_a(x, stage, rows, next, channel0, tid);
      load_b(w, stage + kATile, next, group, n0, tid);
    }
    mma::commit_copies();
    const Elem* stage = stages + (kt % kStages) * kStage;
    multiply(stage, stage + kATile, acc, warp_m, warp_n, lane);
  }
  }
  mma::wait_copies<0>();
  __syncthreads();

  // Accumulators -> shared fp32 tile (mma C layout: rows g and g + 8, columns 2t and 2t + 1).
  float* tile = reinterpret_cast<float*>(smem);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int fm = 0; fm < kFragsM; ++fm) {
#pragma unroll
    for (int fn = 0; fn < kFragsN; ++fn) {
      const int row = warp_m * kWM + fm * 16 + g, col = warp_n * kWN + fn * 8 + 2 * t;
      tile[row * kCPitch + col] = acc[fm][fn][0];
      tile[row * kCPitch + col + 1] = acc[fm][fn][1];
      tile[(row + 8) * kCPitch + col] = acc[fm][fn][2];
      tile[(row + 8) * kCPitch + col + 1] = acc[fm][fn][3];
    }
  }
  __syncthreads();
  store_tile<kBM, kBN, kCPitch, kThreads>(ep, tile, terms, m0, n0, group,
                                          static_cast<Io::type*>(p.y));
}
