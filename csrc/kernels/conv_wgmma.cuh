// Implicit-GEMM convolution on Hopper (sm_90a) with warpgroup MMA: fp16/bf16 NHWC or NCHW
// activations, or fp32 NHWC ones through TF32; fp32 accumulation. Each warpgroup (4 warps)
// owns 64 output pixels x kBN output channels.
//
// Per k-tile (one filter tap, 128 bytes of consecutive input channels: 64 16-bit ones or 32
// fp32 ones) every thread copies its share of A and B into a 128-byte-swizzled shared-memory
// stage with cp.async (zero-filling padding); the warpgroups then issue four asynchronous
// 64 x kBN x 16 (TF32: x 8) multiplies reading both operands from shared memory through
// descriptors (wgmma.h), and the copies for a later k-tile overlap them. The epilogue stages
// the fp32 tile through shared memory (implicit_gemm.h: store_tile).
//
// TF32 (fp32 plans whose precision allows it, as lax's default does on this GPU): wgmma reads
// fp32 values from shared memory as TF32 (their low 13 mantissa bits ignored) and takes both
// operands K-major only, so HWIO filters ([kk][k], k contiguous) are transposed on their way
// in: 4-byte copies, each into its K-major place (load_b).
//
// NCHW output (kOutNHWC false: NCHW plans, or the NHWC form of one that reads its input
// transposed) is stored plane by plane from the staging tile (store_tile_planes).
//
// NCHW (implicit_gemm.h: gather_planes): A's rows are gathered value by value into registers,
// the loads for k-tile kt + kStages - 1 issued before k-tile kt's multiply and written to their
// stage (16-byte shared stores, same swizzle) at the next iteration; B still streams in with
// cp.async. The epilogue reads the staging tile a pixel per thread and stores channel planes.
//
// float32 filters of a 16-bit plan (kWideB, PlanSpec::wide_filters: a model keeping its
// parameters in float32): each B chunk of 8 values arrives as two 16-byte copies into the
// stage's raw area, laid out by thread, and the thread that copied it rounds it to the plan's
// dtype into its swizzled place (convert_b) once its own copies have landed, before the
// stage's barrier: the copy pipeline keeps its depth, no barrier is added, and no conversion
// pass over the filters runs before the call.
//
// Split-K (kSplits > 1, for outputs too small to occupy the device): the kSplits CTAs of a
// thread-block cluster each reduce a slice of the k-tiles, and each CTA sums and writes
// kBM / kSplits of the tile's rows. Every CTA sends its partial sums of those rows straight
// from its accumulators into the owning CTA's receive area (st.async through distributed
// shared memory), where they complete a transaction on the owner's barrier: the owner waits
// for its own rows' bytes only, and nobody waits for the cluster to finish (Nsight Compute,
// 3x3/256 at batch 1 on an H100: the former pull through two cluster barriers was 23% of the
// kernel's stall samples). No global workspace, no atomics, so it is safe in CUDA graphs and
// concurrent streams.
//
// From the code generator (namespace plan): kBM (64 or 128), kBN (64, 128 or 256), kStages,
// kMinBlocks, kSmemBytes, kSplits; and JF_CLUSTER_DIMS, the cluster attribute (empty unless
// split). Requirements it checks: CG % 64 == 0, KG % 8 == 0; the host falls back to the direct
// kernel for buffers that are not 16-byte aligned.
#pragma once

#include "implicit_gemm.h"
#include "mma.h"
#include "tma.h"
#include "wgmma.h"

