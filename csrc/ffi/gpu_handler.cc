// XLA FFI handlers for platforms "CUDA" and "ROCM". The instantiate stage (once per
// executable) parses and checks the plan; the initialize stage (before each execution, outside
// any CUDA-graph capture) compiles and loads the plan's kernel for the device the first time,
// through the plan's state; the execute stage checks the buffers and launches on XLA's
// stream, with nothing looked up by string and nothing allocated. Where the FFI headers have
// the record stage (jax >= 0.11), CUDA also gets a bundle with one and without the
// initialize stage (record_registration.cc): XLA then adds the kernel to its command buffer as
// a node of its own, loaded by the record stage, and when buffers move between calls updates
// that node's parameters instead of capturing the call again.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common/debug.h"
#include "ffi/handlers.h"
#include "ffi/operands.h"
#include "ffi/plan_state.h"
#include "gpu/backend.h"
#include "xla/ffi/api/ffi.h"
#ifdef JAXFUSE_FFI_RECORD
#include "xla/ffi/api/record_api.h"
#endif

namespace jaxfuse {
namespace ffi = xla::ffi;

struct GpuPlanState : PlanState {
  using PlanState::PlanState;
  static ffi::TypeId id;  // assigned by the GPU plugin's XLA runtime at registration

  // The plan's kernel on device `ordinal` if this state has it already (one atomic load).
  const gpu::LoadedKernel* Loaded(int ordinal) const {
    return ordinal >= 0 && ordinal < static_cast<int>(slots.size())
               ? slots[ordinal].load(std::memory_order_acquire)
               : nullptr;
  }

