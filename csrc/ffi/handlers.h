// The FFI handler symbols the extension exports, one per platform family.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxfuse {

extern "C" XLA_FFI_Error* kFusedChainCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxfuse
