"""Builds a standalone CUDA probe (one .cu source that includes csrc/kernels/) with nvcc for
sm_90a and runs it, for the scripts that check wgmma conventions on a Hopper GPU
(wgmma_probe.py, halo_probe.py)."""

import os
import subprocess
import tempfile

KERNELS = os.path.join(os.path.dirname(__file__), "..", "csrc", "kernels")

# How every probe source starts: the kernels' headers, the generated wgmma wrapper (the caller
# replaces __WGMMA__), the accumulators' store, and a host helper that fills an fp16 operand
# with small values fp16 holds exactly, beside their floats for the CPU reference.
PRELUDE = r"""
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cuda_fp16.h>
#include "portable.h"
#include "mma.h"
#include "wgmma.h"
__WGMMA__
using namespace jaxfuse;
// A warpgroup's 64 x kN fp32 accumulators (wgmma's register layout) into row-major d.
template <int kN>
__device__ void store_accumulators(const float* acc, float* d) {
  const int t = threadIdx.x, w = t / 32, l = t % 32;
  for (int i = 0; i < kN / 2; ++i) {
    const int row = 16 * w + l / 4 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
    d[row * kN + col] = acc[i];
  }
}
static void random_halves(u16* dst, float* ref, int count) {
  for (int i = 0; i < count; ++i) {
    ref[i] = (rand() % 17 - 8) / 8.f;
    dst[i] = __half_as_ushort(__float2half(ref[i]));
  }
}
"""


def build_and_run(source: str) -> int:
    """Compiles `source`, runs it, prints its output; the exit status (1 if it did not build)."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, exe = os.path.join(tmp, "probe.cu"), os.path.join(tmp, "probe")
        with open(cu, "w") as f:
            f.write(source)
        build = subprocess.run(
            ["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", KERNELS,
             "-o", exe, cu], capture_output=True, text=True)
        if build.returncode:
            print(build.stderr[-3000:])
            return 1
        run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
        print(run.stdout, run.stderr, end="")
        return run.returncode
