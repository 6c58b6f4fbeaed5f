// Portability layer for the runtime-compiled GPU kernels: one source for CUDA (NVRTC) and HIP
// (hiprtc). Everything that differs between the two lives here: integer types (runtime
// compilers ship no standard headers), warp size, 16-bit float conversions and the vector
// load types. Kernels include only this, params.h, epilogue.h and their own file.
#pragma once

#if defined(__HIPCC_RTC__) || defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define JF_HIP 1
#endif

#define JF_DEVICE __device__ __forceinline__
#define JF_RESTRICT __restrict__

namespace jaxfuse {

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#ifdef JF_HIP
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 32;
#endif

// 16 bytes, the widest single load or store a thread issues.
struct alignas(16) Vec16 {
  u32 v[4];
};

JF_DEVICE float bits_to_float(u32 u) { return __uint_as_float(u); }
JF_DEVICE u32 float_to_bits(float f) { return __float_as_uint(f); }
JF_DEVICE u32 float_to_bits(u16 h) { return h; }  // (never called: keeps generic code valid)
// One 16-byte store of `v` to global memory at `dst` (16-byte aligned), as one instruction: a
// struct copy was split into four 4-byte stores in the warp-specialized kernel (conv_tma.cuh).
JF_DEVICE void store16(void* dst, const Vec16& v) {
#ifdef JF_HIP
  *reinterpret_cast<Vec16*>(dst) = v;
#else
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.v[0]), "r"(v.v[1]),
               "r"(v.v[2]), "r"(v.v[3])
               : "memory");
#endif
}

// One 16-byte load from global memory at `src` (16-byte aligned) that the kernel never writes,
// as one instruction.
JF_DEVICE Vec16 load16(const void* src) {
#ifdef JF_HIP
  return *reinterpret_cast<const Vec16*>(src);
#else
  Vec16 v;
  // (volatile: kept after griddepcontrol.wait, whose "memory" clobber orders only accesses the
  // compiler sees as memory: await_previous_kernel.)
  asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.v[0]), "=r"(v.v[1]), "=r"(v.v[2]), "=r"(v.v[3])
               : "l"(src));
  return v;
#endif
}

// Makes `v` (a loaded value) arrive here: NVCC sinks a load to its first use, past a barrier
// that would otherwise have hidden its latency. (On HIP, nothing.)
JF_DEVICE void arrive_here(float& v) {
#ifndef JF_HIP
  asm volatile("" : "+f"(v));
#else
  (void)v;
#endif
}

// Programmatic dependent launch (sm_90): XLA's command buffer may start a kernel before the
// previous kernel ends (the record stage asks it to: csrc/ffi/gpu_handler.cc), so the launch and
// the CTAs' start overlap that kernel's last wave. Every kernel calls this before its first
// global load or store (the runtime scalars' included): it waits for the previous kernel to end
// with its memory visible, then lets the next kernel launch once this one's CTAs have all
// started. Work before it, arithmetic and shared memory only, overlaps the previous kernel:
// conv_wgmma does its index set-up and split-K barrier there, conv_tma its pipeline's
// barriers (a kernel's cold start, constant- and instruction-cache misses included, was 17-49%
// of the stall samples of batch-1 split-K layers: Nsight Compute, H100). (The compiler may
// still hoist the wait above pure arithmetic: it did in conv_igemm.) Without such a launch,
// nothing.
JF_DEVICE void await_previous_kernel() {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kN floats from `src` (16-byte aligned; kN a multiple of 4) in 16-byte loads.
template <int kN>
JF_DEVICE void load_floats(const float* src, float (&dst)[kN]) {
#pragma unroll
  for (int q = 0; q < kN / 4; ++q) {
    const Vec16 v = load16(src + 4 * q);
#pragma unroll
    for (int r = 0; r < 4; ++r) dst[4 * q + r] = bits_to_float(v.v[r]);
  }
}

// Two 16-bit values as one 32-bit word, `lo` at the lower address.
JF_DEVICE u32 pack_halves(u16 lo, u16 hi) { return u32(lo) | (u32(hi) << 16); }
JF_DEVICE u32 pack_halves(float, float) { return 0; }  // (never called: generic code)

// bfloat16 <-> float32, round to nearest even (NaN kept quiet).
JF_DEVICE float bf16_to_float(u16 h) { return bits_to_float(u32(h) << 16); }
JF_DEVICE u16 float_to_bf16(float f) {
#if !defined(JF_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  u32 u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return u16((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u16(u >> 16);
#endif
}

// float16 <-> float32 through the hardware conversion instructions.
JF_DEVICE float half_to_float(u16 h) {
#ifdef JF_HIP
  return float(__builtin_bit_cast(_Float16, h));
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
JF_DEVICE u16 float_to_half(float f) {
#ifdef JF_HIP
  return __builtin_bit_cast(u16, _Float16(f));
#else
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

// Storage type and conversions for each plan dtype (0 = f32, 1 = f16, 2 = bf16; the numbering
// of jaxfuse::DType on the host).
template <int Code>
struct Storage;
template <>
struct Storage<0> {
  typedef float type;
  static JF_DEVICE float load(float v) { return v; }
  static JF_DEVICE float store(float v) { return v; }
};
template <>
struct Storage<1> {
  typedef u16 type;
  static JF_DEVICE float load(u16 v) { return half_to_float(v); }
  static JF_DEVICE u16 store(float v) { return float_to_half(v); }
};
template <>
struct Storage<2> {
  typedef u16 type;
  static JF_DEVICE float load(u16 v) { return bf16_to_float(v); }
  static JF_DEVICE u16 store(float v) { return float_to_bf16(v); }
};

JF_DEVICE i64 global_thread_index() { return i64(blockIdx.x) * blockDim.x + threadIdx.x; }
JF_DEVICE i64 global_thread_count() { return i64(gridDim.x) * blockDim.x; }

}  // namespace jaxfuse
