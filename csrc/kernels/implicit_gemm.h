// What the implicit-GEMM convolution kernels share: the GEMM view of the plan, where each
// thread's rows of A come from, and the epilogue that writes a finished fp32 tile.
//
// GEMM view:  Y[m][k] = sum_kk A[m][kk] * B[kk][k], m = output pixel (n, oh, ow), k = output
// channel within the group, kk = (r, s, c) = filter tap and input channel, c fastest. A is the
// input read through the convolution's window (never materialized); B is the filters.
//
// NCHW plans (kNHWC false) load and store through the policies at the end of this file: A is
// gathered through registers (a channel's plane is H*W values from the next, so a row of A is
// not one 16-byte run), and the epilogue stores one value per output channel plane. The
// Hopper and stem kernels also write NCHW output from NHWC input (kOutNHWC false, kNHWC true:
// a kernel form of NCHW plans, jaxfuse.solvers.kernel_forms).
#pragma once

namespace jaxfuse {
namespace implicit_gemm {

using namespace plan;

constexpr i64 M = N * P * Q;
constexpr i64 kTaps = R * S;
// Filters stored [kk][k] (k contiguous: HWIO) or [k][kk] (OHWI, and OIHW when 1x1).
constexpr bool kFiltersKMajor = kFilterLayout != kFilterHWIO;

// Which output tile a CTA owns. Output-channel tiles vary fastest, so CTAs that share an
// activation tile run together (and find it in L2).
struct TileCoords {
  i64 m0;     // first output pixel
  int n0;     // first output channel within the group
  i64 group;
};

template <int kBM, int kBN>
JF_DEVICE TileCoords tile_coords(i64 tile) {
  constexpr i64 kMTiles = (M + kBM - 1) / kBM, kNTiles = (KG + kBN - 1) / kBN;
  return TileCoords{(tile / kNTiles) % kMTiles * kBM, static_cast<int>(tile % kNTiles) * kBN,
                    tile / (kNTiles * kMTiles)};
}

// One output pixel's input window: fixed for a thread across the whole k loop.
struct PixelRow {
  i64 image;     // n * H * W * C: the start of the pixel's image
  int ih0, iw0;  // input coordinates of filter tap (0, 0)
  bool valid;    // m < M
};

JF_DEVICE PixelRow pixel_row(i64 m) {
  const i64 n = m / (P * Q), pq = m % (P * Q);
  PixelRow row;
  row.valid = m < M;
  row.image = n * H * W * C;
  row.ih0 = static_cast<int>(pq / Q) * static_cast<int>(SH) - static_cast<int>(PT);
  row.iw0 = static_cast<int>(pq % Q) * static_cast<int>(SW) - static_cast<int>(PL);
  return row;
}

// The 8 input channels [c, c + 8) of tap (r, s) for `row`, or nullptr where the window falls
// in the padding (the caller zero-fills).
JF_DEVICE const Io::type* a_source(const Io::type* x, const PixelRow& row, int r, int s, i64 c) {
  const int ih = row.ih0 + r * static_cast<int>(DH);
  const int iw = row.iw0 + s * static_cast<int>(DW);
  const bool inside = row.valid && ih >= 0 && ih < H && iw >= 0 && iw < W;
  return inside ? x + row.image + (i64(ih) * W + iw) * C + c : nullptr;
}

// Filter element (tap, c, k) for group `group`, k within the group. (K-major filters: element
// kk = tap * CG + c of row k, which is also OIHW's when kk is read as (c, r, s): kFlatCRS.)
JF_DEVICE i64 b_offset(i64 group, int tap, i64 c, i64 k) {
  return kFiltersKMajor ? ((group * KG + k) * kTaps + tap) * CG + c
                        : (i64(tap) * CG + c) * K + group * KG + k;
}

// 16-byte words in a chunk of 8 values (one for 16-bit data, two for fp32).
constexpr int kChunkVectors = 8 * static_cast<int>(sizeof(Io::type)) / 16;

// The side input's 8 values of a chunk (see store_chunk), as loaded: one or two 16-byte words
// rather than 8 scalar loads, so an epilogue can issue all of its chunks' loads before the
// first is needed (every load's latency then overlaps the others' and the arithmetic). Empty
// for plans without a side input.
struct SideChunk {
  Vec16 raw[Epilogue::kSide ? kChunkVectors : 1];
  JF_DEVICE float value(int j) const {
    if constexpr (!Epilogue::kSide) {
      return 0.0f;
    } else if constexpr (sizeof(Io::type) == 2) {
      return Io::load(static_cast<u16>(raw[0].v[j / 2] >> (16 * (j % 2))));
    } else {
      return bits_to_float(raw[j / 4].v[j % 4]);
    }
  }
};

// The side input's chunk at output pixel m, channels [k, k + 8) of `group` (16-byte aligned:
// the tensor-core kernels run only on aligned buffers).
JF_DEVICE SideChunk load_side(const Epilogue& ep, i64 m, int k, i64 group) {
  SideChunk side;
  if constexpr (Epilogue::kSide) {
    const Io::type* z = static_cast<const Io::type*>(ep.p.side) + m * K + group * KG + k;
#pragma unroll
    for (int i = 0; i < kChunkVectors; ++i) side.raw[i] = load16(z + i * (8 / kChunkVectors));
  }
  return side;
}

// Runs the chain on 8 consecutive channels [k, k + 8) of output pixel m (k within the group)
// and writes them with 16-byte stores (one for 16-bit outputs, two for fp32). `terms` points
// at channel k's epilogue terms; `side` holds the side input's values there (load_side).
JF_DEVICE void store_chunk(const Epilogue& ep, const float (&v)[8], const Epilogue::Channel* terms,
                           const SideChunk& side, i64 m, int k, i64 group, Io::type* y) {
  const i64 out = m * K + group * KG + k;
  const i64 param = (m % (P * Q)) * K + group * KG + k;
  Io::type lanes[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    lanes[j] = Io::store(ep.apply_side(v[j], terms[j], param + j, side.value(j)));
  }
  Vec16 packed[kChunkVectors];
#pragma unroll
  for (int i = 0; i < 4 * kChunkVectors; ++i) {
    packed[i / 4].v[i % 4] = sizeof(Io::type) == 2 ? pack_halves(lanes[2 * i], lanes[2 * i + 1])
                                                   : float_to_bits(lanes[i]);
  }
#pragma unroll
  for (int i = 0; i < kChunkVectors; ++i) store16(y + out + i * (8 / kChunkVectors), packed[i]);
}

JF_DEVICE void store_chunk(const Epilogue& ep, const float (&v)[8], const Epilogue::Channel* terms,
                           i64 m, int k, i64 group, Io::type* y) {
  store_chunk(ep, v, terms, load_side(ep, m, k, group), m, k, group, y);
}

// Writes a finished tile: `tile` holds rows x cols fp32 results (row pitch `pitch` floats) for
// output pixels m0.. and channels n0.. of `group`; every row goes out in 16-byte stores after
// the plan's operator chain. `terms` holds the tile's per-channel epilogue terms. Rows from
// output pixel `m_end` on are left out.
template <int kRows, int kCols, int kPitch, int kThreads>
JF_DEVICE void store_tile(const Epilogue& ep, const float* tile,
                          const Epilogue::Channel* terms, i64 m0, int n0, i64 group,
                          Io::type* y, i64 m_end = M) {
  // Plans with a side input take a thread's chunks 4 at a time, the 4 chunks' loads first (in
  // flight together); the others one at a time, in a loop the compiler keeps small.
  constexpr int kChunks = kRows * (kCols / 8);
  constexpr int kBatch = Epilogue::kSide ? 4 : 1;
  for (int first = static_cast<int>(threadIdx.x); first < kChunks; first += kBatch * kThreads) {
    SideChunk side[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int chunk = first + i * kThreads;
      const int row = chunk / (kCols / 8), col8 = chunk % (kCols / 8);
      if (chunk < kChunks && m0 + row < m_end && n0 + col8 * 8 < KG) {
        side[i] = load_side(ep, m0 + row, n0 + col8 * 8, group);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int chunk = first + i * kThreads;
      const int row = chunk / (kCols / 8), col8 = chunk % (kCols / 8);
      const i64 m = m0 + row;
      const int k = n0 + col8 * 8;
      if (chunk >= kChunks || m >= m_end || k >= KG) continue;
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = tile[row * kPitch + col8 * 8 + j];
      store_chunk(ep, v, terms + col8 * 8, side[i], m, k, group, y);
    }
  }
}

// The per-channel epilogue terms of channels n0 .. n0 + kCols of `group`, in two steps: the
// parameters' loads into registers (a kernel may issue them before its first copies, so they
// are not queued behind them: at batch 1, folding after the copies waited on loads that were
// behind a whole ring of copies), then the fold into the table, by the kThreads threads
// numbered `thread` (the block's, unless a warpgroup fills its own table).
template <int kCols, int kThreads>
struct TermLoads {
  static constexpr int kPerThread = (kCols + kThreads - 1) / kThreads;
  Epilogue::Raw raw[kPerThread];
};
template <int kCols, int kThreads>
JF_DEVICE TermLoads<kCols, kThreads> load_terms(const Epilogue& ep, int n0, i64 group,
                                                int thread) {
  TermLoads<kCols, kThreads> loads;
#pragma unroll
  for (int i = 0; i < loads.kPerThread; ++i) {
    const int j = thread + i * kThreads;
    if (j < kCols && n0 + j < KG) loads.raw[i] = ep.raw(group * KG + n0 + j);
  }
  return loads;
}
template <int kCols, int kThreads>
JF_DEVICE void store_terms(const Epilogue& ep, const TermLoads<kCols, kThreads>& loads,
                           Epilogue::Channel* terms, int n0, int thread) {
#pragma unroll
  for (int i = 0; i < loads.kPerThread; ++i) {
    const int j = thread + i * kThreads;
    if (j < kCols) terms[j] = n0 + j < KG ? ep.fold(loads.raw[i]) : Epilogue::Channel::identity();
  }
}
// Both steps at once.
template <int kCols, int kThreads>
JF_DEVICE void fill_terms(const Epilogue& ep, Epilogue::Channel* terms, int n0, i64 group) {
  const int thread = static_cast<int>(threadIdx.x);
  store_terms(ep, load_terms<kCols, kThreads>(ep, n0, group, thread), terms, n0, thread);
}

// ----- NCHW: A gathered through registers, output stored plane by plane -----------------------
//
// Each thread owns one output pixel (one row of A) and gathers kVec consecutive kk of it per row
// chunk, one value per load: a warp's lanes hold consecutive pixels with the same kk, so every
// load reads a contiguous run of an input row (coalesced), and the finished chunk is one 16-byte
// shared-memory store. The kernels issue the loads for a later k-tile into registers before the
// current one multiplies, and store them after.
//
// Reduction order. HWIO and OHWI filters (and OIHW 1x1, which is OHWI): kk = (r, s, c) as for
// NHWC, so a k-tile lies within one tap: one padding test per k-tile, and the chunk's channels
// are plane offsets known at compile time. OIHW filters of several taps: kk = (c, r, s), s
// fastest (kFlatCRS), so B's rows are OIHW runs as stored (16-byte copies, as for OHWI); each A
// value then has its own channel and tap (compile-time constants per phase of the k-tile in the
// (c, r, s) period: gather_flat), and its padding test is a bit of the pixel's tap mask.
constexpr int kVec = 16 / static_cast<int>(sizeof(Io::type));  // values in one 16-byte chunk
constexpr i64 kPlane = H * W;                                   // one input channel
constexpr i64 kOutPlane = P * Q;                                // one output channel
constexpr bool kFlatCRS = !kNHWC && kFilterLayout == kFilterOIHW && kTaps > 1;

// kFlatCRS: bit t set where filter tap t of `row` reads inside the input (none past M).
JF_DEVICE u32 tap_mask(const PixelRow& row) {
  u32 mask = 0;
#pragma unroll
  for (int t = 0; t < (kFlatCRS && kTaps <= 32 ? static_cast<int>(kTaps) : 0); ++t) {
    const int ih = row.ih0 + t / static_cast<int>(S) * static_cast<int>(DH);
    const int iw = row.iw0 + t % static_cast<int>(S) * static_cast<int>(DW);
    mask |= row.valid && ih >= 0 && ih < H && iw >= 0 && iw < W ? 1u << t : 0u;
  }
  return mask;
}

// kFlatCRS: the reduction repeats every kVec channels (kTaps chunks of kVec values). Gathers
// chunks kStep apart from one whose phase in that period is kPhase, so that every value's
// channel and tap, hence its offset from `base` (the first one's period, tap (0, 0)) and its
// bit in `taps`, are compile-time constants.
template <int kChunks, int kStep, int kPhase>
JF_DEVICE void gather_flat(const Io::type* base, u32 taps, Io::type (&v)[kChunks * kVec]) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int kk = (kPhase + i * kStep) * kVec + e;
      const int dc = kk / static_cast<int>(kTaps), t = kk % static_cast<int>(kTaps);
      const i64 offset = dc * kPlane + t / S * DH * W + t % S * DW;
      v[i * kVec + e] = (taps & (1u << t)) != 0 ? base[offset] : Io::type(0);
    }
  }
}

