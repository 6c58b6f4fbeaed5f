#include "gpu/convert_many.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/debug.h"
#include "gpu/backend.h"
#include "gpu/kernel_cache.h"

namespace jaxfuse::gpu {
namespace {

constexpr unsigned kThreads = 256;
constexpr char kEntry[] = "jaxfuse_convert_many";

const char* CodeName(int code) {
  switch (code) {
    case 0: return "float32";
    case 1: return "float16";
    case 2: return "bfloat16";
    default: return "an unsupported type";
  }
}

// Blocks for `items` work items: one item per thread for small calls, at most 8 blocks per
// multiprocessor (each thread then loops over several items).
unsigned GridFor(int64_t items, int sm_count) {
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(std::max(sm_count, 1)) * 8;
  return static_cast<unsigned>(std::clamp<int64_t>(wanted, 1, cap));
}

}  // namespace

bool ConvertPairSupported(int src, int dst) {
  return src >= 0 && src <= 2 && dst >= 0 && dst <= 2 && src != dst;
}

void CheckConvertPair(int src, int dst) {
  if (!ConvertPairSupported(src, dst)) {
    throw std::invalid_argument(std::string("jaxfuse_convert_many converts between float32, "
                                            "float16 and bfloat16, not ") +
                                CodeName(src) + " to " + CodeName(dst));
  }
}

std::string ConvertSource() {
  return "// jaxfuse batched float conversion\n"
         "#include \"portable.h\"\n#include \"convert_table.h\"\n#include \"convert_many.cuh\"\n";
}

std::string CompileConvertOnly(Platform platform, const std::string& arch) {
  return RuntimeCompiler::Get(platform).Compile(ConvertSource(), arch);
}

std::shared_ptr<const ConvertKernel> GetConvertKernel(Platform platform, int ordinal) {
  static std::mutex mu;
  static auto* kernels = new std::map<std::pair<int, int>, std::shared_ptr<const ConvertKernel>>();
  // One lock for every device: the kernel compiles in well under a second, once per process.
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*kernels)[{static_cast<int>(platform), ordinal}];
  if (slot) return slot;

  const Driver& driver = Driver::Get(platform);
  const DeviceInfo device = driver.Query(ordinal);
  const RuntimeCompiler& compiler = RuntimeCompiler::Get(platform);
  const std::string source = ConvertSource();
  const std::string key = std::string("jaxfuse-convert-v1|") + PlatformName(platform) + "|" +
                          device.arch + "|" + compiler.version() + "|src=" +
                          KernelSourcesHash() + "-" + std::to_string(Fnv1a64(source));
  auto kernel = std::make_shared<ConvertKernel>();
  kernel->entry.name = kEntry;
  kernel->entry.block = kThreads;
  kernel->entry.alignment = 1;
  kernel->sm_count = device.sm_count;
  kernel->arch = device.arch;
  DiskCache& disk = DiskCache::Global();
  auto compile = [&] {
    std::string fresh = compiler.Compile(source, device.arch);
    kernel->origin = "compiled";
    disk.Store(key, fresh);
    CountCompilation();
    return fresh;
  };
  std::string binary;
  std::vector<void*> functions;
  if (disk.Load(key, &binary)) {
    kernel->origin = "disk cache";
    CountDiskHit();
    try {
      functions = driver.Load(ordinal, binary, {kernel->entry});
    } catch (const std::exception&) {  // verified but unloadable: rebuild it
      functions = driver.Load(ordinal, compile(), {kernel->entry});
    }
  } else {
    functions = driver.Load(ordinal, compile(), {kernel->entry});
  }
  CountLoad();
  kernel->function = functions.at(0);
  slot = kernel;
  return slot;
}

void LaunchConvert(Platform platform, const ConvertKernel& kernel, void* stream,
                   const ConvertRequest* requests, int count) {
  const Driver& driver = Driver::Get(platform);
  if (PoisonOutputs()) {  // debug: every element the kernel forgets stays NaN
    for (int i = 0; i < count; ++i) {
      const int64_t bytes = requests[i].elements * (requests[i].dst_code == 0 ? 4 : 2);
      if (bytes > 0) driver.Memset(requests[i].dst, 0xff, static_cast<size_t>(bytes), stream);
    }
  }
  ForEachConvertTable(requests, count, [&](const ConvertTable& table) {
    driver.LaunchBlock(kernel.function, GridFor(table.items, kernel.sm_count), kThreads, 0,
                       stream, &table);
  });
}

}  // namespace jaxfuse::gpu
