// The 16-bit single pass for AVX2 with F16C (8 lanes); compiled with -mavx2 -mf16c -mfma where
// the build targets x86-64 (CMakeLists.txt), called only on machines that have them.
#include "cpu/pass16.h"

#if defined(__AVX2__) && defined(__F16C__)
#include "cpu/pass16_impl.h"
#endif

namespace jaxfuse::cpu {

bool Pass16Avx2(const Block& block, const FastArgs& args, DType dtype, bool from_input, bool side,
                int act) {
#if defined(__AVX2__) && defined(__F16C__)
  return Pass16Lanes<8>(block, args, dtype, from_input, side, act);
#else
  return false;
#endif
}

}  // namespace jaxfuse::cpu