template <int kChunks, int kStep, int kPhase = 0>
JF_DEVICE void gather_flat_phase(int phase, const Io::type* base, u32 taps,
                                 Io::type (&v)[kChunks * kVec]) {
  if constexpr (kPhase < kTaps) {
    if (phase == kPhase) {
      gather_flat<kChunks, kStep, kPhase>(base, taps, v);
    } else {
      gather_flat_phase<kChunks, kStep, kPhase + 1>(phase, base, taps, v);
    }
  }
}

// Gathers this thread's kChunks row chunks of A for the k-tile at reduction index kk0 (a
// multiple of kVec): chunk i holds kk0 + (col0 + i * kStep) * kVec + [0, kVec) of output pixel
// `row` (`taps`: its tap_mask), zero in the padding. `channel0`: the group's first input
// channel. (One padding test per k-tile and compile-time channel offsets when a k-tile lies in
// one tap; else per value, dispatched once per k-tile on the first chunk's phase.)
template <int kChunks, int kStep>
JF_DEVICE void gather_planes(const Io::type* x, const PixelRow& row, u32 taps, int kk0,
                             i64 channel0, int col0, Io::type (&v)[kChunks * kVec]) {
  if constexpr (kFlatCRS) {
    if constexpr (kTaps <= 32) {  // (more: the kernels never gather their rows this way)
      const int chunk = kk0 / kVec + col0;
      const int period = chunk / static_cast<int>(kTaps);
      const Io::type* base = x + row.image + (channel0 + i64(period) * kVec) * kPlane +
                             i64(row.ih0) * W + row.iw0;
      gather_flat_phase<kChunks, kStep>(chunk - period * static_cast<int>(kTaps), base, taps, v);
    }
  } else {
    const int tap = kk0 / static_cast<int>(CG);
    const i64 c = channel0 + kk0 % CG + col0 * kVec;
    const int ih = row.ih0 + tap / static_cast<int>(S) * static_cast<int>(DH);
    const int iw = row.iw0 + tap % static_cast<int>(S) * static_cast<int>(DW);
    const bool inside = row.valid && ih >= 0 && ih < H && iw >= 0 && iw < W;
    const Io::type* base = x + row.image + c * kPlane + i64(ih) * W + iw;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        v[i * kVec + e] = inside ? base[(i64(i) * kStep * kVec + e) * kPlane] : Io::type(0);
      }
    }
  }
}

