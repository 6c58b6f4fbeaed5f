// The GPU runtime, loaded at run time: the CUDA driver API (libcuda) or HIP (libamdhip64),
// and the matching runtime compiler (NVRTC or hiprtc). One table of function pointers per
// platform; nothing here is linked, so the extension imports on machines without a GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu/codegen.h"
#include "kernels/params.h"

namespace jaxfuse::gpu {

enum class Platform { kCuda = 0, kRocm = 1 };
const char* PlatformName(Platform platform);

// Extra places to look for the runtime compiler (e.g. the NVRTC wheel jax's CUDA plugin
// installs); tried before the system's default search. Set once, from Python, at import.
void SetCompilerSearchPaths(const std::vector<std::string>& paths);

class RuntimeCompiler {
 public:
  // The compiler for `platform`, loaded on first use. Throws std::runtime_error naming every
  // path it tried when none loads.
  static const RuntimeCompiler& Get(Platform platform);

  const std::string& version() const { return version_; }    // e.g. "nvrtc 13.0"
  const std::string& library() const { return library_; }    // the path it was loaded from

  // Compiles `source` for `arch` with the embedded kernel headers. Returns the device binary
  // (a cubin / code object); on failure throws std::runtime_error carrying the compiler log.
  std::string Compile(const std::string& source, const std::string& arch) const;

 private:
  explicit RuntimeCompiler(Platform platform);
  struct Api;
  Platform platform_;
  const Api* api_ = nullptr;
  std::string version_, library_;
};

class Driver {
 public:
  // The driver for `platform`, initialized on first use; throws std::runtime_error if the
  // runtime library is missing or finds no device.
  static const Driver& Get(Platform platform);

  DeviceInfo Query(int ordinal) const;
  // Records device facts the driver cannot report portably (HIP's architecture name).
  void Register(int ordinal, const DeviceInfo& info) const;
  std::string DeviceName(int ordinal) const;

  // Loads `binary` into the primary context of device `ordinal` and returns the function
  // handle of each entry point (in `entries` order).
  std::vector<void*> Load(int ordinal, const std::string& binary,
                          const std::vector<EntryPoint>& entries) const;

  // Fills `bytes` bytes at `device_ptr` with `value`, in order on `stream`.
  void Memset(void* device_ptr, unsigned char value, size_t bytes, void* stream) const;

  // Launches `function` on `stream` with ParamBlock's block as its only argument.
  void Launch(void* function, const EntryPoint& entry, void* stream,
              const FusedParams& params) const;
  // The parameter block `entry` takes for `params`: `params` itself, or for an entry with
  // tensor maps, TmaParams (in `*tma`) with the maps encoded for its buffers. Its size in
  // `*bytes`.
  const void* ParamBlock(const EntryPoint& entry, const FusedParams& params, TmaParams* tma,
                         size_t* bytes) const;
  // Encodes `spec` for the buffer at `address` (CUDA; throws where the driver cannot).
  void EncodeTensorMap(const TensorMapSpec& spec, const void* address, TensorMap* map) const;
  // The same, remembered per thread for the last buffers seen (see runtime.cc).
  const TensorMap& CachedTensorMap(const TensorMapSpec& spec, const void* address) const;
  // Launches `function` on `stream` with one parameter passed by value: the kernel's parameter
  // block, read from `params` (as many bytes as the kernel declares).
  void LaunchBlock(void* function, unsigned grid, unsigned block, unsigned shared_bytes,
                   void* stream, const void* params) const;

  // Device memory and timing, for autotuning at plan-compile time (never during execution:
  // these synchronize). All run in the device's primary context.
  void* Allocate(int ordinal, size_t bytes) const;
  void Free(int ordinal, void* device_ptr) const;
  void CopyToDevice(int ordinal, void* dst, const void* src, size_t bytes) const;
  void CopyToHost(int ordinal, void* dst, const void* src, size_t bytes) const;
  // Median milliseconds of `repeats` launches (after one warm-up) on a private stream. With
  // `flush` (`flush_bytes` of device memory, larger than L2), the stream overwrites it before
  // each timed launch, so every launch finds its buffers in DRAM, not in L2. With
  // `poison_bytes`, the output's first `poison_bytes` are set to 0xff before the warm-up.
  double TimeLaunches(int ordinal, void* function, const EntryPoint& entry,
                      const FusedParams& params, int repeats, void* flush = nullptr,
                      size_t flush_bytes = 0, size_t poison_bytes = 0) const;
  // The device's L2 cache in bytes (0 where it cannot be read: ROCm's attribute numbering).
  size_t L2Bytes(int ordinal) const;

  // Timing events in the device's primary context (the one XLA uses), recorded on any stream.
  void* CreateEvent(int ordinal) const;
  void DestroyEvent(int ordinal, void* event) const;
  void RecordEvent(void* event, void* stream) const;
  // Milliseconds between two recorded events; waits for `end` to complete.
  double ElapsedMs(int ordinal, void* start, void* end) const;

  // Stream gates, so a stopwatch times device work without the host's launch work
  // (gpu/stopwatch.h): WaitValue holds `stream` until the 32-bit word at `device_ptr` is at
  // least `value`; the host opens it by storing to the word, which lives in pinned host memory
  // mapped into the device (no stream of ours is involved, so no hardware queue shared with
  // XLA's can block the release). StreamGatesWork() checks once per device that a gate holds
  // and opens (false where the driver lacks stream memory operations or they fail).
  bool StreamGatesWork(int ordinal) const;
  void WaitValue(int ordinal, void* stream, void* device_ptr, uint32_t value) const;
  // A pinned, device-mapped 64-byte host block; its device address in *device_ptr.
  void* AllocateMappedHost(int ordinal, void** device_ptr) const;
  void FreeMappedHost(int ordinal, void* host_ptr) const;
  // Whether all work before `event` has completed (never waits).
  bool EventDone(void* event) const;
  // Whether `stream` (of device `ordinal`) is being captured into a graph; throws where the
  // driver cannot tell.
  bool Capturing(int ordinal, void* stream) const;
  void* CreateStream(int ordinal) const;  // non-blocking
  void DestroyStream(int ordinal, void* stream) const;

 private:
  explicit Driver(Platform platform);
  struct Api;
  void Check(int status, const char* what) const;
  void* PrimaryContext(int ordinal) const;
  class ContextScope;
  Platform platform_;
  const Api* api_ = nullptr;
};

}  // namespace jaxfuse::gpu
