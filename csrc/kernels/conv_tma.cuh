// Implicit-GEMM convolution on Hopper (sm_90a), warp-specialized: NHWC activations, fp16/bf16
// or fp32 through TF32, fp32 accumulation, the plan's chain fused into the epilogue; NHWC
// output, or (kOutNHWC false: a kernel form of NCHW plans) NCHW output, plane by plane.
//
// A persistent grid (one block per multiprocessor) walks the output tiles of kBM pixels (128;
// 256 with kSwapAB) x kBN channels. In each block:
//  - a producer warpgroup, of which one thread issues bulk tensor copies (TMA): per k-tile
//    (one filter tap, 128 bytes of channels: 64 16-bit values or 32 fp32 ones) the activations
//    through an im2col tensor map (the copy engine walks the convolution window, strides and
//    padding itself, zero-filling outside the image) and the filters through a tiled map, both
//    into 128-byte-swizzled stages of a ring guarded by mbarriers. It runs ahead across tiles:
//    the next tile's copies overlap this tile's epilogue.
//  - two consumer warpgroups, each multiplying 64 rows x kBN with warpgroup MMA straight from
//    the stages (wgmma.h), then running the epilogue for its rows: the fp32 accumulators pass
//    through a per-warpgroup staging tile, kEpiCols columns at a time, and leave in 16-byte
//    stores after the plan's chain (implicit_gemm.h: store_chunk).
// The producer gives registers to the consumers (setmaxnreg), which hold kBN / 2 accumulators
// each.
//
// kPingPong (a candidate for one-block tiles up to 128 wide; JAXFUSE_TMA_PINGPONG=0 withdraws
// it): the consumers do not share tiles but take the block's tiles in turn,
// each multiplying all 128 rows (two 64-row wgmma blocks, kBN <= 128 so the accumulators fit),
// so one warpgroup's epilogue runs while the other multiplies the next tile: the tensor pipe no
// longer idles through every epilogue (Nsight Compute on an H100: 70% busy against cuDNN's 84%
// at batch 256). A stage is then released by one warpgroup. A consumer starts waiting for its
// tile's stages only once the other has seen every stage of the tile before it land (an
// ordering barrier, as CUTLASS's ping-pong kernel has): mbarrier waits tell phases apart only
// by parity, so a wait for a stage's next use before its previous use had landed would pass at
// once.
//
// kSwapAB (groups of 64 output channels, 16-bit, [kk][k] filters): the operands swap roles.
// With 64 channels a tile is 64 wide, and each m64n64k16 reads 4 KB of operands from shared
// memory for 131 kflop; Nsight Compute found ResNet-50's 3x3/64 layer bound by the shared-memory
// path (88% busy, tensor pipe 31%). Swapped, the filters' 64x64 copy-engine tile is wgmma's
// MN-major A (M = the 64 channels) and the kBM-pixel im2col tile its K-major B (N = kBM
// pixels): one m64n256k16 reads 10 KB for 524 kflop. A consumer multiplies a whole tile (the
// ping-pong schedule); its accumulators hold (channel, pixel) pairs, which the epilogue writes
// transposed into the staging tile, one row per pixel as the unswapped epilogue reads it.
//
// kHalo (swapped 256-pixel tiles of stride-1, undilated layers with 64 input and 64 output
// channels, one group): the im2col copies bring each input value in once per filter tap (nine
// times for 3x3), and the copy engine's writes were the largest share of the shared-memory
// traffic that bounds ResNet-50's 3x3/64 layer. A halo tile is 8 output columns x kBM / 8
// rows; its input window, halo included, arrives once as a tiled box (W innermost after the
// channels: box row (y, x) at y * kBoxW + x), the filters of every tap stay in shared memory
// for the whole kernel, and each tap's B is a view of the box: operand row n (output pixel
// (n / 8, n % 8)) is box row (n / 8 + r) * kBoxW + n % 8 + s, so a view starts r * kBoxW + s
// rows in and its 8-row groups are kBoxW rows apart (the descriptor's stride byte offset).
// wgmma reads such views exactly with the descriptor's base offset 0: the swizzle follows the
// absolute address (scripts/halo_probe.py, H100). Each consumer owns every other stage (two
// stages), so its waits need no turn barrier.
//
// TF32 reads both operands K-major, and a tiled copy of [kk][k] (HWIO) filters can only land
// MN-major: there the whole producer warpgroup writes B transposed, with 4-byte cp.async copies
// (a warp's 8 channels x 4 values per copy, conflict-free), one stage behind its issue so the
// copies' latency overlaps the next stage's, and arrives on the stage's barrier once they have
// landed; the copy engine still brings the activations.
//
// From the code generator (namespace plan): kBM (128, or 256 with kSwapAB), kBN (64, 128 or
// 256), kStages, kEpiCols (32 or 64), kSmemBytes, kBlocks (blocks per multiprocessor: 2 lets
// one block's epilogue overlap the other's multiplies, for short reductions), kPingPong,
// kSwapAB, kHalo. The host encodes the tensor maps per launch (TmaParams) and checks what the copy
// engine needs: CG a multiple of a k-tile, KG % 8 == 0, 16-byte aligned buffers, corners and
// strides the im2col map can express.
#pragma once