namespace jaxfuse {
namespace hopper {

using namespace plan;
using namespace implicit_gemm;

constexpr bool kTf32 = sizeof(Io::type) == 4;
constexpr int kBK = 128 / static_cast<int>(sizeof(Io::type));  // values in one swizzle row
constexpr int kChunkValues = kBK / 8;                           // values in a 16-byte chunk
constexpr int kWarpGroups = kBM / 64;
constexpr int kThreads = kWarpGroups * 128;
constexpr int kKTiles = static_cast<int>(kTaps * CG / kBK);
static_assert(kSplits >= 1 && kSplits <= 8 && kBM % kSplits == 0 && kKTiles >= kSplits,
              "split-K over at most 8 CTAs (a portable cluster), each with some k-tiles");
constexpr u32 kATileBytes = kBM * 128;
constexpr u32 kBTileBytes = kBN * 128;
constexpr int kAChunks = kBM * 8 / kThreads;  // 16-byte chunks per thread per stage
constexpr int kBChunks = kBN * 8 / kThreads;
constexpr bool kWideB = sizeof(FilterIo::type) != sizeof(Io::type);
constexpr u32 kRawBBytes = kWideB ? kBChunks * kThreads * 32 : 0;  // fp32 B chunks, by thread
constexpr u32 kStageBytes = kATileBytes + kBTileBytes + kRawBBytes;  // whole 1024-byte atoms
constexpr u32 kNBlockBytes = 64 * 128;  // MN-major B: 64 K rows of one 64-wide block of N
constexpr int kCPitch = kBN + 8;  // floats: the epilogue's staging tile (8: no conflicts)
// NCHW: A gathered through registers; a thread's pixel is row tid % kBM, its chunks the columns
// tid / kBM + i * kColStep.
constexpr bool kGatherA = !kNHWC;
constexpr int kColStep = kThreads / kBM;

static_assert(kBM == 64 || kBM == 128, "one or two warpgroups");
static_assert(kStages >= 3, "two k-tiles in the multiply, at least one loading");
static_assert(kBN % 64 == 0 && kBN <= 256, "wgmma N");
static_assert(CG % kBK == 0, "a k-tile stays within one filter tap");
static_assert(KG % 8 == 0 && C % 8 == 0, "16-byte rows");
static_assert(kAChunks * kColStep == 8, "NCHW: a thread's chunks cover its columns");
static_assert(!kFlatCRS || kTaps <= 32, "NCHW, OIHW: one tap mask bit per filter tap");
static_assert(!kTf32 || kNHWC, "TF32: NHWC activations (NCHW gathers 16-bit values)");
static_assert(!kWideB || (!kTf32 && kNHWC), "fp32 filters: 16-bit NHWC plans");
// TF32 with [kk][k] filters: B transposed into K-major rows as it loads (load_b).
constexpr bool kTransposeB = kTf32 && !kFiltersKMajor;
// Split-K: kSplits slices of the partial sums of this CTA's kRows rows, one from each CTA of
// the cluster, after the pipeline's stages (they arrive while this CTA may still multiply).
// Unsplit, the epilogue's staging tile reuses the stages.
constexpr int kRows = kBM / kSplits;
constexpr u32 kReceiveBytes = kSplits > 1 ? kBM * kCPitch * 4 : 0;
static_assert(kStages * kStageBytes + kReceiveBytes + 1024 <= kSmemBytes &&
              kBM * kCPitch * 4 + 1024 <= kSmemBytes, "shared memory budget");

JF_DEVICE void load_a(const Io::type* x, u32 sa, const PixelRow (&rows)[kAChunks], int kt,
                      i64 channel0, int tid) {
  const int kk0 = kt * kBK;
  const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
  const int r = tap / static_cast<int>(S), s = tap % static_cast<int>(S);
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int chunk = tid + i * kThreads;
    const int row = chunk / 8, col = chunk % 8;
    const Io::type* src = a_source(x, rows[i], r, s, channel0 + c0 + col * kChunkValues);
    mma::copy16_async(sa + wgmma::swizzled_chunk(row, col), src ? src : x, src);
  }
}

// NCHW: A's chunks of k-tile kt into registers, and from registers into stage `sa`. Templates
// on the value type, so TF32 plans, which never gather, do not instantiate the 16-bit code.
template <typename T>
JF_DEVICE void gather_a(const T* x, const PixelRow& row, u32 taps, int kt, i64 channel0, int tid,
                        T (&v)[kAChunks * 8]) {
  if constexpr (kGatherA && sizeof(T) == 2) {
    gather_planes<kAChunks, kColStep>(x, row, taps, kt * kBK, channel0, tid / kBM, v);
  }
}

template <typename T>
JF_DEVICE void store_a(u32 sa, int tid, const T (&v)[kAChunks * 8]) {
  if constexpr (kGatherA && sizeof(T) == 2) {
    const int row = tid % kBM;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int col8 = tid / kBM + i * kColStep;
      mma::store16_shared(sa + wgmma::swizzled_offset(row, col8 * 8), pack_chunk(v + i * 8));
    }
  }
}