// kVec gathered values as one 16-byte chunk.
JF_DEVICE Vec16 pack_chunk(const Io::type* v) {
  Vec16 out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) reinterpret_cast<Io::type*>(&out)[e] = v[e];
  return out;
}

// NCHW output: the chain on 8 consecutive channels [k, k + 8) of output pixel m (k within the
// group), one value per output plane. Lanes hold consecutive pixels, so each store is coalesced.
JF_DEVICE void store_chunk_planes(const Epilogue& ep, const float (&v)[8],
                                  const Epilogue::Channel* terms, i64 m, int k, i64 group,
                                  Io::type* y) {
  // (32-bit division where the pixel index fits.)
  const i64 image = M <= 0x7fffffff ? static_cast<u32>(m) / static_cast<u32>(kOutPlane)
                                    : m / kOutPlane;
  const i64 param = (group * KG + k) * kOutPlane + (m - image * kOutPlane);
  const i64 out = image * K * kOutPlane + param;
  // Every value first, then the stores: a side input's loads need not wait for them.
  Io::type values[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    values[j] = Io::store(ep.apply(v[j], terms[j], param + j * kOutPlane, out + j * kOutPlane));
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) y[out + j * kOutPlane] = values[j];
}

// NCHW output: writes a finished tile as store_tile does, a thread per output pixel and 8
// channels, consecutive threads on consecutive pixels. The staging tile holds row `row`'s
// column `col` at col ^ (row & kFlip) (kFlip 0 or 4: conv_wgmma.cuh says why). Rows from
// output pixel `m_end` on are left out.
template <int kRows, int kCols, int kPitch, int kThreads, int kFlip>
JF_DEVICE void store_tile_planes(const Epilogue& ep, const float* tile,
                                 const Epilogue::Channel* terms, i64 m0, int n0, i64 group,
                                 Io::type* y, i64 m_end = M) {
  static_assert(kPitch % 4 == 0 && (kFlip == 0 || kFlip == 4), "16-byte reads");
  for (int chunk = threadIdx.x; chunk < kRows * (kCols / 8); chunk += kThreads) {
    const int row = chunk % kRows, col8 = chunk / kRows;
    const i64 m = m0 + row;
    const int k = n0 + col8 * 8;
    if (m >= m_end || k >= KG) continue;
    const float* src = tile + row * kPitch + col8 * 8;
    const int flip = row & kFlip;
    const float4 lo = *reinterpret_cast<const float4*>(src + flip);
    const float4 hi = *reinterpret_cast<const float4*>(src + (flip ^ 4));
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    store_chunk_planes(ep, v, terms + col8 * 8, m, k, group, y);
  }
}

}  // namespace implicit_gemm
}  // namespace jaxfuse