#include "implicit_gemm.h"
#include "mma.h"
#include "tma.h"
#include "wgmma.h"

namespace jaxfuse {
namespace tma_conv {

using namespace plan;
using namespace implicit_gemm;

constexpr bool kTf32 = sizeof(Io::type) == 4;
constexpr int kBK = 128 / sizeof(Io::type);  // values in one 128-byte swizzle row
constexpr int kConsumers = 2;  // warpgroups
// Rows of a tile one consumer multiplies (as 64-row wgmma blocks), and the threads that read a
// stage before it is free again.
constexpr int kConsumerRows = kPingPong ? kBM : kBM / kConsumers;
constexpr int kRowBlocks = kConsumerRows / 64;
constexpr int kStageReaders = (kPingPong ? 1 : kConsumers) * 128;
// TF32 with [kk][k] filters: the producer warpgroup writes B transposed (see the top).
constexpr bool kTransposeB = kTf32 && !kFiltersKMajor;
constexpr int kThreads = (1 + kConsumers) * 128;
constexpr int kKTiles = static_cast<int>(kTaps * CG / kBK);
// kHalo: tiles of 8 output columns x kHaloRows rows, their input windows (boxes) of
// kBoxW x kBoxH pixels, and every tap's 64 x 64 filters resident.
constexpr int kHaloRows = kBM / 8;
constexpr int kBoxW = 8 + static_cast<int>(S) - 1, kBoxH = kHaloRows + static_cast<int>(R) - 1;
constexpr u32 kBoxBytes = kBoxW * kBoxH * 128;
constexpr i64 kHaloTilesX = (Q + 7) / 8, kHaloTilesY = (P + kHaloRows - 1) / kHaloRows;
constexpr u32 kFilterTapBytes = 64 * 128;
constexpr u32 kFiltersBytes = kHalo ? static_cast<u32>(kTaps) * kFilterTapBytes : 0;
constexpr i64 kTiles = kHalo ? N * kHaloTilesY * kHaloTilesX
                             : ((M + kBM - 1) / kBM) * ((KG + kBN - 1) / kBN) * G;
constexpr u32 kATileBytes = kBM * 128;
constexpr u32 kBTileBytes = kBN * 128;
// A stage: a k-tile's A and B (a multiple of the 1024-byte atom), or a halo tile's box.
constexpr u32 kStageBytes = kHalo ? (kBoxBytes + 1023) / 1024 * 1024 : kATileBytes + kBTileBytes;
constexpr u32 kNBlockBytes = 64 * 128;  // MN-major B: 64 K rows of one 64-wide block of N
constexpr int kEpiPitch = kEpiCols + 4;  // floats: 16-byte rows, writes spread over banks
constexpr u32 kEpiBytes = 64 * kEpiPitch * 4;  // one consumer warpgroup's staging tile
constexpr u32 kFiltersOffset = kStages * kStageBytes;
constexpr u32 kEpiOffset = kFiltersOffset + kFiltersBytes;
constexpr u32 kBarriersOffset = kEpiOffset + kConsumers * kEpiBytes;
constexpr u32 kBarrierBytes = 16 * kStages + (kPingPong ? 8 * kConsumers : 0) + (kHalo ? 8 : 0);
// Registers per thread: the producer keeps few, the consumers take the rest of what the block
// was given at launch (the 64K shared by kBlocks blocks, a code-generator constant: 168 or 80
// per thread). A consumer claiming more than the producer gave back would wait forever.
constexpr int kLaunchRegisters = 65536 / (kThreads * kBlocks) / 8 * 8;
constexpr int kProducerRegisters = kBlocks == 1 ? 40 : 24;
constexpr int kConsumerRegisters =
    (kThreads * kLaunchRegisters - 128 * kProducerRegisters) / (128 * kConsumers) / 8 * 8;

static_assert(sizeof(FilterIo::type) == sizeof(Io::type), "filters in the plan's dtype");
static_assert(kBN % 64 == 0 && kBN <= 256, "wgmma N, 64-wide blocks of B");
static_assert(!kPingPong || kBN <= 128, "ping-pong: 128 x kBN accumulators in one warpgroup");
static_assert(kBM == 128 || kSwapAB, "256-pixel tiles only swapped");
static_assert(!kSwapAB || (kPingPong && kBN == 64 && kEpiCols == 64 && !kTf32 &&
                           !kFiltersKMajor && (kBM == 128 || kBM == 256)),
              "swapped: one consumer, 64 channels from [kk][k] filters, 128 or 256 pixels");
static_assert(!kHalo || (kSwapAB && CG == 64 && KG == 64 && G == 1 && SH == 1 && SW == 1 &&
                         DH == 1 && DW == 1 && kOutNHWC && kStages == kConsumers),
              "halo tiles: swapped, 64 -> 64 channels, stride 1, no dilation, a stage each");
static_assert(kBN % kEpiCols == 0 && (kEpiCols == 32 || kEpiCols == 64), "epilogue slices");
static_assert(kStages >= 2, "a stage loading while one multiplies");
// Transposed B arrives a stage late: with two stages the producer would wait for a stage the
// consumers cannot release before that arrival.
static_assert(!kTransposeB || kStages >= 3, "B's arrival one stage behind its issue");
static_assert(CG % kBK == 0, "a k-tile stays within one filter tap");
static_assert(kNHWC, "NHWC activations (the im2col map); NCHW output only from them");
static_assert(KG % 8 == 0 && C % 8 == 0, "16-byte rows");
static_assert(kBarriersOffset + kBarrierBytes + 1024 <= kSmemBytes, "shared memory budget");
static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <=
                  kThreads * kLaunchRegisters && kConsumerRegisters >= kLaunchRegisters,
              "register budgets within the block's launch allocation");

struct Ring {
  u32 stages;  // shared address of stage 0 (1024-byte aligned)
  u32 full;    // kStages barriers: the stage's copies have landed
  u32 empty;   // kStages barriers: every consumer thread is done with the stage
  JF_DEVICE u32 stage(int s) const { return stages + s * kStageBytes; }
  JF_DEVICE u32 full_bar(int s) const { return full + 8 * s; }
  JF_DEVICE u32 empty_bar(int s) const { return empty + 8 * s; }
  // kPingPong: consumer c's turn barrier, one phase per tile of the other consumer whose
  // stages have all landed (each of its 128 threads arrives).
  JF_DEVICE u32 turn_bar(int c) const { return empty + 8 * kStages + 8 * c; }
  // kHalo: the resident filters (tap t's 64 x 64 A at filters + t * kFilterTapBytes) and the
  // barrier their copies complete.
  u32 filters;
  JF_DEVICE u32 filters_bar() const {
    return empty + 8 * kStages + (kPingPong ? 8 * kConsumers : 0);
  }
};

// kHalo: a tile's image and first output row and column (tiles walk columns, then rows).
struct HaloOrigin {
  i64 image;
  int y0, x0;
};

JF_DEVICE HaloOrigin halo_origin(i64 tile) {
  return HaloOrigin{tile / (kHaloTilesX * kHaloTilesY),
                    static_cast<int>(tile / kHaloTilesX % kHaloTilesY) * kHaloRows,
                    static_cast<int>(tile % kHaloTilesX) * 8};
}

// The output pixel of each row of a consumer's 64-row block (-1: outside the output):
// consecutive pixels from m_rows, or for a halo tile operand rows n0.. at (n / 8, n % 8) from
// the tile's origin.
struct RowPixels {
  i64 m_rows;
  HaloOrigin halo;
  int n0;
  JF_DEVICE i64 pixel(int row) const {
    if constexpr (kHalo) {
      const int n = n0 + row, y = halo.y0 + n / 8, x = halo.x0 + n % 8;
      return y < P && x < Q ? (halo.image * P + y) * Q + x : -1;
    } else {
      return m_rows + row < M ? m_rows + row : -1;
    }
  }
};

// TF32, [kk][k] filters: this producer thread's copies of k-tile kt's B into `stage`, stored
// K-major. Warp w copies 8 output channels x 4 reduction values at a time (its reads four
// 32-byte runs of filter rows, its writes 32 distinct banks: row n's chunk kk / 4 sits at chunk
// (kk / 4) ^ (n % 8)), the 8-channel groups w, w + 4, ... of every 4-value group q, so each
// copy's offsets from the thread's first are compile-time constants.
JF_DEVICE void copy_b_transposed(const Io::type* w, u32 stage, int kt, i64 group, int n0,
                                 int thread) {
  if constexpr (kTransposeB) {
    constexpr int kWarps = 4, kGroups = kBN / 8;
    static_assert(kGroups % kWarps == 0, "every warp the same channel groups");
    const int kk0 = kt * kBK;
    const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
    const int lane = thread % 32, warp = thread / 32;
    const int n_first = warp * 8 + lane % 8, kk_first = lane / 8;
    const Io::type* src = w + b_offset(group, tap, c0 + kk_first, n0 + n_first);
    const u32 dst = stage + kATileBytes + n_first * 128u + kk_first * 4u;
#pragma unroll
    for (int j = 0; j < kGroups / kWarps; ++j) {
      const bool ok = n0 + n_first + j * kWarps * 8 < KG;
#pragma unroll
      for (int q = 0; q < kBK / 4; ++q) {
        const u32 chunk = (static_cast<u32>(q) ^ static_cast<u32>(lane % 8)) << 4;
        mma::copy4_async(dst + j * kWarps * 8 * 128 + chunk,
                         ok ? src + i64(q) * 4 * K + j * kWarps * 8 : w, ok);
      }
    }
  }
}

// The copy engine's share of B for the k-tile at reduction index kk0, output channels k0..
JF_DEVICE void load_b(const TmaParams& args, u32 stage, u32 bar, int kk0, int k0) {
  if (kFiltersKMajor) {  // [k][kk]: kBN rows of one k-tile of reduction values
    tma::load_tile(stage + kATileBytes, &args.w, kk0, k0, bar);
  } else {  // [kk][k], 16-bit: 64 reduction rows of each 64-wide block of output channels
#pragma unroll
    for (int j = 0; j < kBN / 64; ++j) {
      tma::load_tile(stage + kATileBytes + j * kNBlockBytes, &args.w, k0 + 64 * j, kk0, bar);
    }
  }
}

// kHalo's producer thread: every tap's filters once, then each of this block's tiles' boxes,
// stage by stage (a stage is free again once its consumer has multiplied the tile).
JF_DEVICE void produce_halo(const TmaParams& args, const Ring& ring) {
  tma::prefetch_map(&args.x);
  tma::prefetch_map(&args.w);
  tma::arrive_expect_bytes(ring.filters_bar(), kFiltersBytes);
  for (int tap = 0; tap < static_cast<int>(kTaps); ++tap) {
    tma::load_tile(ring.filters + tap * kFilterTapBytes, &args.w, 0, tap * static_cast<int>(CG),
                   ring.filters_bar());
  }
  u32 it = 0;
  for (i64 tile = blockIdx.x; tile < kTiles; tile += gridDim.x, ++it) {
    const int s = static_cast<int>(it % kStages);
    tma::wait(ring.empty_bar(s), ((it / kStages) & 1) ^ 1);  // a fresh ring is empty
    const HaloOrigin o = halo_origin(tile);
    tma::arrive_expect_bytes(ring.full_bar(s), kBoxBytes);
    tma::load_box(ring.stage(s), &args.x, 0, o.x0 - static_cast<int>(PL),
                  o.y0 - static_cast<int>(PT), static_cast<int>(o.image), ring.full_bar(s));
  }
}

// The producer warpgroup: for each of this block's tiles, every k-tile's activations and
// filters. Thread 0 issues the copy engine's work; with kTransposeB every thread also copies
// its share of B, and arrives on a stage's barrier once those copies have landed (the barrier
// then expects the copy engine's bytes and 128 such arrivals).
JF_DEVICE void produce(const TmaParams& args, const Ring& ring, int thread) {
  if constexpr (kHalo) {
    if (thread == 0) produce_halo(args, ring);
    return;
  }
  if (thread == 0) {
    tma::prefetch_map(&args.x);
    if (!kTransposeB) tma::prefetch_map(&args.w);
  }
  const Io::type* w = static_cast<const Io::type*>(args.p.w);
  u32 it = 0;  // k-tiles issued so far, across tiles: the ring position
  for (i64 tile = blockIdx.x; tile < kTiles; tile += gridDim.x) {
    const auto [m0, n0, group] = tile_coords<kBM, kBN>(tile);
    const i64 image = m0 / (P * Q), pq = m0 % (P * Q);
    const int w0 = static_cast<int>(pq % Q) * static_cast<int>(SW) - static_cast<int>(PL);
    const int h0 = static_cast<int>(pq / Q) * static_cast<int>(SH) - static_cast<int>(PT);
    for (int kt = 0; kt < kKTiles; ++kt, ++it) {
      const int s = static_cast<int>(it % kStages);
      if (kTransposeB || thread == 0) {
        tma::wait(ring.empty_bar(s), ((it / kStages) & 1) ^ 1);  // a fresh ring is empty
      }
      const u32 stage = ring.stage(s), bar = ring.full_bar(s);
      const int kk0 = kt * kBK;  // = tap * CG + first channel
      if (thread == 0) {
        tma::arrive_expect_bytes(bar, kTransposeB ? kATileBytes : kStageBytes);
        const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
        const int r = tap / static_cast<int>(S), s_tap = tap % static_cast<int>(S);
        tma::load_im2col(stage, &args.x, static_cast<int>(group * CG) + c0, w0, h0,
                         static_cast<int>(image), bar, static_cast<u16>(s_tap * DW),
                         static_cast<u16>(r * DH));
        if (!kTransposeB) load_b(args, stage, bar, kk0, static_cast<int>(group * KG) + n0);
      }
      if constexpr (kTransposeB) {
        copy_b_transposed(w, stage, kt, group, n0, thread);
        mma::commit_copies();
        if (it > 0) {  // the previous k-tile's copies have landed: its stage is complete
          mma::wait_copies<1>();
          wgmma::fence_shared_for_async();
          tma::arrive(ring.full_bar(static_cast<int>((it - 1) % kStages)));
        }
      }
    }
  }
  if constexpr (kTransposeB) {
    if (it > 0) {
      mma::wait_copies<0>();
      wgmma::fence_shared_for_async();
      tma::arrive(ring.full_bar(static_cast<int>((it - 1) % kStages)));
    }
  }
}

// One stage: this warpgroup's rows of A (its half of the tile, or all of it with kPingPong)
// times all kBN columns of B; swapped, the 64 channels' filters times all kBM pixels (the
// accumulators' row b is then pixel block b).
JF_DEVICE void multiply_stage(u32 stage, int consumer, float (&acc)[kRowBlocks][kBN / 2]) {
  if constexpr (kSwapAB) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // A: MN-major filters, a k16 step 2048 bytes; B: K-major
      const u64 filters = wgmma::descriptor(stage + kATileBytes + 2048 * j, kNBlockBytes, 1024);
      wgmma::mma_swapped(acc, filters, wgmma::descriptor(stage + 32 * j, 16, 1024));
    }
    return;
  }
#pragma unroll
  for (int b = 0; b < kRowBlocks; ++b) {
    const u32 rows = kPingPong ? b * 64 : consumer * 64;
    wgmma::multiply_k_tile<kFiltersKMajor || kTf32>(acc[b], stage + rows * 128,
                                                    stage + kATileBytes, kNBlockBytes);
  }
}

// A consumer thread's chunks of one epilogue slice (64 rows x kEpiCols columns, 8 columns a
// chunk, 128 threads).
constexpr int kSliceChunks = 64 * (kEpiCols / 8) / 128;

// The side input of this thread's chunks of slice kSlice (nothing past the slices, the rows or
// the channels).
template <int kSlice>
JF_DEVICE void load_slice_side(const Epilogue& ep, int thread, const RowPixels& rows, int n0,
                               i64 group, SideChunk (&side)[kSliceChunks]) {
  if constexpr (Epilogue::kSide && kOutNHWC && kSlice < kBN / kEpiCols) {
#pragma unroll
    for (int i = 0; i < kSliceChunks; ++i) {
      const int chunk = thread + 128 * i;
      const i64 m = rows.pixel(chunk / (kEpiCols / 8));
      const int k = n0 + kSlice * kEpiCols + chunk % (kEpiCols / 8) * 8;
      if (m >= 0 && k < KG) side[i] = load_side(ep, m, k, group);
    }
  }
}