// Where chunk `chunk` of a stage's B tile goes, from the tile's start.
JF_DEVICE u32 b_chunk_offset(int chunk) {
  if (kFiltersKMajor) return wgmma::swizzled_chunk(chunk / 8, chunk % 8);  // one output channel
  const int krow = chunk / (kBN / 8), n8 = chunk % (kBN / 8);  // one input channel, 64 outputs
  return (n8 / 8) * kNBlockBytes + wgmma::swizzled_offset(krow, (n8 % 8) * 8);
}

// kWideB: the raw area's 16-byte words of this thread's chunk i (half 0 or 1).
JF_DEVICE u32 raw_b_word(u32 sb, int i, int half, int tid) {
  return sb + kBTileBytes + ((2 * i + half) * kThreads + tid) * 16u;
}

JF_DEVICE void load_b(const FilterIo::type* w, u32 sb, int kt, i64 group, int n0, int tid) {
  const int kk0 = kt * kBK;
  const int tap = kk0 / static_cast<int>(CG), c0 = kk0 % static_cast<int>(CG);
  if constexpr (kTransposeB) {
    // TF32, [kk][k] filters, stored K-major: a warp copies 8 output channels x 4 reduction
    // values at a time, so its reads are four 32-byte runs of filter rows and its writes fill
    // 32 distinct banks (row n's chunk kk / 4 sits at chunk (kk / 4) ^ (n % 8)). Warp w takes
    // the 8-channel groups w, w + kWarps, ... of every 4-value group q: each copy's offsets
    // from the thread's first are compile-time constants.
    constexpr int kWarps = kThreads / 32, kGroups = kBN / 8;
    static_assert(kGroups % kWarps == 0, "every warp the same channel groups");
    const int lane = tid % 32, warp = tid / 32;
    const int n_first = warp * 8 + lane % 8, kk_first = lane / 8;
    const FilterIo::type* src = w + b_offset(group, tap, c0 + kk_first, n0 + n_first);
    const u32 dst = sb + n_first * 128u + kk_first * 4u;
#pragma unroll
    for (int q = 0; q < kBK / 4; ++q) {
      const u32 chunk = (static_cast<u32>(q) ^ static_cast<u32>(lane % 8)) << 4;
#pragma unroll
      for (int j = 0; j < kGroups / kWarps; ++j) {
        const bool ok = n0 + n_first + j * kWarps * 8 < KG;
        mma::copy4_async(dst + j * kWarps * 8 * 128 + chunk,
                         ok ? src + i64(q) * 4 * K + j * kWarps * 8 : w, ok);
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int chunk = tid + i * kThreads;
    const int k = n0 + (kFiltersKMajor ? chunk / 8 : chunk % (kBN / 8) * 8);
    const int c = c0 + (kFiltersKMajor ? chunk % 8 * kChunkValues : chunk / (kBN / 8));
    const bool ok = k < KG;
    const FilterIo::type* src = ok ? w + b_offset(group, tap, c, k) : w;
    if constexpr (kWideB) {  // 8 fp32 values: two copies, converted by convert_b
      mma::copy16_async(raw_b_word(sb, i, 0, tid), src, ok);
      mma::copy16_async(raw_b_word(sb, i, 1, tid), ok ? src + 4 : w, ok);
    } else {
      mma::copy16_async(sb + b_chunk_offset(chunk), src, ok);
    }
  }
}

// kWideB: this thread's fp32 B chunks of stage `sb` (its own copies, landed), rounded to the
// plan's dtype into their places in the B tile.
JF_DEVICE void convert_b(u32 sb, int tid) {
  if constexpr (kWideB) {
#pragma unroll
    for (int i = 0; i < kBChunks; ++i) {
      float v[8];
      *reinterpret_cast<float4*>(v) = mma::load16_shared(raw_b_word(sb, i, 0, tid));
      *reinterpret_cast<float4*>(v + 4) = mma::load16_shared(raw_b_word(sb, i, 1, tid));
      Vec16 packed;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        packed.v[j] = pack_halves(Io::store(v[2 * j]), Io::store(v[2 * j + 1]));
      }
      mma::store16_shared(sb + b_chunk_offset(tid + i * kThreads), packed);
    }
  }
}

JF_DEVICE void load_stage(const Io::type* x, const FilterIo::type* w, u32 stage,
                          const PixelRow (&rows)[kAChunks], int kt, i64 group, int n0, int tid) {
  load_a(x, stage, rows, kt, group * CG, tid);
  load_b(w, stage + kATileBytes, kt, group, n0, tid);
}

// One stage: this warpgroup's 64 rows of A times all kBN columns of B.
JF_DEVICE void multiply_stage(u32 stage, int warpgroup, float (&acc)[kBN / 2]) {
  wgmma::multiply_k_tile<kFiltersKMajor || kTf32>(acc, stage + warpgroup * 64 * 128,
                                                  stage + kATileBytes, kNBlockBytes);
}

// Split-K: this CTA's accumulators (wgmma's layout, as in the kernel's epilogue), each row
// into the receive area of the CTA that owns it, at slice `split`. A thread holds rows row0
// and row0 + 8 only, so it maps two owners' addresses once, not once a store.
JF_DEVICE void send_partial_sums(const float (&acc)[kBN / 2], u32 receive, u32 landed, int split,
                                 int row0, int lane) {
  u32 area[2], bar[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const u32 owner = static_cast<u32>((row0 + 8 * half) / kRows);
    area[half] = wgmma::map_to_cluster_rank(receive, owner);
    bar[half] = wgmma::map_to_cluster_rank(landed, owner);
  }
#pragma unroll
  for (int i = 0; i < kBN / 2; i += 2) {
    const int half = (i % 4) / 2, row = row0 + 8 * half, col = 8 * (i / 4) + 2 * (lane % 4);
    const u32 slot = area[half] + ((split * kRows + row % kRows) * kCPitch + col) * 4u;
    wgmma::store_cluster_async(slot, bar[half], acc[i], acc[i + 1]);
  }
}

// Split-K: once every slice has landed, their sum over this CTA's rows through the epilogue:
// NHWC a row's channels per thread in turn, NCHW a channel group's pixels (plane stores).
JF_DEVICE void store_split_rows(const Epilogue& ep, const float* receive,
                                const Epilogue::Channel* terms, i64 m0, int n0, i64 group,
                                Io::type* y) {
  for (int chunk = threadIdx.x; chunk < kRows * (kBN / 8); chunk += kThreads) {
    const int row = kOutNHWC ? chunk / (kBN / 8) : chunk % kRows;
    const int col8 = kOutNHWC ? chunk % (kBN / 8) : chunk / kRows;
    const i64 m = m0 + row;
    const int k = n0 + col8 * 8;
    if (m >= M || k >= KG) continue;
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int slice = 0; slice < kSplits; ++slice) {
      const float* src = receive + (slice * kRows + row) * kCPitch + col8 * 8;
      const float4 lo = *reinterpret_cast<const float4*>(src);
      const float4 hi = *reinterpret_cast<const float4*>(src + 4);
      v[0] += lo.x, v[1] += lo.y, v[2] += lo.z, v[3] += lo.w;
      v[4] += hi.x, v[5] += hi.y, v[6] += hi.z, v[7] += hi.w;
    }
    if (kOutNHWC) {
      store_chunk(ep, v, terms + col8 * 8, m, k, group, y);
    } else {
      store_chunk_planes(ep, v, terms + col8 * 8, m, k, group, y);
    }
  }
}

}  // namespace hopper
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(jaxfuse::hopper::kThreads, jaxfuse::plan::kMinBlocks)
    JF_CLUSTER_DIMS jaxfuse_conv_wgmma(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::hopper;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Epilogue::Channel terms[kBN];

  // Until await_previous_kernel, arithmetic and shared memory only (portable.h says why).
  const int tid = threadIdx.x, lane = tid % 32;
  const int warpgroup = tid / 128, warp_in_group = (tid % 128) / 32;
  // A cluster's CTAs (consecutive blocks) share one output tile and split its k-tiles.
  const int split = static_cast<int>(blockIdx.x % kSplits);
  const int kt_begin = split * kKTiles / kSplits, kt_end = (split + 1) * kKTiles / kSplits;
  const int k_tiles = kt_end - kt_begin;
  const auto [m0, n0, group] = tile_coords<kBM, kBN>(blockIdx.x / kSplits);

  const Io::type* x = static_cast<const Io::type*>(p.x);
  const FilterIo::type* w = static_cast<const FilterIo::type*>(p.w);
  PixelRow rows[kAChunks];
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    rows[i] = pixel_row(m0 + (kGatherA ? tid % kBM : (tid + i * kThreads) / 8));
  }
  const u32 taps = tap_mask(rows[0]);
  Io::type staged[kAChunks * 8];  // NCHW: A of the next k-tile to store

  // Swizzle atoms need 1024-byte alignment; the code generator reserved the slack.
  const u32 raw = mma::smem_addr(smem);
  const u32 base = (raw + 1023u) & ~1023u;
  auto stage = [&](int st) { return base + st * kStageBytes; };
  // Split-K: completes once all kSplits slices of this CTA's rows have arrived. Initialized
  // before the cluster's barrier, which every CTA waits on before its first remote store.
  __shared__ alignas(8) unsigned long long partials_landed;
  const u32 landed = mma::smem_addr(&partials_landed);
  if constexpr (kSplits > 1) {
    if (tid == 0) {
      tma::barrier_init(landed, 1);
      tma::arrive_expect_bytes(landed, kBM * kBN * 4);
      tma::fence_barrier_init();
    }
    wgmma::cluster_arrive_relaxed();
  }

  float acc[kBN / 2];
