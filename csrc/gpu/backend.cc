#include "gpu/backend.h"

#include <algorithm>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include "gpu/autotune.h"

#include "common/debug.h"
#include "gpu/embedded_sources.h"
#include "gpu/kernel_cache.h"

namespace jaxfuse::gpu {
namespace {

std::mutex stats_mu;
BackendStats stats;

std::string CacheKey(Platform platform, const std::string& arch, const std::string& compiler,
                     const GeneratedKernel& generated, const PlanSpec& spec) {
  return std::string("jaxfuse-kernel-v1|") + PlatformName(platform) + "|" + arch + "|" +
         compiler + "|src=" + KernelSourcesHash() + "-" +
         std::to_string(Fnv1a64(generated.source)) + "|" + generated.solver + "|" +
         spec.canonical;
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

void Count(int64_t BackendStats::*counter, int64_t amount = 1) {
  std::lock_guard<std::mutex> lock(stats_mu);
  stats.*counter += amount;
}

// The variant to run: from the disk cache if this plan was tuned before on this architecture,
// else by timing every variant now (compiled concurrently), remembering the winner. Where it
// generated the winner's kernel on the way, it leaves it in `*chosen` (the caller's to reuse).
int ChooseVariant(Platform platform, const PlanSpec& spec, const DeviceInfo& device, int ordinal,
                  const RuntimeCompiler& compiler, std::optional<GeneratedKernel>* chosen) {
  const int count = CountVariants(spec, device);
  // JAXFUSE_KERNEL_VARIANT=i forces variant i, =<solver> (e.g. conv_tma) the first variant of
  // that solver where it applies, and =<solver> <suffix> (e.g. "conv_tma pp") the first whose
  // tile label ends with the suffix (tests check every variant's results with it).
  static const char* forced = std::getenv("JAXFUSE_KERNEL_VARIANT");
  if (forced != nullptr && *forced) {
    if (*forced >= '0' && *forced <= '9') return std::clamp(std::atoi(forced), 0, count - 1);
    const std::string wanted = forced;
    for (int i = 0; i < count; ++i) {
      const GeneratedKernel v = GenerateKernel(spec, device, i);
      if (v.solver == wanted) return i;
      const std::string prefix = v.solver + " ";
      if (wanted.rfind(prefix, 0) != 0) continue;
      const std::string suffix = wanted.substr(prefix.size());
      if (v.tile.size() >= suffix.size() &&
          v.tile.compare(v.tile.size() - suffix.size(), suffix.size(), suffix) == 0) {
        return i;
      }
    }
    return 0;
  }
  if (count <= 1 || !AutotuneEnabled()) return 0;
  DiskCache& disk = DiskCache::Global();
  // The decision holds for this candidate list only: the key counts the candidates, and the
  // entry names the winner's tile, so a list that grew or reordered (a jaxfuse upgrade) is
  // timed again rather than an index read into another list.
  GeneratedKernel first = GenerateKernel(spec, device, 0);  // (keys the decision; a candidate)
  const std::string key = CacheKey(platform, device.arch, compiler.version(), first, spec) +
                          "|tuned-variant-v3|of=" + std::to_string(count);
  const auto entry = [](int variant, const GeneratedKernel& v) {
    return std::to_string(variant) + " " + v.solver + " " + v.tile;
  };
  std::string stored;
  if (disk.Load(key, &stored)) {
    const int variant = std::atoi(stored.c_str());
    if (variant >= 0 && variant < count) {
      *chosen = variant == 0 ? first : GenerateKernel(spec, device, variant);
      if (stored == entry(variant, **chosen)) return variant;
      chosen->reset();
    }
  }
  std::vector<GeneratedKernel> variants;
  variants.push_back(std::move(first));
  for (int i = 1; i < count; ++i) variants.push_back(GenerateKernel(spec, device, i));
  std::vector<std::future<std::string>> jobs;
  for (const GeneratedKernel& v : variants) {
    jobs.push_back(std::async(std::launch::async, [&compiler, &v, &device] {
      try {
        return compiler.Compile(v.source, CompileArch(v, device));
      } catch (const std::exception&) {
        return std::string();  // not a candidate
      }
    }));
  }
  std::vector<std::string> binaries;
  for (auto& job : jobs) binaries.push_back(job.get());
  Count(&BackendStats::compilations, count);
  if (binaries[0].empty()) return 0;  // let the caller report variant 0's compiler log
  int best = 0;
  try {
    best = Autotune(platform, spec, ordinal, variants, binaries).best;
  } catch (const std::exception&) {
    return 0;  // the device could not run the measurement (e.g. out of memory): no memo
  }
  Count(&BackendStats::tunings);
  disk.Store(key, entry(best, variants[best]));
  // The winner's binary is the one about to be looked up: store it now, saving a compile.
  disk.Store(CacheKey(platform, device.arch, compiler.version(), variants[best], spec),
             binaries[best]);
  *chosen = std::move(variants[best]);
  return best;
}

}  // namespace

// The process-wide memo behind GetKernel's per-thread cache.
std::shared_ptr<const LoadedKernel> GetKernelShared(Platform platform, const PlanSpec& spec,
                                                    int ordinal);

std::string CompileOnly(Platform platform, const PlanSpec& spec, const DeviceInfo& device,
                        int variant, GeneratedKernel* generated) {
  *generated = GenerateKernel(spec, device, variant);
  return RuntimeCompiler::Get(platform).Compile(generated->source, CompileArch(*generated, device));
}

std::shared_ptr<const LoadedKernel> GetKernel(Platform platform, const PlanSpec& spec,
                                              int ordinal) {
  // Per thread, by plan object (parsed plans live as long as the process): the execute path
  // finds its kernel without locks or string keys.
  struct Key {
    const PlanSpec* spec;
    int device;
    bool operator==(const Key& o) const { return spec == o.spec && device == o.device; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.spec) ^ (size_t(k.device) * 0x9e3779b97f4a7c15ull);
    }
  };
  thread_local std::unordered_map<Key, std::shared_ptr<const LoadedKernel>, KeyHash> recent;
  const Key key{&spec, ordinal * 2 + static_cast<int>(platform)};
  if (auto it = recent.find(key); it != recent.end()) return it->second;
  auto kernel = GetKernelShared(platform, spec, ordinal);
  if (recent.size() > 4096) recent.clear();
  return recent[key] = kernel;
}

namespace {

// The process-wide slot of a plan's kernel on a device (created empty on first ask).
std::shared_ptr<Slot> KernelSlot(Platform platform, const PlanSpec& spec, int ordinal) {
  static std::mutex mu;
  static auto* slots = new std::map<std::tuple<int, int, std::string>, std::shared_ptr<Slot>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& entry = (*slots)[{static_cast<int>(platform), ordinal, spec.canonical}];
  if (!entry) entry = std::make_shared<Slot>();
  return entry;
}

}  // namespace

std::shared_ptr<const LoadedKernel> FindLoadedKernel(Platform platform, const PlanSpec& spec,
                                                     int ordinal) {
  std::shared_ptr<Slot> slot = KernelSlot(platform, spec, ordinal);
  std::unique_lock<std::mutex> lock(slot->mu, std::try_to_lock);  // (being compiled: not yet)
  return lock.owns_lock() ? slot->kernel : nullptr;
}

std::shared_ptr<const LoadedKernel> GetKernelShared(Platform platform, const PlanSpec& spec,
                                                    int ordinal) {
  std::shared_ptr<Slot> slot = KernelSlot(platform, spec, ordinal);
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->kernel) return slot->kernel;

