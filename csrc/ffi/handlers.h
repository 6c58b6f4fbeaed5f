// The FFI handler symbols the extension exports: the CPU handler, and per GPU platform an
// initialize-stage handler (compile and load the kernel) and an execute-stage handler.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxfuse {

extern "C" XLA_FFI_Error* kFusedChainCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainRocmInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainRocm(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxfuse
