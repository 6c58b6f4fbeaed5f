// The FFI handler symbols the extension exports: for the fused chain the CPU handler, and for
// the GPU platforms an instantiate-stage handler (parse the plan once per executable), an
// initialize-stage handler (compile and load the kernel) and an execute-stage handler; the
// same two GPU stages for the batched conversion; and the stopwatch used to time candidate
// solvers.
#pragma once

#include "xla/ffi/api/c_api.h"

// The FFI headers of jax >= 0.11 have the record stage (command-buffer nodes recorded by the
// handler); the extension then exports a record handler for CUDA.
#if __has_include("xla/ffi/api/record_api.h")
#define JAXFUSE_FFI_RECORD 1
#endif

namespace jaxfuse {

extern "C" XLA_FFI_Error* kFusedChainCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainGpuInstantiate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainCuda(XLA_FFI_CallFrame* call_frame);
#ifdef JAXFUSE_FFI_RECORD
extern "C" XLA_FFI_Error* kFusedChainCudaRecord(XLA_FFI_CallFrame* call_frame);
#endif
extern "C" XLA_FFI_Error* kFusedChainRocmInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kFusedChainRocm(XLA_FFI_CallFrame* call_frame);
// The batched float conversion ("jaxfuse_convert_many"); on the CPU it lowers to XLA's converts.
extern "C" XLA_FFI_Error* kConvertManyCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kConvertManyCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kConvertManyRocmInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* kConvertManyRocm(XLA_FFI_CallFrame* call_frame);
// The device stopwatch's mark (CUDA and ROCM alike: the platform is the stopwatch's).
extern "C" XLA_FFI_Error* kStopwatchGpu(XLA_FFI_CallFrame* call_frame);

#ifdef JAXFUSE_FFI_RECORD
// Registering the CUDA bundle with its record stage (ffi/record_registration.cc): the probe
// target's raw handler, and the registration under `name` through the API the probe received.
extern "C" XLA_FFI_Error* kFfiApiProbeCuda(XLA_FFI_CallFrame* call_frame);
enum class RecordRegistration { kDone, kNoApiYet, kRefused };
// `*why` says why not, unless kDone.
RecordRegistration RegisterCudaRecordBundle(const char* name, const char** why);
#endif

// The GPU handlers' per-call state type (see ffi/plan_state.h): the type id it is registered
// under with XLA (jax.ffi.register_ffi_type), and how XLA deletes one.
XLA_FFI_TypeId* GpuPlanStateTypeId();
const XLA_FFI_TypeInfo* GpuPlanStateTypeInfo();

}  // namespace jaxfuse
