// XLA FFI handlers for platforms "CUDA" and "ROCM". The initialize stage (run before
// execution, outside any CUDA-graph capture) compiles and loads the plan's kernel for the
// device; the execute stage decodes and checks the operands and launches on XLA's stream.
#include <exception>
#include <memory>
#include <stdexcept>

#include "ffi/handlers.h"
#include "ffi/operands.h"
#include "ffi/plan_registry.h"
#include "gpu/backend.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

namespace {

template <gpu::Platform kPlatform>
ffi::Error Initialize(int32_t device_ordinal, ffi::Dictionary attrs, ffi::RemainingArgs,
                      ffi::RemainingRets) {
  try {
    std::string_view plan;
    if (ffi::Error err = PlanAttribute(attrs, &plan); err.failure()) return err;
    gpu::GetKernel(kPlatform, *LookupPlan(plan), device_ordinal);
    return ffi::Error::Success();
  } catch (const std::invalid_argument& e) {  // a malformed plan
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

template <gpu::Platform kPlatform>
ffi::Error Execute(void* stream, int32_t device_ordinal, ffi::Dictionary attrs,
                   ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out) {
  try {
    std::shared_ptr<const PlanSpec> spec;
    DecodedOperands decoded;
    if (ffi::Error err = DecodeCall(attrs, args, out, &spec, &decoded); err.failure()) return err;
    // Normally a hit: plan.compile() or the initialize stage loaded it already.
    auto kernel = gpu::GetKernel(kPlatform, *spec, device_ordinal);
    gpu::Launch(kPlatform, *spec, *kernel, stream, BindParams(*spec, decoded));
    return ffi::Error::Success();
  } catch (const std::invalid_argument& e) {  // a malformed plan
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

auto InitializeBinding() {
  return ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
      .Ctx<ffi::DeviceOrdinal>()
      .Attrs()
      .RemainingArgs()
      .RemainingRets();
}

auto ExecuteBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<void*>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Attrs()
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>();
}

// Kernels only enqueue work on the given stream, so XLA may record them into command
// buffers (CUDA graphs).
constexpr auto kTraits = ffi::Traits::kCmdBufferCompatible;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCudaInitialize, Initialize<gpu::Platform::kCuda>,
                              InitializeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCuda, Execute<gpu::Platform::kCuda>, ExecuteBinding(),
                              {kTraits});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainRocmInitialize, Initialize<gpu::Platform::kRocm>,
                              InitializeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainRocm, Execute<gpu::Platform::kRocm>, ExecuteBinding(),
                              {kTraits});

}  // namespace jaxfuse
