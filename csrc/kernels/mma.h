// The matrix instructions behind a small tile abstraction, for the implicit-GEMM kernels:
// asynchronous 16-byte global->shared copies, shared->register fragment loads, and the warp-level
// 16x8x16 (fp16/bf16) and 16x8x8 (TF32) multiply-accumulates with fp32 accumulators.
//
// CUDA (sm_80+): cp.async, ldmatrix and mma.sync. HIP would map these onto MFMA and plain
// loads; that mapping is not written yet, so the code generator never offers the implicit-GEMM
// solver on ROCm (the direct kernel serves every plan there).
#pragma once

#ifndef JF_HIP

namespace jaxfuse {
namespace mma {

// A generic pointer to shared memory as the 32-bit address the instructions take.
JF_DEVICE u32 smem_addr(const void* p) {
  u32 addr;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(p));
  return addr;
}

// Copies 16 bytes global -> shared without passing through registers; zero-fills the 16
// bytes instead when `valid` is false (convolution padding, tile edges).
JF_DEVICE void copy16_async(u32 dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// The same for 4 bytes (through L1: the 16-byte-only .cg form does not take them).
JF_DEVICE void copy4_async(u32 dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// Stores 16 bytes from registers at a (16-byte aligned) shared-memory address.
JF_DEVICE void store16_shared(u32 dst, const Vec16& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.v[0]), "r"(v.v[1]),
               "r"(v.v[2]), "r"(v.v[3])
               : "memory");
}
// Loads 16 bytes from a (16-byte aligned) shared-memory address.
JF_DEVICE float4 load16_shared(u32 src) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(src)
               : "memory");
  return v;
}
JF_DEVICE void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `Pending` committed groups of copies are still in flight.
template <int Pending>
JF_DEVICE void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8. Lane l receives, from each matrix, row l / 4, elements 2 (l % 4) and +1
// (`Transposed`: column l / 4, rows 2 (l % 4) and +1).
template <bool Transposed>
JF_DEVICE void load_matrices(u32 (&r)[4], u32 addr) {
  if (Transposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}

// d += a (16x16, row-major fragment) * b (16x8, column fragment); Dtype 1 = fp16, 2 = bf16.
template <int Dtype>
JF_DEVICE void mma_16x8x16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  if (Dtype == 2) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// An fp32 value rounded to TF32 (10 mantissa bits, to nearest, ties away), as the tf32
// multiply takes it.
JF_DEVICE u32 to_tf32(float v) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
}

// d += a (16x8 TF32, row-major fragment) * b (8x8 TF32, column fragment).
JF_DEVICE void mma_16x8x8_tf32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace mma
}  // namespace jaxfuse

#endif  // JF_HIP
