// The GPU backend: plan -> generated source -> runtime compiler (or the disk cache) -> module
// loaded on the device, memoized per (platform, device, plan); and the launch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/plan_spec.h"
#include "gpu/codegen.h"
#include "gpu/runtime.h"
#include "kernels/params.h"

namespace jaxfuse::gpu {

struct LoadedKernel {
  GeneratedKernel generated;
  std::vector<void*> functions;  // one per generated entry point
  std::string binary;            // the loaded module (XLA's record stage loads it again)
  std::string arch;
  int variant = 0;     // which tile configuration (autotuned; 0 = the heuristic's)
  std::string origin;  // "compiled" or "disk cache"
};

// Counters for tests and `python -m jaxfuse info`.
struct BackendStats {
  int64_t compilations = 0;  // runtime-compiler invocations
  int64_t tunings = 0;       // plans autotuned (each compiles and times all its variants)
  int64_t disk_hits = 0;
  int64_t loads = 0;  // modules loaded onto a device
  int64_t records = 0;         // launch commands XLA's record stage created through the handler
  int64_t record_updates = 0;  // ... and updated
  int64_t record_update_ns = 0;  // host time the record stage's updates took, in the handler
  int64_t tensor_map_encodes = 0;    // tensor maps encoded for a buffer not seen just before
  int64_t tensor_map_encode_ns = 0;  // ... and the host time the encoding took
};

// The kernel for `spec` on device `ordinal`, compiled and loaded on first use. Thread-safe:
// concurrent first uses of one plan compile it once. Throws std::runtime_error (with the
// compiler log when compiling failed).
std::shared_ptr<const LoadedKernel> GetKernel(Platform platform, const PlanSpec& spec,
                                              int ordinal);
// The same kernel if it is loaded already, else null: no compiling, loading or driver call
// (allowed while a stream is being captured into a graph).
std::shared_ptr<const LoadedKernel> FindLoadedKernel(Platform platform, const PlanSpec& spec,
                                                     int ordinal);

// The fastest of the kernel's entry points that the buffers' alignment allows.
size_t EntryFor(const LoadedKernel& kernel, const FusedParams& params);
// Whether entry `i` of `kernel` can run on these buffers (their alignment).
bool EntryApplies(const LoadedKernel& kernel, size_t i, const FusedParams& params);

// Launches the kernel on `stream` through EntryFor's entry point. A plan with an empty output
// launches nothing.
void Launch(Platform platform, const PlanSpec& spec, const LoadedKernel& kernel, void* stream,
            const FusedParams& params);

// Compiles `spec` for `arch` without touching a device or the caches (CI compiles every
// kernel variant this way on machines without a GPU). Returns the device binary.
std::string CompileOnly(Platform platform, const PlanSpec& spec, const DeviceInfo& device,
                        int variant, GeneratedKernel* generated);

BackendStats Stats();

// A hash of every embedded kernel source: part of each disk-cache key, so editing a kernel
// source invalidates what was compiled from it.
const std::string& KernelSourcesHash();

// Counts one runtime-compiler run, disk-cache hit or module load in Stats() (for kernels this
// file does not build, such as the batched conversion's).
void CountCompilation();
void CountDiskHit();
void CountLoad();
void CountRecord(bool update);
// Host time of one record-stage update, and of one tensor map encoded (runtime.cc).
void CountRecordUpdateTime(int64_t ns);
void CountTensorMapEncode(int64_t ns);

}  // namespace jaxfuse::gpu
