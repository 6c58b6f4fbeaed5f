// Implicit-GEMM convolution on tensor cores: fp16/bf16 NHWC activations, fp32 accumulation.
//
// The convolution is the GEMM  Y[m][k] = sum_kk A[m][kk] * B[kk][k]  with m an output pixel
// (n, oh, ow), k an output channel and kk = (r, s, c) a filter tap and input channel, c fastest.
// A is never materialized: each pipeline stage copies the BM x BK slice of it straight from the
// NHWC input (one filter tap, BK consecutive channels: contiguous 16-byte runs), zero-filling
// padding. B comes from HWIO filters ([kk][k], k contiguous; read with transposing fragment
// loads) or OHWI / 1x1 OIHW filters ([k][kk]). kStages copies are in flight while the warps
// multiply the oldest stage. The epilogue stages the fp32 tile through shared memory so every
// output row is written with 16-byte stores, running the plan's operator chain on each value.
//
// Tile sizes come from the code generator (namespace plan: kBM, kBN, kBK, kWarpsM, kWarpsN,
// kStages, kMinBlocks, kSmemBytes); requirements it checks: CG % kBK == 0, KG % 8 == 0,
// 16-byte aligned buffers (the host falls back to the direct kernel otherwise).
#pragma once

#include "mma.h"

namespace jaxfuse {
namespace igemm {

using namespace plan;

constexpr int kThreads = kWarpsM * kWarpsN * kWarpSize;
constexpr int kWM = kBM / kWarpsM, kWN = kBN / kWarpsN;  // one warp's tile
constexpr int kFragsM = kWM / 16, kFragsN = kWN / 8;     // mma tiles per warp
constexpr i64 M = N * P * Q;
constexpr i64 kTaps = R * S;
constexpr int kKTiles = static_cast<int>(kTaps * CG / kBK);
constexpr i64 kMTiles = (M + kBM - 1) / kBM;
constexpr i64 kNTiles = (KG + kBN - 1) / kBN;

// Shared-memory layout, in 16-bit elements. Rows are padded by 16 bytes so the eight rows one
// ldmatrix reads fall in distinct banks.
constexpr bool kBRowsAreK = kFilterLayout == kFilterHWIO;  // B stored [kk][k], else [k][kk]
constexpr int kAPitch = kBK + 8;
constexpr int kBPitch = kBRowsAreK ? kBN + 8 : kBK + 8;
constexpr int kATile = kBM * kAPitch;
constexpr int kBTile = kBRowsAreK ? kBK * kBPitch : kBN * kBPitch;
constexpr int kStage = kATile + kBTile;
constexpr int kCPitch = kBN + 4;  // floats: the epilogue's staging tile

constexpr int kAChunksPerRow = kBK / 8;  // 16-byte chunks
constexpr int kAChunks = kBM * kAChunksPerRow / kThreads;
constexpr int kBChunks = kBK * kBN / 8 / kThreads;

static_assert(kWM % 16 == 0 && kWN % 16 == 0, "warp tiles are whole 16x16 fragments");
static_assert(kBM * kAChunksPerRow % kThreads == 0, "A chunks split evenly over threads");
static_assert(kBK * kBN / 8 % kThreads == 0, "B chunks split evenly over threads");
static_assert(CG % kBK == 0 && kBK % 16 == 0, "a k-tile stays within one filter tap");
static_assert(KG % 8 == 0 && C % 8 == 0, "16-byte rows");
static_assert(kStages * kStage * 2 <= kSmemBytes && kBM * kCPitch * 4 <= kSmemBytes,
              "shared memory budget");
static_assert(kKTiles >= 1, "at least one k-tile");

// Where one thread's A rows start: fixed for the whole k loop.
struct ARow {
  i64 image;     // n * H * W * C
  int ih0, iw0;  // input coordinates of filter tap (0, 0)
  bool valid;    // inside the output
};

JF_DEVICE void load_a(const Io::type* x, u16* sa, const ARow (&rows)[kAChunks], int kt,
                      i64 channel0, int tid) {
  const int kk0 = kt * kBK;
  const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
  const int r = tap / static_cast<int>(S), s = tap % static_cast<int>(S);
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int chunk = tid + i * kThreads;
    const int row = chunk / kAChunksPerRow, col8 = chunk % kAChunksPerRow;
    const int ih = rows[i].ih0 + r * static_cast<int>(DH);
    const int iw = rows[i].iw0 + s * static_cast<int>(DW);
    const bool ok = rows[i].valid && ih >= 0 && ih < H && iw >= 0 && iw < W;
    const Io::type* src =
        ok ? x + rows[i].image + (i64(ih) * W + iw) * C + channel0 + c0 + col8 * 8 : x;
    mma::copy16_async(mma::smem_addr(sa + row * kAPitch + col8 * 8), src, ok);
  }
}

JF_DEVICE void load_b(const Io::type* w, u16* sb, int kt, i64 group, int n0, int tid) {
  const int kk0 = kt * kBK;
  const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int chunk = tid + i * kThreads;
    if (kBRowsAreK) {  // HWIO: w[(tap, c)][k]
      const int row = chunk / (kBN / 8), col8 = chunk % (kBN / 8);
      const int k = n0 + col8 * 8;
      const bool ok = k < KG;
      const Io::type* src = ok ? w + (i64(tap) * CG + c0 + row) * K + group * KG + k : w;
      mma::copy16_async(mma::smem_addr(sb + row * kBPitch + col8 * 8), src, ok);
    } else {  // OHWI (or 1x1 OIHW): w[k][(tap, c)]
      const int row = chunk / (kBK / 8), col8 = chunk % (kBK / 8);
      const int k = n0 + row;
      const bool ok = k < KG;
      const Io::type* src = ok ? w + ((group * KG + k) * kTaps + tap) * CG + c0 + col8 * 8 : w;
      mma::copy16_async(mma::smem_addr(sb + row * kBPitch + col8 * 8), src, ok);
    }
  }
}