// Side input is loaded a slice ahead (its latency overlapping the previous slice's work),
// except beside 256-wide tiles' 128 accumulators, where holding any more words spilled
// (ptxas, sm_90a): those load each chunk's words where they are used. (NCHW output reads it
// value by value with each chunk's chain: store_chunk_planes.)
constexpr bool kSideAhead = kBN < 256 && kOutNHWC;

// Slice kSlice of one consumer warpgroup's epilogue (columns kSlice * kEpiCols ..), then the
// next: a compile-time recursion, so every accumulator index stays a constant (a run-time
// loop over slices put the accumulators in local memory). `ahead` holds the slice's side
// input when kSideAhead.
template <int kSlice>
JF_DEVICE void store_slices(const Epilogue& ep, const float (&acc)[kBN / 2], float* staging,
                            const Epilogue::Channel* terms, const SideChunk (&ahead)[kSliceChunks],
                            int barrier, int thread, const RowPixels& rows, int n0, i64 group,
                            Io::type* y) {
  if constexpr (kSlice < kBN / kEpiCols) {
    SideChunk side[kSliceChunks], next[kSliceChunks];
    if constexpr (kSideAhead) {
#pragma unroll
      for (int i = 0; i < kSliceChunks; ++i) side[i] = ahead[i];
      load_slice_side<kSlice + 1>(ep, thread, rows, n0, group, next);
    }
    const int lane = thread % 32, warp = thread / 32;
    // Accumulators -> staging. wgmma's layout: warp w owns rows 16w..16w+15; registers i, i + 1
    // (i even) hold columns 8 (i / 4) + 2 (lane % 4) + {0, 1} of row lane / 4 (+ 8 when
    // i % 4 == 2). Swapped, rows are channels and columns this 64-pixel block's pixels: the
    // two values go to two pixel rows (at the 68-float pitch a warp's 32 writes hit 32 banks).
#pragma unroll
    for (int i = kSlice * kEpiCols / 2; i < (kSlice + 1) * kEpiCols / 2; i += 2) {
      const int row = warp * 16 + lane / 4 + 8 * ((i % 4) / 2);
      const int col = 8 * (i / 4) + 2 * (lane % 4) - kSlice * kEpiCols;
      if constexpr (kSwapAB) {
        staging[col * kEpiPitch + row] = acc[i];
        staging[(col + 1) * kEpiPitch + row] = acc[i + 1];
      } else {
        *reinterpret_cast<float2*>(staging + row * kEpiPitch + col) =
            make_float2(acc[i], acc[i + 1]);
      }
    }
    tma::sync_threads(barrier, 128);  // the slice (and the terms) are written
    if constexpr (!kOutNHWC) {
      // NCHW output: consecutive threads take consecutive rows (pixels), so each of a chunk's
      // 8 plane stores is coalesced; a quarter-warp's 16-byte reads, rows 68 (or 36) floats
      // apart, fall on distinct banks.
#pragma unroll
      for (int i = 0; i < kSliceChunks; ++i) {
        const int chunk = thread + 128 * i;
        const int row = chunk % 64, col8 = chunk / 64;
        const i64 m = rows.pixel(row);
        const int k = n0 + kSlice * kEpiCols + col8 * 8;
        if (m < 0 || k >= KG) continue;
        const float* src = staging + row * kEpiPitch + col8 * 8;
        const float4 lo = *reinterpret_cast<const float4*>(src);
        const float4 hi = *reinterpret_cast<const float4*>(src + 4);
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        store_chunk_planes(ep, v, terms + kSlice * kEpiCols + col8 * 8, m, k, group, y);
      }
    }
#pragma unroll
    for (int i = 0; i < (kOutNHWC ? kSliceChunks : 0); ++i) {
      const int chunk = thread + 128 * i;
      const int row = chunk / (kEpiCols / 8), col8 = chunk % (kEpiCols / 8);
      const i64 m = rows.pixel(row);
      const int k = n0 + kSlice * kEpiCols + col8 * 8;
      if (m < 0 || k >= KG) continue;
      const float4 lo = *reinterpret_cast<const float4*>(staging + row * kEpiPitch + col8 * 8);
      const float4 hi = *reinterpret_cast<const float4*>(staging + row * kEpiPitch + col8 * 8 + 4);
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      store_chunk(ep, v, terms + kSlice * kEpiCols + col8 * 8,
                  kSideAhead ? side[i] : load_side(ep, m, k, group), m, k, group, y);
    }
    tma::sync_threads(barrier, 128);  // the slice is read: the next may overwrite it
    store_slices<kSlice + 1>(ep, acc, staging, terms, next, barrier, thread, rows, n0, group, y);
  }
}

