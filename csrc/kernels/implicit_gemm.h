// What the implicit-GEMM convolution kernels share: the GEMM view of the plan, where each
// thread's rows of A come from, and the epilogue that writes a finished fp32 tile.
//
// GEMM view:  Y[m][k] = sum_kk A[m][kk] * B[kk][k], m = output pixel (n, oh, ow), k = output
// channel within the group, kk = (r, s, c) = filter tap and input channel, c fastest. A is the
// NHWC input read through the convolution's window (never materialized); B is the filters.
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

// Filter element (tap, c, k) for group `group`, k within the group.
JF_DEVICE i64 b_offset(i64 group, int tap, i64 c, i64 k) {
  return kFiltersKMajor ? ((group * KG + k) * kTaps + tap) * CG + c
                        : (i64(tap) * CG + c) * K + group * KG + k;
}

// Runs the chain on 8 consecutive channels [k, k + 8) of output pixel m (k within the group)
// and writes them with 16-byte stores (one for 16-bit outputs, two for fp32). `terms` points
// at channel k's epilogue terms.
JF_DEVICE void store_chunk(const Epilogue& ep, const float (&v)[8], const Epilogue::Channel* terms,
                           i64 m, int k, i64 group, Io::type* y) {
  constexpr int kVectors = 8 * static_cast<int>(sizeof(Io::type)) / 16;
  const i64 out = m * K + group * KG + k;
  const i64 param = (m % (P * Q)) * K + group * KG + k;
  Io::type lanes[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) lanes[j] = Io::store(ep.apply(v[j], terms[j], param + j, out + j));
  Vec16 packed[kVectors];
#pragma unroll
  for (int i = 0; i < 4 * kVectors; ++i) {
    packed[i / 4].v[i % 4] = sizeof(Io::type) == 2 ? pack_halves(lanes[2 * i], lanes[2 * i + 1])
                                                   : float_to_bits(lanes[i]);
  }
#pragma unroll
  for (int i = 0; i < kVectors; ++i) store16(y + out + i * (8 / kVectors), packed[i]);
}

// Writes a finished tile: `tile` holds rows x cols fp32 results (row pitch `pitch` floats) for
// output pixels m0.. and channels n0.. of `group`; every row goes out in 16-byte stores after
// the plan's operator chain. `terms` holds the tile's per-channel epilogue terms.
template <int kRows, int kCols, int kPitch, int kThreads>
JF_DEVICE void store_tile(const Epilogue& ep, const float* tile,
                          const Epilogue::Channel* terms, i64 m0, int n0, i64 group,
                          Io::type* y) {
  for (int chunk = threadIdx.x; chunk < kRows * (kCols / 8); chunk += kThreads) {
    const int row = chunk / (kCols / 8), col8 = chunk % (kCols / 8);
    const i64 m = m0 + row;
    const int k = n0 + col8 * 8;
    if (m >= M || k >= KG) continue;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = tile[row * kPitch + col8 * 8 + j];
    store_chunk(ep, v, terms + col8 * 8, m, k, group, y);
  }
}

// The per-channel epilogue terms of channels n0 .. n0 + kCols of `group`, filled by the
// kThreads threads numbered `thread` (the block's, unless a warpgroup fills its own table).
template <int kCols, int kThreads>
JF_DEVICE void fill_terms(const Epilogue& ep, Epilogue::Channel* terms, int n0, i64 group,
                          int thread) {
  for (int j = thread; j < kCols; j += kThreads) {
    terms[j] = n0 + j < KG ? ep.channel(group * KG + n0 + j) : Epilogue::Channel::identity();
  }
}
template <int kCols, int kThreads>
JF_DEVICE void fill_terms(const Epilogue& ep, Epilogue::Channel* terms, int n0, i64 group) {
  fill_terms<kCols, kThreads>(ep, terms, n0, group, threadIdx.x);
}

}  // namespace implicit_gemm
}  // namespace jaxfuse
