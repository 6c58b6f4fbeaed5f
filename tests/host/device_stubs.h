// What a GPU kernel source needs from CUDA to compile as host C++ (tests/host/*_on_host.cc):
// the function qualifiers as nothing, the portable (HIP) 16-bit conversions, and the float <->
// bits built-ins. The including harness declares the grid's indices (blockIdx, threadIdx,
// gridDim, blockDim) as its way of running threads needs them.
#pragma once

#include <cstring>

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define JF_HIP 1

static inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
