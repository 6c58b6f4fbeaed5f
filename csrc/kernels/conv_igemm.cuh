// Implicit-GEMM convolution on tensor cores with warp-level mma.sync (sm_80 and newer):
// fp16/bf16 NHWC or NCHW activations (16x8x16 multiplies), or fp32 ones through TF32 (16x8x8
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
// tap's 3 channels are not a 16-byte run; 16-bit or fp32 values), prefetched one k-tile ahead; B (HWIO, whose rows
// are exactly kk) still streams in with cp.async. With K-major filters (NCHW plans with OIHW or
// OHWI filters) B's rows are runs of the filters that need not start on 16 bytes, and B is
// gathered the same way.
//
// NCHW (implicit_gemm.h: gather_planes): A's rows are gathered value by value into registers,
// the loads for k-tile kt + kStages - 1 issued before k-tile kt's multiply and stored to shared
// memory at the next iteration; B streams in with cp.async. The epilogue stores channel planes.
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
// Channel counts that are not whole k-tiles flatten the reduction kk = (tap, c). NHWC rows
// whose taps are whole 16-byte chunks (24 16-bit channels, 12 fp32 ones, ...) still stream in
// with cp.async, each chunk finding its own tap (kChunkedA); fewer or odd channels are gathered
// value by value (kGatherA).
constexpr bool kChunkedA = CG % kBK != 0 && kNHWC && CG % kChunk == 0;
constexpr bool kGatherA = CG % kBK != 0 && !kChunkedA;
constexpr bool kGatherB = kGatherA && kFiltersKMajor;  // ... whose filter rows are not aligned
constexpr bool kPlanesA = !kNHWC && !kGatherA;        // NCHW: rows gathered by gather_planes
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
// NCHW: a thread's pixel is row tid % kBM, its chunks the columns tid / kBM + i * kColStep.
constexpr int kColStep = kThreads / kBM;
constexpr int kPlaneChunks = kAChunksPerRow / (kColStep > 0 ? kColStep : 1);
// Gathered B: each thread fills kBGatherChunks 16-byte chunks of B's [k][kk] tile.
constexpr int kBGatherChunks = kBChunks;
constexpr int kBChunksPerRow = kBK / kChunk;

static_assert(sizeof(FilterIo::type) == sizeof(Io::type), "filters in the plan's dtype");
static_assert(kWM % 16 == 0 && kWN % 16 == 0, "warp tiles are whole 16x16 fragments");
static_assert(kBK % 16 == 0, "whole mma k-steps");
static_assert(!kGatherA || kStages == 2, "gathered A: two stages");
static_assert(!kGatherB || (!kNHWC && kBChunkCount % kThreads == 0), "gathered B: NCHW plans");
static_assert(kOutNHWC == kNHWC, "the output in the input's layout (codegen: IgemmApplies)");
static_assert(!kPlanesA || (kThreads % kBM == 0 && kPlaneChunks * kColStep == kAChunksPerRow),
              "NCHW: a thread's chunks cover its columns");
static_assert(!kPlanesA || !kFlatCRS || kTaps <= 32, "NCHW, OIHW: one tap mask bit per tap");
static_assert(!kGatherA || (kThreads % kBM == 0 && kGatherRun % kChunk == 0),
              "one row per thread, whole 16-byte chunks");
static_assert(KG % kChunk == 0 && (kGatherA || C % kChunk == 0), "16-byte rows");
static_assert(kStages * kStage * static_cast<int>(sizeof(Elem)) <= kSmemBytes &&
              kBM * kCPitch * 4 <= kSmemBytes, "shared memory budget");

