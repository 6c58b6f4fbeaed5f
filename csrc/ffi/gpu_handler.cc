// XLA FFI handlers for platforms "CUDA" and "ROCM". The instantiate stage (once per
// executable) parses and checks the plan; the initialize stage (before each execution, outside
// any CUDA-graph capture) compiles and loads the plan's kernel for the device; the execute
// stage checks the buffers and launches on XLA's stream, with nothing looked up by string and
// nothing allocated.
#include <array>
#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "ffi/handlers.h"
#include "ffi/operands.h"
#include "ffi/plan_state.h"
#include "gpu/backend.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

struct GpuPlanState : PlanState {
  using PlanState::PlanState;
  static ffi::TypeId id;  // assigned by the GPU plugin's XLA runtime at registration

  // The plan's kernel on device `ordinal`: after the first call on a device, one atomic load.
  const gpu::LoadedKernel& Kernel(gpu::Platform platform, int ordinal) {
    const bool slotted = ordinal >= 0 && ordinal < static_cast<int>(slots.size());
    if (slotted) {
      if (const gpu::LoadedKernel* k = slots[ordinal].load(std::memory_order_acquire)) return *k;
    }
    // Normally a hit (the initialize stage loaded it); the backend's cache keeps every loaded
    // kernel for the process's lifetime, `owned` only what the slots point at.
    auto kernel = gpu::GetKernel(platform, *spec, ordinal);
    if (!slotted) return *kernel;
    std::lock_guard<std::mutex> lock(mu);
    if (slots[ordinal].load(std::memory_order_relaxed) == nullptr) {
      owned.push_back(kernel);
      slots[ordinal].store(kernel.get(), std::memory_order_release);
    }
    return *slots[ordinal].load(std::memory_order_relaxed);
  }

  std::array<std::atomic<const gpu::LoadedKernel*>, 64> slots{};
  std::mutex mu;
  std::vector<std::shared_ptr<const gpu::LoadedKernel>> owned;  // keeps the slots' kernels
};
ffi::TypeId GpuPlanState::id = {};

namespace {

ffi::ErrorOr<std::unique_ptr<GpuPlanState>> Instantiate(ffi::Dictionary attrs) {
  return InstantiatePlan<GpuPlanState>(attrs);
}

template <gpu::Platform kPlatform>
ffi::Error Initialize(int32_t device_ordinal, ffi::Dictionary attrs, ffi::RemainingArgs,
                      ffi::RemainingRets) {
  try {
    std::shared_ptr<const PlanSpec> spec;
    if (ffi::Error err = ParsePlan(attrs, &spec); err.failure()) return err;
    gpu::GetKernel(kPlatform, *spec, device_ordinal);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

template <gpu::Platform kPlatform>
ffi::Error Execute(void* stream, int32_t device_ordinal, GpuPlanState* state,
                   ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out) {
  try {
    const PlanSpec& spec = *state->spec;
    DecodedOperands decoded;
    if (ffi::Error err = DecodeOperands(spec, state->operands, args, out, &decoded);
        err.failure()) {
      return err;
    }
    const gpu::LoadedKernel& kernel = state->Kernel(kPlatform, device_ordinal);
    gpu::Launch(kPlatform, spec, kernel, stream, BindParams(spec, decoded));
    return ffi::Error::Success();
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

auto InstantiateBinding() {
  // Newer runtimes pass the call's buffers (placeholders) to this stage too: not bound here.
  return ffi::Ffi::BindInstantiate().Attrs();
}

auto ExecuteBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<void*>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<GpuPlanState>>()
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>();
}

// Kernels only enqueue work on the given stream, so XLA may record them into command
// buffers (CUDA graphs).
constexpr auto kTraits = ffi::Traits::kCmdBufferCompatible;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainGpuInstantiate, Instantiate, InstantiateBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCudaInitialize, Initialize<gpu::Platform::kCuda>,
                              InitializeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCuda, Execute<gpu::Platform::kCuda>, ExecuteBinding(),
                              {kTraits});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainRocmInitialize, Initialize<gpu::Platform::kRocm>,
                              InitializeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainRocm, Execute<gpu::Platform::kRocm>, ExecuteBinding(),
                              {kTraits});

XLA_FFI_TypeId* GpuPlanStateTypeId() { return &GpuPlanState::id; }
const XLA_FFI_TypeInfo* GpuPlanStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<GpuPlanState>();
  return &info;
}

}  // namespace jaxfuse