typedef TermLoads<kBN, 128> ConsumerTermLoads;

// Swapped tiles whose chain reads nothing per element (no side input, no per-activation batch
// norm): a thread's 32 accumulators of a 64-pixel block belong to two channels, so the chain
// runs on them in registers and only the finished 16-bit values pass through shared memory,
// transposed into rows of pixels, on their way to 16-byte stores. Nsight Compute found the
// 3x3/64 layer's kernel bound by the shared-memory path (86% busy) with its epilogue's
// arithmetic waiting on the fp32 staging's reads (short scoreboard, the top stall); this moves
// a quarter of the bytes and no read precedes the arithmetic.
constexpr bool kRegisterEpilogue =
    kSwapAB && kOutNHWC && !Epilogue::kSide && !Epilogue::kElementParams;
constexpr int kEpi16Pitch = 72;  // 16-bit values a staged pixel row: 144 bytes, conflict-free

JF_DEVICE void store_rows_in_registers(const Epilogue& ep, const float (&acc)[kBN / 2],
                                       Io::type* staging, const Epilogue::Channel* terms,
                                       int barrier, int thread, const RowPixels& rows,
                                       i64 group, Io::type* y) {
  static_assert(!kRegisterEpilogue || (kBN == 64 && sizeof(Io::type) == 2),
                "one 64-channel block of 16-bit values");
  const int lane = thread % 32, warp = thread / 32;
  const int channel = warp * 16 + lane / 4;  // and channel + 8 (wgmma's row layout)
  const Epilogue::Channel terms_of[2] = {terms[channel], terms[channel + 8]};
#pragma unroll
  for (int i = 0; i < kBN / 2; ++i) {
    const int half = (i % 4) / 2, pixel = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
    staging[pixel * kEpi16Pitch + channel + 8 * half] =
        Io::store(ep.apply_side(acc[i], terms_of[half], 0, 0.0f));
  }
  tma::sync_threads(barrier, 128);  // the block's 64 pixel rows are staged
#pragma unroll
  for (int j = 0; j < 64 * 8 / 128; ++j) {  // 8 chunks of 8 channels a pixel
    const int chunk = thread + 128 * j, row = chunk / 8, c8 = chunk % 8;
    const i64 m = rows.pixel(row);
    if (m >= 0) {
      store16(y + m * K + group * KG + c8 * 8,
              *reinterpret_cast<const Vec16*>(staging + row * kEpi16Pitch + c8 * 8));
    }
  }
  tma::sync_threads(barrier, 128);  // read: the next block may overwrite it
}