// Gathered A: this thread's kGatherRun consecutive kk of its row, into registers. (NCHW: the
// value's channel plane; kk = (c, r, s) for OIHW filters: kFlatCRS.)
JF_DEVICE void gather_a(const Io::type* x, const PixelRow& row, int kt, i64 channel0, int tid,
                        Elem (&values)[kGatherRun]) {
  const i64 kk0 = i64(kt) * kBK + (tid % kGatherThreadsPerRow) * kGatherRun;
  if (kNHWC) {
    // kk = (r, s, c) stepped from kk0 (divisions once per run, not per value); kk past the
    // reduction is r == R.
    const int tap = static_cast<int>(kk0 / CG);
    int c = static_cast<int>(kk0 - i64(tap) * CG);
    int r = tap / static_cast<int>(S), s = tap - r * static_cast<int>(S);
    const Io::type* image = x + row.image + channel0;
#pragma unroll
    for (int j = 0; j < kGatherRun; ++j) {
      const int ih = row.ih0 + r * static_cast<int>(DH), iw = row.iw0 + s * static_cast<int>(DW);
      const bool inside = row.valid && r < R && ih >= 0 && ih < H && iw >= 0 && iw < W;
      values[j] = inside ? image[i64(ih * static_cast<int>(W) + iw) * C + c] : Elem(0);
      if (++c == static_cast<int>(CG)) {
        c = 0;
        if (++s == static_cast<int>(S)) s = 0, ++r;
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kGatherRun; ++j) {
    const i64 kk = kk0 + j;
    const int tap = static_cast<int>(kFlatCRS ? kk % kTaps : kk / CG);
    const i64 c = kFlatCRS ? kk / kTaps : kk % CG;
    const int ih = row.ih0 + tap / static_cast<int>(S) * static_cast<int>(DH);
    const int iw = row.iw0 + tap % static_cast<int>(S) * static_cast<int>(DW);
    const bool inside = kk < kReduction && row.valid && ih >= 0 && ih < H && iw >= 0 && iw < W;
    values[j] = inside ? x[row.image + (channel0 + c) * kPlane + i64(ih) * W + iw] : Elem(0);
  }
}

// Gathered B (K-major filters): this thread's chunks of k-tile kt's [k][kk] slice.
JF_DEVICE void gather_b(const Io::type* w, int kt, i64 group, int n0, int tid,
                        Elem (&values)[kBGatherChunks * kChunk]) {
#pragma unroll
  for (int i = 0; i < kBGatherChunks; ++i) {
    const int chunk = tid + i * kThreads;
    const int k = n0 + chunk / kBChunksPerRow;
    const i64 kk0 = i64(kt) * kBK + chunk % kBChunksPerRow * kChunk;
    const Io::type* row = w + b_offset(group, 0, 0, k);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      values[i * kChunk + e] = k < KG && kk0 + e < kReduction ? row[kk0 + e] : Elem(0);
    }
  }
}

JF_DEVICE void store_gathered_b(Elem* sb, int tid, const Elem (&values)[kBGatherChunks * kChunk]) {
#pragma unroll
  for (int i = 0; i < kBGatherChunks; ++i) {
    const int chunk = tid + i * kThreads;
    *reinterpret_cast<Vec16*>(sb + chunk / kBChunksPerRow * kBPitch +
                              chunk % kBChunksPerRow * kChunk) = pack_chunk(values + i * kChunk);
  }
}

// NCHW: A's chunks of k-tile kt into registers, and from registers into stage `sa`.
JF_DEVICE void gather_a_planes(const Io::type* x, const PixelRow& row, u32 taps, int kt,
                               i64 channel0, int tid, Elem (&v)[kPlaneChunks * kChunk]) {
  gather_planes<kPlaneChunks, kColStep>(x, row, taps, kt * kBK, channel0, tid / kBM, v);
}

JF_DEVICE void store_a_planes(Elem* sa, int tid, const Elem (&v)[kPlaneChunks * kChunk]) {
  const int row = tid % kBM;
#pragma unroll
  for (int i = 0; i < kPlaneChunks; ++i) {
    const int col = (tid / kBM + i * kColStep) * kChunk;
    *reinterpret_cast<Vec16*>(sa + row * kAPitch + col) = pack_chunk(v + i * kChunk);
  }
}

JF_DEVICE void store_gathered_a(Elem* sa, int tid, const Elem (&values)[kGatherRun]) {
  Elem* dst = sa + (tid / kGatherThreadsPerRow) * kAPitch + (tid % kGatherThreadsPerRow) * kGatherRun;
#pragma unroll
  for (int j = 0; j < kGatherRun; j += kChunk) {
    *reinterpret_cast<Vec16*>(dst + j) = pack_chunk(values + j);
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
    const Io::type* src;
    if (kChunkedA) {  // the k-tile spans taps (and the reduction's zero-filled end)
      const int kk = kk0 + col, chunk_tap = kk / static_cast<int>(CG);
      src = kk < kReduction ? a_source(x, rows[i], chunk_tap / static_cast<int>(S),
                                       chunk_tap % static_cast<int>(S),
                                       channel0 + kk % static_cast<int>(CG))
                            : nullptr;
    } else {
      src = a_source(x, rows[i], r, s, channel0 + c0 + col);
    }
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
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::igemm;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Epilogue::Channel terms[kBN];

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const auto [m0, n0, group] = tile_coords<kBM, kBN>(blockIdx.x);

  const Epilogue ep(p);
  const Io::type* x = static_cast<const Io::type*>(p.x);
  const Io::type* w = static_cast<const Io::type*>(p.w);
  PixelRow rows[kGatherA ? 1 : kAChunks];
  if (kGatherA) {
    rows[0] = pixel_row(m0 + tid / kGatherThreadsPerRow);
  } else if (kPlanesA) {
    rows[0] = pixel_row(m0 + tid % kBM);
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
    Elem values[kGatherRun];
    Elem b_values[kBGatherChunks * kChunk];  // kGatherB only
    gather_a(x, rows[0], 0, channel0, tid, values);
    if (kGatherB) {
      gather_b(w, 0, group, n0, tid, b_values);
    } else {
      load_b(w, stages + kATile, 0, group, n0, tid);
    }
    mma::commit_copies();
    // The epilogue's per-channel terms, loaded once the first k-tiles' copies are issued so
    // that their latencies overlap (a one-k-tile reduction waits for both only once).
    fill_terms<kBN, kThreads>(ep, terms, n0, group);
    for (int kt = 0; kt < kKTiles; ++kt) {
      Elem* stage = stages + (kt % 2) * kStage;
      store_gathered_a(stage, tid, values);
      if (kGatherB) store_gathered_b(stage + kATile, tid, b_values);
      mma::wait_copies<0>();
      __syncthreads();  // stage kt complete; the other stage's last readers are done
      if (kt + 1 < kKTiles) {
        gather_a(x, rows[0], kt + 1, channel0, tid, values);
        if (kGatherB) {
          gather_b(w, kt + 1, group, n0, tid, b_values);
        } else {
          load_b(w, stages + ((kt + 1) % 2) * kStage + kATile, kt + 1, group, n0, tid);
        }
      }
      mma::commit_copies();
      multiply(stage, stage + kATile, acc, warp_m, warp_n, lane);
    }
  } else if (kPlanesA) {
    // NCHW: kStages - 1 k-tiles ahead as for NHWC, A's newest one still in registers.
    const u32 taps = tap_mask(rows[0]);
    Elem staged[kPlaneChunks * kChunk];
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < kKTiles) {
        gather_a_planes(x, rows[0], taps, st, channel0, tid, staged);
        store_a_planes(stages + st * kStage, tid, staged);
        load_b(w, stages + st * kStage + kATile, st, group, n0, tid);
      }
      mma::commit_copies();
    }
    if (kStages - 1 < kKTiles) {
      gather_a_planes(x, rows[0], taps, kStages - 1, channel0, tid, staged);
    }
    fill_terms<kBN, kThreads>(ep, terms, n0, group);  // as above
    for (int kt = 0; kt < kKTiles; ++kt) {
      mma::wait_copies<kStages - 2>();
      __syncthreads();  // stage kt is visible to all; stage kt - 1 is free to refill
      const int next = kt + kStages - 1;
      if (next < kKTiles) {
        Elem* stage = stages + (next % kStages) * kStage;
        store_a_planes(stage, tid, staged);
        load_b(w, stage + kATile, next, group, n0, tid);
      }
      mma::commit_copies();
      if (next + 1 < kKTiles) {  // in flight while k-tile kt multiplies
        gather_a_planes(x, rows[0], taps, next + 1, channel0, tid, staged);
      }
      const Elem* stage = stages + (kt % kStages) * kStage;
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
  fill_terms<kBN, kThreads>(ep, terms, n0, group);  // as above
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
  if (kNHWC) {
    store_tile<kBM, kBN, kCPitch, kThreads>(ep, tile, terms, m0, n0, group,
                                            static_cast<Io::type*>(p.y));
  } else {  // rows kCPitch = 4 banks apart: a row per lane reads without conflicts as stored
    store_tile_planes<kBM, kBN, kCPitch, kThreads, 0>(ep, tile, terms, m0, n0, group,
                                                      static_cast<Io::type*>(p.y));
  }
}
