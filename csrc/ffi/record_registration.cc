// The fused chain's CUDA handler bundle with its record stage, registered with XLA's FFI API
// directly. jaxlib 0.11.2's Python registration reads four stages of a handler dict
// ("instantiate", "prepare", "initialize", "execute") and its CUDA plugin registers the fifth,
// "record", as null (jaxlib/gpu/gpu_plugin_extension.cc; the plugin's
// PJRT_Gpu_Register_Custom_Call), so XLA captured every fused call of a command buffer again
// whenever its buffers moved (MobileNetV2 at batch 1 on an H100: 487-722 us a call in
// command_buffer::update for 52 fused calls). With the record stage XLA adds the kernel as a
// node of its own and updates the node's parameters instead.
//
// The plugin's XLA_FFI_Api is not exported; XLA hands it to every handler it calls, including
// the metadata query it makes when a handler is registered. So a probe target, registered
// through Python like the others, keeps the API it sees, and the bundle is then registered
// through that API under a name of its own (the four-stage registration of the plain name
// stays, for exported programs and as the fallback).
#include "ffi/handlers.h"

#ifdef JAXFUSE_FFI_RECORD
#include <atomic>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;
namespace {

std::atomic<const XLA_FFI_Api*> cuda_api{nullptr};

// The probe's own work: none.
ffi::Error Nothing() { return ffi::Error::Success(); }

XLA_FFI_DEFINE_HANDLER(kProbeBody, Nothing, ffi::Ffi::Bind());

// Whether `api` has the bundle layout these headers have (the record stage came with 0.4).
bool Compatible(const XLA_FFI_Api* api) {
  return api->api_version.major_version == XLA_FFI_API_MAJOR &&
         api->api_version.minor_version >= XLA_FFI_API_MINOR &&
         api->struct_size >= XLA_FFI_Api_STRUCT_SIZE;
}

}  // namespace

extern "C" XLA_FFI_Error* kFfiApiProbeCuda(XLA_FFI_CallFrame* call_frame) {
  if (call_frame != nullptr && call_frame->api != nullptr) {
    const XLA_FFI_Api* expected = nullptr;
    cuda_api.compare_exchange_strong(expected, call_frame->api);
  }
  return kProbeBody(call_frame);
}

RecordRegistration RegisterCudaRecordBundle(const char* name, const char** why_not) {
  static thread_local std::string why;  // (read by the caller on this thread, at once)
  const XLA_FFI_Api* api = cuda_api.load();
  if (api == nullptr) {
    *why_not = "the CUDA plugin has not registered the probe target yet";
    return RecordRegistration::kNoApiYet;
  }
  if (!Compatible(api)) {
    why = "the CUDA plugin's FFI API is " + std::to_string(api->api_version.major_version) +
          "." + std::to_string(api->api_version.minor_version) + ", this build's " +
          std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
    *why_not = why.c_str();
    return RecordRegistration::kRefused;
  }
  XLA_FFI_Handler_Register_Args args{};
  args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
  args.name = {name, std::strlen(name)};
  args.platform = {"CUDA", 4};
  // No initialize stage: XLA calls it before every execution, building each call's frame
  // (about 1 us a fused call: 53-62 us a batch-1 ResNet-50 call under the profiler, H100,
  // 2026-11-27), and the record stage, which runs outside any capture, loads the kernel.
  args.bundle = {kFusedChainGpuInstantiate, nullptr, nullptr, kFusedChainCuda,
                 kFusedChainCudaRecord};
  args.traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
  XLA_FFI_Error* error = api->XLA_FFI_Handler_Register(&args);
  if (error == nullptr) return RecordRegistration::kDone;
  XLA_FFI_Error_GetDetails_Args details{};
  details.struct_size = XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE;
  details.error = error;
  api->XLA_FFI_Error_GetDetails(&details);
  why = details.message != nullptr ? details.message : "XLA refused the registration";
  XLA_FFI_Error_Destroy_Args destroy{};
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.error = error;
  api->XLA_FFI_Error_Destroy(&destroy);
  *why_not = why.c_str();
  return RecordRegistration::kRefused;
}

}  // namespace jaxfuse
#endif