// One consumer warpgroup's epilogue: its 64 rows (`rows`) x kBN channels (n0..) of `group`
// (`new_channels`: other channels than its previous tile's, whose terms the table holds; their
// parameters are in `loads`, issued before the tile's multiply).
JF_DEVICE void store_rows(const Epilogue& ep, const float (&acc)[kBN / 2], float* staging,
                          Epilogue::Channel* terms, bool new_channels,
                          const ConsumerTermLoads& loads, int consumer, int thread,
                          const RowPixels& rows, int n0, i64 group, Io::type* y) {
  if constexpr (kRegisterEpilogue) {
    if (new_channels) {
      store_terms(ep, loads, terms, n0, thread);
      tma::sync_threads(1 + consumer, 128);  // read by other threads before any other barrier
    }
    store_rows_in_registers(ep, acc, reinterpret_cast<Io::type*>(staging), terms, 1 + consumer,
                            thread, rows, group, y);
    return;
  }
  SideChunk side[kSliceChunks];
  if constexpr (kSideAhead) load_slice_side<0>(ep, thread, rows, n0, group, side);
  if (new_channels) store_terms(ep, loads, terms, n0, thread);
  store_slices<0>(ep, acc, staging, terms, side, 1 + consumer, thread, rows, n0, group, y);
}

