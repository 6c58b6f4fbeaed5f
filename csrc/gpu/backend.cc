#include "gpu/backend.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include "common/debug.h"
#include "gpu/embedded_sources.h"
#include "gpu/kernel_cache.h"

namespace jaxfuse::gpu {
namespace {

std::mutex stats_mu;
BackendStats stats;

// Hash of every kernel header: part of each cache key, so editing a kernel source
// invalidates what was compiled from it.
const std::string& HeadersHash() {
  static const std::string hash = [] {
    std::string all;
    for (int i = 0; i < kNumEmbeddedSources; ++i) {
      all += kEmbeddedSources[i].name;
      all += '\0';
      all += kEmbeddedSources[i].text;
    }
    return std::to_string(Fnv1a64(all));
  }();
  return hash;
}

std::string CacheKey(Platform platform, const std::string& arch, const std::string& compiler,
                     const GeneratedKernel& generated, const PlanSpec& spec) {
  return std::string("jaxfuse-kernel-v1|") + PlatformName(platform) + "|" + arch + "|" +
         compiler + "|src=" + HeadersHash() + "-" + std::to_string(Fnv1a64(generated.source)) +
         "|" + generated.solver + "|" + spec.text;
}

struct Slot {
  std::mutex mu;
  std::shared_ptr<const LoadedKernel> kernel;
};

const std::string& CompileArch(const GeneratedKernel& generated, const DeviceInfo& device) {
  return generated.compile_arch.empty() ? device.arch : generated.compile_arch;
}

bool Aligned(const void* p, int alignment) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(alignment) == 0;
}

}  // namespace

std::string CompileOnly(Platform platform, const PlanSpec& spec, const DeviceInfo& device,
                        GeneratedKernel* generated) {
  *generated = GenerateKernel(spec, device);
  return RuntimeCompiler::Get(platform).Compile(generated->source, CompileArch(*generated, device));
}

std::shared_ptr<const LoadedKernel> GetKernel(Platform platform, const PlanSpec& spec,
                                              int ordinal) {
  static std::mutex mu;
  static auto* slots = new std::map<std::tuple<int, int, std::string>, std::shared_ptr<Slot>>();
  std::shared_ptr<Slot> slot;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& entry = (*slots)[{static_cast<int>(platform), ordinal, spec.text}];
    if (!entry) entry = std::make_shared<Slot>();
    slot = entry;
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->kernel) return slot->kernel;

  const Driver& driver = Driver::Get(platform);
  const DeviceInfo device = driver.Query(ordinal);
  auto kernel = std::make_shared<LoadedKernel>();
  kernel->generated = GenerateKernel(spec, device);
  kernel->arch = device.arch;
  const RuntimeCompiler& compiler = RuntimeCompiler::Get(platform);
  const std::string key = CacheKey(platform, device.arch, compiler.version(), kernel->generated,
                                   spec);
  std::string binary;
  DiskCache& disk = DiskCache::Global();
  if (disk.Load(key, &binary)) {
    kernel->origin = "disk cache";
    std::lock_guard<std::mutex> stats_lock(stats_mu);
    ++stats.disk_hits;
  } else {
    binary = compiler.Compile(kernel->generated.source, CompileArch(kernel->generated, device));
    kernel->origin = "compiled";
    disk.Store(key, binary);
    std::lock_guard<std::mutex> stats_lock(stats_mu);
    ++stats.compilations;
  }
  kernel->functions = driver.Load(ordinal, binary, kernel->generated.entries);
  {
    std::lock_guard<std::mutex> stats_lock(stats_mu);
    ++stats.loads;
  }
  slot->kernel = kernel;
  return kernel;
}

void Launch(Platform platform, const PlanSpec& spec, const LoadedKernel& kernel, void* stream,
            const FusedParams& params) {
  if (spec.output_elements() == 0) return;
  if (PoisonOutputs()) {
    Driver::Get(platform).Memset(params.y, 0xff, spec.output_elements() * dtype_size(spec.dtype),
                                 stream);
  }
  const auto& entries = kernel.generated.entries;
  for (size_t i = 0; i < entries.size(); ++i) {
    const int a = entries[i].alignment;
    const bool fits = Aligned(params.x, a) && Aligned(params.y, a) &&
                      (params.w == nullptr || Aligned(params.w, a)) &&
                      (params.side == nullptr || Aligned(params.side, a));
    if (fits || i + 1 == entries.size()) {
      Driver::Get(platform).Launch(kernel.functions[i], entries[i], stream, params);
      return;
    }
  }
}

BackendStats Stats() {
  std::lock_guard<std::mutex> lock(stats_mu);
  return stats;
}

}  // namespace jaxfuse::gpu
