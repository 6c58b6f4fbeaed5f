"""Whether wgmma reads a K-major B operand whose rows start anywhere inside a 128-byte-swizzled
box: the question behind a convolution tile that loads its input window (halo included) once
and forms each filter tap's operand as a shifted view of it, instead of one im2col copy per tap.

The box is written as the copy engine writes a 128-byte-swizzled box at a 1024-byte-aligned
address (row R at R * 128 bytes, its 16-byte chunk c at chunk c ^ (R % 8)). Operand row n is
box row `shift + n % 8 + (n / 8) * group` (8-row groups `group` rows apart: the descriptor's
stride byte offset is group * 128), so a view that starts `shift` rows in, with groups whose
pitch is not a multiple of 8 rows. Each (group, shift) is tried with the descriptor's base
offset 0 and with (start address >> 7) & 7, against a CPU reference.

    python scripts/halo_probe.py      # needs nvcc and an sm_90 GPU
"""

import sys

from nvcc_probe import PRELUDE, build_and_run

from jaxfuse._extension import extension

PROBE = PRELUDE + r"""
constexpr int NN = __N__;
constexpr int kBoxRows = 34 * (NN / 8) + 16;
__global__ void probe(const u16* a, const u16* box, float* d, int shift, int group,
                      int base_offset_mode) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sa = smem;
  unsigned char* sb = smem + 64 * 128;  // 1024-byte aligned
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
    *reinterpret_cast<u16*>(sa + wgmma::swizzled_offset(i / 64, i % 64)) = a[i];
  }
  for (int i = threadIdx.x; i < kBoxRows * 64; i += blockDim.x) {
    *reinterpret_cast<u16*>(sb + wgmma::swizzled_offset(i / 64, i % 64)) = box[i];
  }
  wgmma::fence_shared_for_async();
  __syncthreads();
  float acc[NN / 2];
  for (int i = 0; i < NN / 2; ++i) acc[i] = 0.f;
  const u32 a0 = mma::smem_addr(sa), b0 = mma::smem_addr(sb) + 128u * shift;
  wgmma::fence();
  for (int j = 0; j < 4; ++j) {
    const u64 da = wgmma::descriptor(a0 + 32 * j, 16, 1024);
    u64 db = wgmma::descriptor(b0 + 32 * j, 16, 128u * group);
    if (base_offset_mode) db |= u64(((b0 + 32 * j) >> 7) & 7u) << 49;
    wgmma::mma_64xN(acc, da, db);
  }
  wgmma::commit();
  wgmma::wait<0>();
  store_accumulators<NN>(acc, d);
}
int main() {
  u16 *a, *box; float* d;
  cudaMallocManaged(&a, 64 * 64 * 2); cudaMallocManaged(&box, kBoxRows * 64 * 2);
  cudaMallocManaged(&d, 64 * NN * 4);
  float *fa = (float*)malloc(64 * 64 * 4), *fb = (float*)malloc(kBoxRows * 64 * 4);
  srand(1);
  random_halves(a, fa, 64 * 64);
  random_halves(box, fb, kBoxRows * 64);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  const int groups[] = {8, 10, 16, 34};
  const int shifts[] = {0, 1, 2, 3, 7, 10, 11};
  for (int group : groups) for (int shift : shifts) for (int mode = 0; mode < 2; ++mode) {
    if (shift + 7 + (NN / 8 - 1) * group >= kBoxRows) continue;
    cudaMemset(d, 0, 64 * NN * 4);
    probe<<<1, 128, 200 * 1024>>>(a, box, d, shift, group, mode);
    cudaError_t e = cudaDeviceSynchronize();
    double worst = 0;
    for (int m = 0; m < 64; ++m) for (int n = 0; n < NN; ++n) {
      const int r = shift + n % 8 + (n / 8) * group;
      double ref = 0; for (int k = 0; k < 64; ++k) ref += fa[m * 64 + k] * fb[r * 64 + k];
      worst = fmax(worst, fabs(ref - d[m * NN + n]));
    }
    printf("N=%3d group %2d rows, shift %2d, base offset %s: %s max|err| = %g\n", NN, group,
           shift, mode ? "(addr>>7)&7" : "0          ", e ? cudaGetErrorString(e) : "ok", worst);
  }
  return 0;
}
"""


def main() -> int:
    ext = extension()
    status = 0
    for n in (64, 256):
        src = PROBE.replace("__N__", str(n)).replace("__WGMMA__", ext.wgmma_function(n, 1, False))
        status |= build_and_run(src)
    return status


if __name__ == "__main__":
    sys.exit(main())