JF_DEVICE void multiply_stage(const u16* sa, const u16* sb, float (&acc)[kFragsM][kFragsN][4],
                              int warp_m, int warp_n, int lane) {
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
      if (kBRowsAreK) {
        const int krow = ks + (lane % 8) + ((lane / 8) % 2) * 8;
        const int ncol = warp_n * kWN + fn * 8 + (lane / 16) * 8;
        mma::load_matrices<true>(r, mma::smem_addr(sb + krow * kBPitch + ncol));
      } else {
        const int nrow = warp_n * kWN + fn * 8 + (lane % 8) + (lane / 16) * 8;
        const int kcol = ks + ((lane / 8) % 2) * 8;
        mma::load_matrices<false>(r, mma::smem_addr(sb + nrow * kBPitch + kcol));
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

}  // namespace igemm
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::igemm::kThreads, jaxfuse::plan::kMinBlocks)
    jaxfuse_conv_igemm(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::igemm;
  typedef Io::type T;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Epilogue::Channel terms[kBN];

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  // Output-channel tiles vary fastest, so CTAs that share an activation tile run together.
  const i64 block = blockIdx.x;
  const int n0 = static_cast<int>(block % kNTiles) * kBN;
  const i64 m0 = (block / kNTiles) % kMTiles * kBM;
  const i64 group = block / (kNTiles * kMTiles);

  const Epilogue ep(p);
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  for (int j = tid; j < kBN; j += kThreads) {
    terms[j] = n0 + j < KG ? ep.channel(group * KG + n0 + j) : Epilogue::Channel{0.0f, 1.0f, 0.0f};
  }

  ARow rows[kAChunks];
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const i64 m = m0 + (tid + i * kThreads) / kAChunksPerRow;
    const i64 n = m / (P * Q), pq = m % (P * Q);
    rows[i].valid = m < M;
    rows[i].image = n * H * W * C;
    rows[i].ih0 = static_cast<int>(pq / Q) * static_cast<int>(SH) - static_cast<int>(PT);
    rows[i].iw0 = static_cast<int>(pq % Q) * static_cast<int>(SW) - static_cast<int>(PL);
  }

  u16* stages = reinterpret_cast<u16*>(smem);
  auto stage_a = [&](int st) { return stages + st * kStage; };
  auto stage_b = [&](int st) { return stages + st * kStage + kATile; };
  const i64 channel0 = group * CG;

  float acc[kFragsM][kFragsN][4];
#pragma unroll
  for (int fm = 0; fm < kFragsM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kFragsN; ++fn)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[fm][fn][e] = 0.0f;

  // Pipeline: kStages - 1 k-tiles in flight ahead of the one being multiplied.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < kKTiles) {
      load_a(x, stage_a(st), rows, st, channel0, tid);
      load_b(w, stage_b(st), st, group, n0, tid);
    }
    mma::commit_copies();
  }
  for (int kt = 0; kt < kKTiles; ++kt) {
    mma::wait_copies<kStages - 2>();
    __syncthreads();  // stage kt is visible to all; stage kt-1 is free to refill
    const int next = kt + kStages - 1;
    if (next < kKTiles) {
      load_a(x, stage_a(next % kStages), rows, next, channel0, tid);
      load_b(w, stage_b(next % kStages), next, group, n0, tid);
    }
    mma::commit_copies();
    multiply_stage(stage_a(kt % kStages), stage_b(kt % kStages), acc, warp_m, warp_n, lane);
  }
  mma::wait_copies<0>();
  __syncthreads();

  // Epilogue: accumulators -> shared fp32 tile -> chain -> 16-byte stores of whole rows.
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
  T* y = static_cast<T*>(p.y);
  for (int chunk = tid; chunk < kBM * (kBN / 8); chunk += kThreads) {
    const int row = chunk / (kBN / 8), col8 = chunk % (kBN / 8);
    const i64 m = m0 + row;
    const int k = n0 + col8 * 8;
    if (m >= M || k >= KG) continue;
    const i64 out = m * K + group * KG + k;
    const i64 param = (m % (P * Q)) * K + group * KG + k;
    Vec16 packed;
    T* lanes = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = tile[row * kCPitch + col8 * 8 + j];
      lanes[j] = Io::store(ep.apply(v, terms[col8 * 8 + j], param + j, out + j));
    }
    *reinterpret_cast<Vec16*>(y + out) = packed;
  }
}