  const Driver& driver = Driver::Get(platform);
  const DeviceInfo device = driver.Query(ordinal);
  const RuntimeCompiler& compiler = RuntimeCompiler::Get(platform);
  DiskCache& disk = DiskCache::Global();
  auto kernel = std::make_shared<LoadedKernel>();
  kernel->arch = device.arch;
  std::optional<GeneratedKernel> chosen;
  kernel->variant = ChooseVariant(platform, spec, device, ordinal, compiler, &chosen);
  kernel->generated = chosen ? std::move(*chosen) : GenerateKernel(spec, device, kernel->variant);
  const std::string key = CacheKey(platform, device.arch, compiler.version(), kernel->generated,
                                   spec);
  auto compile = [&] {
    std::string fresh =
        compiler.Compile(kernel->generated.source, CompileArch(kernel->generated, device));
    kernel->origin = "compiled";
    disk.Store(key, fresh);
    Count(&BackendStats::compilations);
    return fresh;
  };
  std::string& binary = kernel->binary;
  if (disk.Load(key, &binary)) {
    kernel->origin = "disk cache";
    Count(&BackendStats::disk_hits);
    try {
      kernel->functions = driver.Load(ordinal, binary, kernel->generated.entries);
    } catch (const std::exception&) {
      // Verified but unloadable (e.g. written by a driver this one cannot read): rebuild it.
      binary = compile();
      kernel->functions = driver.Load(ordinal, binary, kernel->generated.entries);
    }
  } else {
    binary = compile();
    kernel->functions = driver.Load(ordinal, binary, kernel->generated.entries);
  }
  {
    std::lock_guard<std::mutex> stats_lock(stats_mu);
    ++stats.loads;
  }
  slot->kernel = kernel;
  return kernel;
}

bool EntryApplies(const LoadedKernel& kernel, size_t i, const FusedParams& params) {
  const auto& entries = kernel.generated.entries;
  if (i + 1 >= entries.size()) return i + 1 == entries.size();  // the last runs on any
  const int a = entries[i].alignment;
  return Aligned(params.x, a) && Aligned(params.y, a) &&
         (params.w == nullptr || Aligned(params.w, a)) &&
         (params.side == nullptr || Aligned(params.side, a));
}

size_t EntryFor(const LoadedKernel& kernel, const FusedParams& params) {
  const auto& entries = kernel.generated.entries;
  for (size_t i = 0; i + 1 < entries.size(); ++i) {
    if (EntryApplies(kernel, i, params)) return i;
  }
  return entries.size() - 1;
}

void Launch(Platform platform, const PlanSpec& spec, const LoadedKernel& kernel, void* stream,
            const FusedParams& params) {
  if (spec.output_elements() == 0) return;
  if (PoisonOutputs()) {
    Driver::Get(platform).Memset(params.y, 0xff, spec.output_elements() * dtype_size(spec.dtype),
                                 stream);
  }
  const size_t i = EntryFor(kernel, params);
  Driver::Get(platform).Launch(kernel.functions[i], kernel.generated.entries[i], stream, params);
}

const std::string& KernelSourcesHash() {
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

void CountCompilation() { Count(&BackendStats::compilations); }
void CountDiskHit() { Count(&BackendStats::disk_hits); }
void CountLoad() { Count(&BackendStats::loads); }
void CountRecord(bool update) {
  Count(update ? &BackendStats::record_updates : &BackendStats::records);
}
void CountRecordUpdateTime(int64_t ns) { Count(&BackendStats::record_update_ns, ns); }
void CountTensorMapEncode(int64_t ns) {
  std::lock_guard<std::mutex> lock(stats_mu);
  stats.tensor_map_encodes += 1;
  stats.tensor_map_encode_ns += ns;
}

BackendStats Stats() {
  std::lock_guard<std::mutex> lock(stats_mu);
  return stats;
}

}  // namespace jaxfuse::gpu