  // The plan's kernel on device `ordinal`, compiled or loaded the first time.
  const gpu::LoadedKernel& Kernel(gpu::Platform platform, int ordinal) {
    if (const gpu::LoadedKernel* k = Loaded(ordinal)) return *k;
    const bool slotted = ordinal >= 0 && ordinal < static_cast<int>(slots.size());
    // Normally a hit in the backend's cache (the plan was compiled from Python when it was
    // lowered); that cache keeps every loaded kernel for the process's lifetime, `owned` only
    // what the slots point at.
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
  // Per device, the entry point the record stage created its command with, as its index + 1
  // (0: none yet): an update can change a node's parameters, not its kernel.
  std::array<std::atomic<int>, 64> recorded_entries{};
  std::mutex mu;
  std::vector<std::shared_ptr<const gpu::LoadedKernel>> owned;  // keeps the slots' kernels
};
ffi::TypeId GpuPlanState::id = {};

namespace {

ffi::ErrorOr<std::unique_ptr<GpuPlanState>> Instantiate(ffi::Dictionary attrs) {
  return InstantiatePlan<GpuPlanState>(attrs);
}

// Runs before every execution (XLA calls the stage each time; bundles without the record
// stage only: ROCm's and the plain-named CUDA target's): after the first on a device, one
// atomic load. It used to read the plan attribute and look the plan and its kernel up by
// the attribute's text, per chain per call (a batch-1 ResNet-50 spent 86 us a call in XLA's
// Thunks::Initialize, H100, 2026-11-26).
template <gpu::Platform kPlatform>
ffi::Error Initialize(int32_t device_ordinal, GpuPlanState* state, ffi::Dictionary,
                      ffi::RemainingArgs, ffi::RemainingRets) {
  try {
    state->Kernel(kPlatform, device_ordinal);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

// The kernel for an execution on `stream`: this state's, the backend's already loaded one
// (the plan was compiled when it was lowered), or one compiled and loaded now, which a
// stream being captured into a graph does not allow (the CUDA bundle with the record stage
// has no initialize stage to do it beforehand).
template <gpu::Platform kPlatform>
const gpu::LoadedKernel& KernelFor(GpuPlanState* state, int32_t device_ordinal, void* stream) {
  if (const gpu::LoadedKernel* k = state->Loaded(device_ordinal)) return *k;
  if (gpu::FindLoadedKernel(kPlatform, *state->spec, device_ordinal) == nullptr &&
      gpu::Driver::Get(kPlatform).Capturing(device_ordinal, stream)) {
    throw std::runtime_error(
        "jaxfuse: the plan's kernel is not compiled for device " +
        std::to_string(device_ordinal) +
        ", and XLA is capturing this call into a CUDA graph, where it cannot be compiled; run "
        "the program once outside a graph capture first");
  }
  return state->Kernel(kPlatform, device_ordinal);  // (found: a lookup, no driver call)
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
    const gpu::LoadedKernel& kernel = KernelFor<kPlatform>(state, device_ordinal, stream);
    gpu::Launch(kPlatform, spec, kernel, stream, BindParams(spec, decoded));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

#ifdef JAXFUSE_FFI_RECORD
using RecordContext = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
struct RecordExtension : ffi::internal::RecordExtensionBase<RecordContext> {};

// Whether the kernel's node may start before the previous kernel ends (programmatic dependent
// launch): every kernel waits for that one first where it can (sm_90 and later: portable.h,
// await_previous_kernel), so XLA may make the node's edges from kernel nodes programmatic.
// jax 0.11.2 does on this flag alone; later XLA also wants the call's 'uses_pdl' attribute,
// which the lowering adds (jaxfuse/primitive.py). JAXFUSE_PDL=0 turns it off.
bool UsesPdl(const gpu::LoadedKernel& kernel) {
  static const bool enabled = [] {
    const char* v = std::getenv("JAXFUSE_PDL");
    return v == nullptr || std::string_view(v) != "0";
  }();
  // (The architecture the kernel was compiled for, where the wait is compiled in or out.)
  const std::string& arch =
      kernel.generated.compile_arch.empty() ? kernel.arch : kernel.generated.compile_arch;
  return enabled && arch.rfind("sm_", 0) == 0 && std::atoi(arch.c_str() + 3) >= 90;
}

// The record stage: the kernel as a launch command of XLA's command buffer, created once and
// updated with the call's buffers. Plans that launch nothing or more than the kernel (empty
// outputs, JAXFUSE_POISON_OUTPUTS) are captured from the execute stage as before.
template <gpu::Platform kPlatform>
ffi::Error Record(RecordContext record, int32_t device_ordinal, GpuPlanState* state,
                  ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out) {
  const auto start = std::chrono::steady_clock::now();  // (an update's host time, for stats)
  try {
    const PlanSpec& spec = *state->spec;
    // Loaded here, outside any capture: the bundle has no initialize stage, and a launch XLA
    // captures from the execute stage must find its kernel loaded.
    const gpu::LoadedKernel& kernel = state->Kernel(kPlatform, device_ordinal);
    if (spec.output_elements() == 0 || PoisonOutputs()) return record.RequestStreamCapture();
    DecodedOperands decoded;
    if (ffi::Error err = DecodeOperands(spec, state->operands, args, out, &decoded);
        err.failure()) {
      return err;
    }
    const FusedParams params = BindParams(spec, decoded);
    std::atomic<int>& recorded = state->recorded_entries.at(device_ordinal);
    const bool create = record.action() == ffi::RecordAction::kCreate;
    // An update keeps the recorded entry point wherever it still runs on the new buffers (their
    // alignment can only have to allow it): the node's kernel cannot change.
    size_t entry_index = gpu::EntryFor(kernel, params);
    if (!create) {
      const int was = recorded.load() - 1;
      if (was < 0 || !gpu::EntryApplies(kernel, static_cast<size_t>(was), params)) {
        return ffi::Error(ffi::ErrorCode::kInternal,
                          "jaxfuse: the buffers are less aligned than when the launch was "
                          "recorded");
      }
      entry_index = static_cast<size_t>(was);
    }
    const gpu::EntryPoint& entry = kernel.generated.entries[entry_index];
    TmaParams tma;
    size_t bytes = 0;
    const void* block = gpu::Driver::Get(kPlatform).ParamBlock(entry, params, &tma, &bytes);
    const std::array<ffi::KernelArg, 1> kernel_args{ffi::HostValue{block, bytes}};
    if (create) {
      const XLA_FFI_LaunchDims dims{{static_cast<int32_t>(entry.grid), 1, 1},
                                    {static_cast<int32_t>(entry.block), 1, 1},
                                    {0, 0, 0}};  // (cluster shapes are compiled in)
      auto command = record.CreateLaunch(entry.name.c_str(), kernel.binary.data(),
                                         kernel.binary.size(), ffi::SourceFormat::kCubin, dims,
                                         entry.shared_bytes, UsesPdl(kernel), kernel_args);
      if (command.has_error()) return command.error();
      recorded.store(static_cast<int>(entry_index) + 1);
      gpu::CountRecord(false);
      return ffi::Error::Success();
    }
    const auto commands = record.commands();
    if (commands.size() != 1) {
      return ffi::Error(ffi::ErrorCode::kInternal, "jaxfuse: expected one recorded launch");
    }
    gpu::CountRecord(true);
    ffi::Error updated = record.UpdateLaunch(commands[0], kernel_args);
    gpu::CountRecordUpdateTime(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - start).count());
    return updated;
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

auto RecordBinding() {
  return ffi::Ffi::BindRecord()
      .Ctx<ffi::Extension<RecordExtension>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<GpuPlanState>>()
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>();
}
#endif

auto InitializeBinding() {
  // (The instantiate stage's state reaches this stage too; the attributes and buffers are
  // bound only because the call frame carries them.)
  return ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<GpuPlanState>>()
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
#ifdef JAXFUSE_FFI_RECORD
XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCudaRecord, Record<gpu::Platform::kCuda>,
                              RecordBinding());
#endif
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