#pragma unroll
  for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;

  await_previous_kernel();
  const Epilogue ep(p);  // (reads the runtime scalars)

  // Pipeline: kStages - 2 k-tiles of copies in flight ahead of the multiply, and the multiply of
  // one k-tile still running while the next is issued. A stage is refilled only after every
  // warpgroup has waited for the multiply that read it (the wait, then the next barrier).
  constexpr int kAhead = kStages - 2;
  // The epilogue's per-channel parameters, loaded ahead of the copies and folded after them.
  const TermLoads<kBN, kThreads> term_loads = load_terms<kBN, kThreads>(ep, n0, group, tid);
  // Deep rings (split-K at batch 1) issue many k-tiles up front: a rolled loop keeps that code
  // short, as a CTA runs it once with a cold instruction cache.
#pragma unroll(kAhead > 4 ? 1 : kAhead)
  for (int st = 0; st < kAhead; ++st) {
    if (st < k_tiles) {
      if (kGatherA) {
        gather_a(x, rows[0], taps, kt_begin + st, group * CG, tid, staged);
        store_a(stage(st), tid, staged);
        load_b(w, stage(st) + kATileBytes, kt_begin + st, group, n0, tid);
      } else {
        load_stage(x, w, stage(st), rows, kt_begin + st, group, n0, tid);
      }
    }
    mma::commit_copies();
  }
  if (kGatherA && kAhead < k_tiles) {
    gather_a(x, rows[0], taps, kt_begin + kAhead, group * CG, tid, staged);
  }
  store_terms<kBN, kThreads>(ep, term_loads, terms, n0, tid);
  for (int kt = 0; kt < k_tiles; ++kt) {
    mma::wait_copies<kAhead - 1>();
    convert_b(stage(kt % kStages) + kATileBytes, tid);
    wgmma::fence_shared_for_async();  // this thread's copies, visible to the tensor cores
    __syncthreads();                  // ... and everyone's; stage kt - 2 is no longer read
    wgmma::fence();
    multiply_stage(stage(kt % kStages), warpgroup, acc);
    wgmma::commit();
    const int next = kt + kAhead;  // into the stage k-tile kt - 2 used
    if (next < k_tiles) {
      if (kGatherA) {
        store_a(stage(next % kStages), tid, staged);
        load_b(w, stage(next % kStages) + kATileBytes, kt_begin + next, group, n0, tid);
      } else {
        load_stage(x, w, stage(next % kStages), rows, kt_begin + next, group, n0, tid);
      }
    }
    mma::commit_copies();
    if (kGatherA && next + 1 < k_tiles) {  // in flight while k-tile kt multiplies
      gather_a(x, rows[0], taps, kt_begin + next + 1, group * CG, tid, staged);
    }
    wgmma::wait<1>();  // the multiply of k-tile kt - 1 is done; kt's may still run
  }
  wgmma::wait<0>();
