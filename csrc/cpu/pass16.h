// The single-pass chain on float16 and bfloat16 tensors with their conversions in vector
// registers: each vector of 16-bit values is widened, scaled, shifted, activated, rounded and
// stored in one step (the portable loops convert through float32 buffers, 2-3x slower on a
// 2-core Sapphire Rapids VM, where XLA's own fp16 loop was faster than them).
#pragma once

#include "common/plan_spec.h"
#include "cpu/epilogue_cpu.h"

namespace jaxfuse::cpu {

// Applies the single-pass chain (`side`, activation `act`: one of the fast modes) to the block
// for a 16-bit `dtype`, reading the input tensor when `from_input` and the block's float32
// values otherwise, and returns true; or returns false, doing nothing, where this machine has
// no such vectors (AVX-512, or AVX2 with F16C) or the block is one the portable loops serve
// better (NHWC rows narrower than a vector).
bool Pass16(const Block& block, const FastArgs& args, DType dtype, bool from_input, bool side,
            int act);

// The entries compiled for each instruction set (pass16_avx512.cc, pass16_avx2.cc).
bool Pass16Avx512(const Block& block, const FastArgs& args, DType dtype, bool from_input,
                  bool side, int act);
bool Pass16Avx2(const Block& block, const FastArgs& args, DType dtype, bool from_input,
                bool side, int act);

}  // namespace jaxfuse::cpu
