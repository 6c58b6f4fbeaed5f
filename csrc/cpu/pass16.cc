#include "cpu/pass16.h"

#include "cpu/multiversion.h"

namespace jaxfuse::cpu {
namespace {

using Entry = bool (*)(const Block&, const FastArgs&, DType, bool, bool, int);

// The widest entry this machine runs ($JAXFUSE_CPU_ISA caps it, as for the convolution), or
// none: the portable loops then serve every block.
Entry PickEntry() {
#ifdef JF_HAVE_X86_LEVELS
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) return nullptr;
  switch (DetectCpuLevel()) {
    case CpuLevel::kAvx512: return Pass16Avx512;
    case CpuLevel::kAvx2: return Pass16Avx2;
    default: return nullptr;
  }
#else
  return nullptr;
#endif
}

}  // namespace

bool Pass16(const Block& block, const FastArgs& args, DType dtype, bool from_input, bool side,
            int act) {
  static const Entry entry = PickEntry();
  return entry != nullptr && entry(block, args, dtype, from_input, side, act);
}

}  // namespace jaxfuse::cpu
