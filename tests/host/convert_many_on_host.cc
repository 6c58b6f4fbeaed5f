// Runs the batched-conversion kernel (csrc/kernels/convert_many.cuh) on the host, one
// (block, thread) of the grid after another, on the tables the GPU handler builds
// (csrc/gpu/convert_many.h), and checks every element against a reference conversion and every
// byte past each output: the segment walk, the 16-byte chunks and their lane order, the
// leftover elements, misaligned buffers and the split into several launches, without a GPU.
// The 16-bit conversions are the portable (HIP) ones, _Float16 and the bit-exact bfloat16
// rounding; the CUDA instructions are checked against XLA on a GPU (tests/test_convert_many.py).
//
// Built and run by tests/test_convert_kernel_on_host.py; prints "checked N elements, M bad".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "device_stubs.h"

static Dim3 blockIdx, threadIdx, gridDim, blockDim;

#include "kernels/portable.h"
#include "kernels/convert_table.h"
#include "kernels/convert_many.cuh"
#include "gpu/convert_many.h"

// The two functions of csrc/gpu/convert_many.cc the tables need (that file needs the driver).
namespace jaxfuse::gpu {
bool ConvertPairSupported(int s, int d) { return s >= 0 && s <= 2 && d >= 0 && d <= 2 && s != d; }
void CheckConvertPair(int s, int d) {
  if (!ConvertPairSupported(s, d)) throw std::invalid_argument("not a conversion");
}
}  // namespace jaxfuse::gpu

namespace {

uint32_t Reference(uint32_t in, int src, int dst) {
  float f;
  if (src == 0) {
    f = __uint_as_float(in);
  } else if (src == 1) {
    _Float16 h;
    const uint16_t b = static_cast<uint16_t>(in);
    std::memcpy(&h, &b, 2);
    f = static_cast<float>(h);
  } else {
    f = __uint_as_float(in << 16);
  }
  if (dst == 0) return __float_as_uint(f);
  if (dst == 1) {
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;  // quiet NaN
  return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;  // nearest, ties to even
}

constexpr uint8_t kUntouched = 0xAB;

}  // namespace

int main() {
  std::mt19937_64 rng(1);
  long long bad = 0, total = 0, launches = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 230);  // up to three launches
    std::vector<std::vector<uint8_t>> srcs(n), dsts(n);
    std::vector<jaxfuse::gpu::ConvertRequest> requests(n);
    for (int i = 0; i < n; ++i) {
      const int s = static_cast<int>(rng() % 3), d = (s + 1 + static_cast<int>(rng() % 2)) % 3;
      int64_t elements = rng() % 5 == 0 ? 0 : static_cast<int64_t>(rng() % 300);
      if (rng() % 7 == 0) elements = 4000 + static_cast<int64_t>(rng() % 5000);
      const int ss = s == 0 ? 4 : 2, ds = d == 0 ? 4 : 2;
      // A third of the buffers start off a 16-byte boundary (by whole elements).
      const int src_offset = rng() % 3 == 0 ? ss * (1 + static_cast<int>(rng() % 3)) : 0;
      const int dst_offset = rng() % 3 == 0 ? ds : 0;
      srcs[i].resize(elements * ss + 64);
      dsts[i].resize(elements * ds + 64, kUntouched);
      uint8_t* sp = srcs[i].data();
      sp += (16 - reinterpret_cast<uintptr_t>(sp) % 16) % 16 + src_offset;
      uint8_t* dp = dsts[i].data();
      dp += (16 - reinterpret_cast<uintptr_t>(dp) % 16) % 16 + dst_offset;
      for (int64_t k = 0; k < elements; ++k) {
        const uint32_t v = static_cast<uint32_t>(rng());  // every bit pattern: NaNs, denormals
        std::memcpy(sp + k * ss, &v, ss);
      }
      requests[i] = {sp, dp, elements, s, d};
    }
    jaxfuse::gpu::ForEachConvertTable(
        requests.data(), n, [&](const jaxfuse::ConvertTable& table) {
          ++launches;
          gridDim.x = static_cast<unsigned>(std::min<long long>(table.items / 256 + 1, 7));
          blockDim.x = 256;
          for (unsigned b = 0; b < gridDim.x; ++b) {
            for (unsigned t = 0; t < blockDim.x; ++t) {
              blockIdx.x = b;
              threadIdx.x = t;
              jaxfuse_convert_many(table);
            }
          }
        });
    for (int i = 0; i < n; ++i) {
      const jaxfuse::gpu::ConvertRequest& r = requests[i];
      const int ss = r.src_code == 0 ? 4 : 2, ds = r.dst_code == 0 ? 4 : 2;
      for (int64_t k = 0; k < r.elements; ++k) {
        uint32_t in = 0, out = 0;
        std::memcpy(&in, static_cast<const uint8_t*>(r.src) + k * ss, ss);
        std::memcpy(&out, static_cast<uint8_t*>(r.dst) + k * ds, ds);
        ++total;
        const uint32_t want = Reference(in, r.src_code, r.dst_code);
        if (out != want && bad++ < 10) {
          std::printf("request %d element %lld: %x -> %x, expected %x (%d -> %d)\n", i,
                      static_cast<long long>(k), in, out, want, r.src_code, r.dst_code);
        }
      }
      const uint8_t* end = static_cast<uint8_t*>(r.dst) + r.elements * ds;
      const uint8_t* limit = dsts[i].data() + dsts[i].size();
      for (const uint8_t* p = end; p < end + 8 && p < limit; ++p) {
        if (*p != kUntouched && bad++ < 10) std::printf("request %d: written past its end\n", i);
      }
    }
  }
  std::printf("checked %lld elements in %lld launches, %lld bad\n", total, launches, bad);
  return bad != 0;
}
