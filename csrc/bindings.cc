// The Python extension: FFI handler capsules for jax.ffi.register_ffi_target, plus the few
// host-side entry points plan.compile() and `python -m jaxfuse info` use.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <string>

#include "cpu/thread_pool.h"
#include "ffi/handlers.h"
#include "ffi/plan_registry.h"
#include "gpu/embedded_sources.h"

namespace nb = nanobind;

namespace {

nb::capsule HandlerCapsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jaxfuse_ext, m) {
  m.doc() = "jaxfuse's C++ core: XLA FFI handlers for fused conv/bias/batchnorm/activation.";

  m.def("ffi_handlers", [] {
    nb::dict handlers;
    handlers["cpu"] = HandlerCapsule(jaxfuse::kFusedChainCpu);
    return handlers;
  }, "FFI handler capsules by platform name.");

  m.def("cpu_prepare", [](std::string_view plan) {
    jaxfuse::LookupPlan(plan);  // parses and validates once; raises ValueError if malformed
    return std::string("cpu");
  }, nb::arg("plan"), "Validates a plan signature for the CPU backend.");

  m.def("gpu_prepare", [](std::string_view plan, int device) -> std::string {
    throw std::runtime_error("this build of jaxfuse has no GPU backend");
  }, nb::arg("plan"), nb::arg("device"));

  m.def("cpu_threads", &jaxfuse::cpu::NumThreads, "Threads the CPU kernels use.");

  m.def("kernel_sources", [] {
    nb::dict sources;
    for (int i = 0; i < jaxfuse::kNumEmbeddedSources; ++i) {
      sources[jaxfuse::kEmbeddedSources[i].name] = jaxfuse::kEmbeddedSources[i].text;
    }
    return sources;
  }, "The embedded portable kernel sources, by file name.");
}