#pragma unroll
  for (int i = 0; i < kBN / 2; ++i) wgmma::fence_operand(acc[i]);
  mma::wait_copies<0>();
  // wgmma's accumulator layout: warp w of the group owns rows 16w..16w+15; registers i, i + 1
  // (i even) hold columns 8 (i / 4) + 2 (lane % 4) + {0, 1} of row lane / 4 (+ 8 when
  // i % 4 == 2).
  const int row0 = warpgroup * 64 + warp_in_group * 16 + lane / 4;
  Io::type* y = static_cast<Io::type*>(p.y);
  if constexpr (kSplits > 1) {
    const u32 receive = base + kStages * kStageBytes;
    wgmma::cluster_wait();  // every CTA has started and initialized its barrier
    send_partial_sums(acc, receive, landed, split, row0, lane);
    tma::wait(landed, 0);
    store_split_rows(ep, reinterpret_cast<const float*>(smem + (receive - raw)), terms,
                     m0 + split * kRows, n0, group, y);
    return;
  }
  __syncthreads();  // every warpgroup's multiplies are done with the stages the tile reuses

  // Accumulators -> shared fp32 tile. NCHW output reads the tile back a row per lane (16-byte
  // reads of 8 columns), and rows kCPitch = 8 banks apart would put rows r and r + 4 on the
  // same banks: column col of row row is stored at col ^ (row & 4), which keeps both these
  // writes (rows r and r + 4 swap halves of their 8-column groups) and those reads free of
  // bank conflicts.
  constexpr int kFlip = kOutNHWC ? 0 : 4;
  float* tile = reinterpret_cast<float*>(smem + (base - raw));
#pragma unroll
  for (int i = 0; i < kBN / 2; i += 2) {
    const int row = row0 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * (lane % 4);
    *reinterpret_cast<float2*>(tile + row * kCPitch + (col ^ (row & kFlip))) =
        make_float2(acc[i], acc[i + 1]);
  }
  __syncthreads();
  if (kOutNHWC) {
    store_tile<kBM, kBN, kCPitch, kThreads>(ep, tile, terms, m0, n0, group, y);
  } else {
    store_tile_planes<kBM, kBN, kCPitch, kThreads, kFlip>(ep, tile, terms, m0, n0, group, y);
  }
}
