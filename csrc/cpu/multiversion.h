// Compiling hot loops for several x86 levels, picked at load time, so that one portable build
// uses AVX-512 or AVX2+FMA where the machine has them.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Loops that the compiler vectorizes on its own: one clone per level, chosen by an ifunc.
#define JF_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JF_MULTIVERSION
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Code written for one vector width (the convolution's register tiles) is compiled for that
// level explicitly and picked by CpuLevel().
#define JF_HAVE_X86_LEVELS 1
#define JF_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2")))
#define JF_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2")))
#endif

#define JF_ALWAYS_INLINE inline __attribute__((always_inline))

namespace jaxfuse::cpu {

enum class CpuLevel { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The best level this machine (and OS) supports, capped by $JAXFUSE_CPU_ISA ("portable",
// "avx2", "avx512"), which lets tests run the narrower code paths on any machine.
CpuLevel DetectCpuLevel();

}  // namespace jaxfuse::cpu