// A consumer's accumulators: zeroed before a tile's first multiply, and held in place across
// the asynchronous multiplies until they have completed (wgmma::fence_operand).
JF_DEVICE void clear(float (&acc)[kRowBlocks][kBN / 2]) {
#pragma unroll
  for (int b = 0; b < kRowBlocks; ++b)
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[b][i] = 0.0f;
}

JF_DEVICE void fence_operands(float (&acc)[kRowBlocks][kBN / 2]) {
#pragma unroll
  for (int b = 0; b < kRowBlocks; ++b)
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) wgmma::fence_operand(acc[b][i]);
}

// kHalo's consumer warpgroup: tiles j = consumer, consumer + 2, ... of this block, each in its
// own stage (j % kStages == consumer): every tap's four k-steps multiply the tap's resident
// filters by a view of the tile's box; the stage is free once they are done.
JF_DEVICE void consume_halo(const TmaParams& args, const Ring& ring, float* staging,
                            Epilogue::Channel* terms, int consumer, int thread) {
  const Epilogue ep(args.p);
  Io::type* y = static_cast<Io::type*>(args.p.y);
  // One group of 64 channels: its terms, once.
  store_terms(ep, load_terms<kBN, 128>(ep, 0, 0, thread), terms, 0, thread);
  tma::sync_threads(1 + consumer, 128);
  tma::wait(ring.filters_bar(), 0);
  for (i64 j = consumer, tile = blockIdx.x + j * gridDim.x; tile < kTiles;
       j += kConsumers, tile += kConsumers * gridDim.x) {
    const int s = static_cast<int>(j % kStages);
    const HaloOrigin origin = halo_origin(tile);
    float acc[kRowBlocks][kBN / 2];
    clear(acc);
    tma::wait(ring.full_bar(s), static_cast<u32>(j / kStages) & 1);
    wgmma::fence();
#pragma unroll
    for (int tap = 0; tap < static_cast<int>(kTaps); ++tap) {
      const int r = tap / static_cast<int>(S), c = tap % static_cast<int>(S);
      const u32 view = ring.stage(s) + static_cast<u32>(r * kBoxW + c) * 128u;
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // A: MN-major filters, a k16 step 2048 bytes
        const u64 filters =
            wgmma::descriptor(ring.filters + tap * kFilterTapBytes + 2048 * k, kNBlockBytes, 1024);
        wgmma::mma_swapped(acc, filters, wgmma::descriptor(view + 32 * k, 16, kBoxW * 128));
      }
    }
    wgmma::commit();
    wgmma::wait<0>();
    fence_operands(acc);
    tma::arrive(ring.empty_bar(s));
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) {
      store_rows(ep, acc[b], staging, terms, false, ConsumerTermLoads{}, consumer, thread,
                 RowPixels{0, origin, b * 64}, 0, 0, y);
    }
  }
}

