"""Checks the wgmma building blocks (csrc/kernels/wgmma.h + the generated mma wrapper) on a
Hopper GPU: one warpgroup multiplies 64 x N x 64 tiles laid out exactly as the conv kernel lays
them out, for every descriptor convention in question, against a CPU reference.

    python scripts/wgmma_probe.py      # needs nvcc and an sm_90 GPU
"""

import sys

from nvcc_probe import PRELUDE, build_and_run

from jaxfuse._extension import extension

PROBE = PRELUDE + r"""
constexpr int NN = __N__;
// A: 64 x 64 (m, k) K-major; B: K-major [n][k] or MN-major [k][n]; both 128-byte swizzled.
__global__ void probe(const u16* a, const u16* b, float* d, int mn_major, u32 lbo, u32 sbo,
                      u32 kstep_b) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sa = smem;
  unsigned char* sb = smem + 64 * 128;
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
    const int m = i / 64, k = i % 64;
    *reinterpret_cast<u16*>(sa + wgmma::swizzled_offset(m, k)) = a[i];
  }
  for (int i = threadIdx.x; i < NN * 64; i += blockDim.x) {
    const int n = i / 64, k = i % 64;  // b is given as [n][k]
    u32 off = mn_major ? (n / 64) * 8192 + wgmma::swizzled_offset(k, n % 64)
                       : wgmma::swizzled_offset(n, k);
    *reinterpret_cast<u16*>(sb + off) = b[i];
  }
  wgmma::fence_shared_for_async();
  __syncthreads();
  float acc[NN / 2];
  for (int i = 0; i < NN / 2; ++i) acc[i] = 0.f;
  const u32 a0 = mma::smem_addr(sa), b0 = mma::smem_addr(sb);
  wgmma::fence();
  for (int j = 0; j < 4; ++j) {
    const u64 da = wgmma::descriptor(a0 + 32 * j, 16, 1024);
    const u64 db = mn_major ? wgmma::descriptor(b0 + kstep_b * j, lbo, sbo)
                            : wgmma::descriptor(b0 + 32 * j, 16, 1024);
    wgmma::mma_64xN(acc, da, db);
  }
  wgmma::commit();
  wgmma::wait<0>();
  store_accumulators<NN>(acc, d);
}
int main() {
  const int nn = NN;
  u16 *a, *b; float* d;
  cudaMallocManaged(&a, 64 * 64 * 2); cudaMallocManaged(&b, nn * 64 * 2);
  cudaMallocManaged(&d, 64 * nn * 4);
  float *fa = (float*)malloc(64 * 64 * 4), *fb = (float*)malloc(nn * 64 * 4);
  srand(1);
  random_halves(a, fa, 64 * 64);
  random_halves(b, fb, nn * 64);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
  struct { const char* name; int mn; unsigned lbo, sbo, kstep; } variants[] = {
    {"K-major B", 0, 16, 1024, 32},
    {"MN-major B, LBO=n-block SBO=1024", 1, 8192, 1024, 2048},
    {"MN-major B, LBO=1024 SBO=n-block", 1, 1024, 8192, 2048},
  };
  for (auto& v : variants) {
    cudaMemset(d, 0, 64 * nn * 4);
    probe<<<1, 128, 96 * 1024>>>(a, b, d, v.mn, v.lbo, v.sbo, v.kstep);
    cudaError_t e = cudaDeviceSynchronize();
    double worst = 0;
    for (int m = 0; m < 64; ++m) for (int n = 0; n < nn; ++n) {
      double ref = 0; for (int k = 0; k < 64; ++k) ref += fa[m * 64 + k] * fb[n * 64 + k];
      worst = fmax(worst, fabs(ref - d[m * nn + n]));
    }
    printf("N=%d %-36s %s max|err| = %g\n", nn, v.name, e ? cudaGetErrorString(e) : "ok", worst);
  }
  return 0;
}
"""


def main() -> int:
    ext = extension()
    status = 0
    for n in (64, 128, 256):
        for mn_major in (False, True):
            src = PROBE.replace("__N__", str(n)).replace(
                "__WGMMA__", ext.wgmma_function(n, 1, mn_major))
            if not mn_major:  # only the K-major variant is meaningful with this wrapper
                src = src.replace('{"MN-major B, LBO=n-block SBO=1024", 1, 8192, 1024, 2048},', "")
                src = src.replace('{"MN-major B, LBO=1024 SBO=n-block", 1, 1024, 8192, 2048},', "")
            else:
                src = src.replace('{"K-major B", 0, 16, 1024, 32},', "")
            status |= build_and_run(src)
    return status


if __name__ == "__main__":
    sys.exit(main())