// A consumer warpgroup: for each of its tiles, the multiply over every k-tile as its stages
// land (releasing each once read), then the epilogue of its rows. The block's tiles j = 0, 1,
// ... (tile blockIdx.x + j * gridDim.x) fill the ring in that order, kKTiles stages each; the
// consumers share each one, or with kPingPong take them in turn.
JF_DEVICE void consume(const TmaParams& args, const Ring& ring, float* staging,
                       Epilogue::Channel* terms, int consumer, int thread) {
  if constexpr (kHalo) {
    consume_halo(args, ring, staging, terms, consumer, thread);
    return;
  }
  const Epilogue ep(args.p);
  Io::type* y = static_cast<Io::type*>(args.p.y);
  i64 channels = -1;  // the first channel of the previous tile's, in the terms table
  constexpr int kStep = kPingPong ? kConsumers : 1;
  u32 it = 0;  // the ring position (counted on across the shared tiles)
  for (i64 j = kPingPong ? consumer : 0, tile = blockIdx.x + j * gridDim.x; tile < kTiles;
       j += kStep, tile += kStep * gridDim.x) {
    if (kPingPong) it = static_cast<u32>(j * kKTiles);  // its tile's first ring position
    const auto [m0, n0, group] = tile_coords<kBM, kBN>(tile);
    float acc[kRowBlocks][kBN / 2];
    clear(acc);
    // New channels' epilogue parameters, loaded now: their latency overlaps the multiply
    // instead of following it (at batch 1 a block has one tile, and that was its last wait).
    const i64 first_channel = group * KG + n0;
    const bool new_channels = first_channel != channels;
    ConsumerTermLoads term_loads;
    if (new_channels) term_loads = load_terms<kBN, 128>(ep, n0, group, thread);
    int previous = -1;
    if (kPingPong && j > 0) {  // the other consumer's tile j - 1 has landed (see the top)
      tma::wait(ring.turn_bar(consumer), static_cast<u32>((j - 1) / kConsumers) & 1);
    }
    for (int kt = 0; kt < kKTiles; ++kt, ++it) {
      const int s = static_cast<int>(it % kStages);
      tma::wait(ring.full_bar(s), (it / kStages) & 1);
      wgmma::fence();
      multiply_stage(ring.stage(s), consumer, acc);
      wgmma::commit();
      wgmma::wait<1>();  // the multiply of the previous k-tile is done: release its stage
      if (previous >= 0) tma::arrive(ring.empty_bar(previous));
      previous = s;
    }
    // Every stage of this tile has landed: the other consumer's turn. Every thread arrives, so
    // the other's next turn cannot complete before all of this warpgroup's threads have passed
    // their own turn wait (a single arrival let it run two phases ahead of a lagging warp).
    if (kPingPong) tma::arrive(ring.turn_bar(1 - consumer));
    wgmma::wait<0>();
    fence_operands(acc);
    tma::arrive(ring.empty_bar(previous));
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) {
      const RowPixels rows{m0 + (kPingPong ? b * 64 : consumer * 64), {}, 0};
      store_rows(ep, acc[b], staging, terms, b == 0 && new_channels, term_loads, consumer,
                 thread, rows, n0, group, y);
    }
    channels = first_channel;
  }
}

}  // namespace tma_conv
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::tma_conv::kThreads, jaxfuse::plan::kBlocks)
    jaxfuse_conv_tma(const __grid_constant__ jaxfuse::TmaParams args) {
  using namespace jaxfuse;
  using namespace jaxfuse::tma_conv;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Epilogue::Channel terms[kConsumers][kBN];

  // Swizzle atoms and the copy engine's destinations need 1024-byte alignment; the code
  // generator reserved the slack.
  const u32 raw = mma::smem_addr(smem);
  const u32 base = (raw + 1023u) & ~1023u;
  const Ring ring{base, base + kBarriersOffset, base + kBarriersOffset + 8 * kStages,
                  base + kFiltersOffset};
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::barrier_init(ring.full_bar(s), kTransposeB ? 1 + 128 : 1);
      tma::barrier_init(ring.empty_bar(s), kStageReaders);
    }
    if (kPingPong) {
      for (int c = 0; c < kConsumers; ++c) tma::barrier_init(ring.turn_bar(c), 128);
    }
    if (kHalo) tma::barrier_init(ring.filters_bar(), 1);
    tma::fence_barrier_init();
  }
  __syncthreads();
  // (after the barriers' set-up, which overlaps the previous kernel's tail: portable.h)
  await_previous_kernel();
  if (warpgroup == 0) {
    tma::release_registers<kProducerRegisters>();
    if (kTransposeB || thread == 0) produce(args, ring, thread);
  } else {
    tma::claim_registers<kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    float* staging =
        reinterpret_cast<float*>(smem + (base - raw) + kEpiOffset + consumer * kEpiBytes);
    consume(args, ring, staging, terms[consumer], consumer, thread);
  }
}
