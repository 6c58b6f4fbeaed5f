// The batched float conversion (custom call "jaxfuse_convert_many"): one fixed kernel
// (kernels/convert_many.cuh) compiled once per device through the runtime compiler and the disk
// cache, and the host side of a call: the segment tables, split into launches of at most
// kMaxConvertSegments segments each (the kernel's parameters are limited to 4 KB).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gpu/runtime.h"
#include "kernels/convert_table.h"

namespace jaxfuse::gpu {

// One conversion of a call: `elements` values at `src` (type code `src_code`) into `dst`.
struct ConvertRequest {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t elements = 0;
  int src_code = 0, dst_code = 0;  // jaxfuse::DType numbering: 0 f32, 1 f16, 2 bf16
};

// Whether the kernel converts type code `src` to `dst` (any two different float codes).
bool ConvertPairSupported(int src, int dst);

// Fills tables with the requests in order (empty ones skipped) and calls `launch(table)` for
// each full table and the last one: nothing when every request is empty. A segment is
// vectorized when both of its buffers are 16-byte aligned. Throws std::invalid_argument for a
// pair of codes that is not a conversion.
template <typename Launch>
void ForEachConvertTable(const ConvertRequest* requests, int count, Launch&& launch);

struct ConvertKernel {
  void* function = nullptr;
  EntryPoint entry;   // the block size; the grid is sized per launch
  int sm_count = 0;
  std::string arch;
  std::string origin;  // "compiled" or "disk cache"
};

// The kernel on device `ordinal`, compiled (or read from the disk cache) and loaded on first use.
// Thread-safe. Throws std::runtime_error with the compiler log when compiling fails.
std::shared_ptr<const ConvertKernel> GetConvertKernel(Platform platform, int ordinal);

// Enqueues the conversions on `stream`: one launch per table, nothing else (no allocation, no
// synchronization), so XLA may record it in a command buffer.
void LaunchConvert(Platform platform, const ConvertKernel& kernel, void* stream,
                   const ConvertRequest* requests, int count);

// The translation unit of the kernel, and its device binary for `arch` compiled without a
// device or the caches (CI compiles it this way on machines without a GPU).
std::string ConvertSource();
std::string CompileConvertOnly(Platform platform, const std::string& arch);

// ----- implementation ---------------------------------------------------------------------------

void CheckConvertPair(int src, int dst);  // throws std::invalid_argument naming the pair

template <typename Launch>
void ForEachConvertTable(const ConvertRequest* requests, int count, Launch&& launch) {
  ConvertTable table;  // about 4 KB, on the stack: the execute path allocates nothing
  table.items = 0;
  table.count = 0;
  table.unused = 0;
  for (int i = 0; i < count; ++i) {
    const ConvertRequest& r = requests[i];
    CheckConvertPair(r.src_code, r.dst_code);
    if (r.elements <= 0) continue;
    const bool vectorized = reinterpret_cast<uintptr_t>(r.src) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(r.dst) % 16 == 0;
    const int64_t chunks = vectorized ? r.elements / kConvertChunk : 0;
    ConvertSegment& s = table.segments[table.count++];
    s.src = r.src;
    s.dst = r.dst;
    s.elements = r.elements;
    s.first = table.items;
    s.codes = static_cast<unsigned>(r.src_code) | static_cast<unsigned>(r.dst_code) << 4 |
              (vectorized ? 1u << 8 : 0u);
    table.items += chunks + (r.elements - chunks * kConvertChunk);
    if (table.count == kMaxConvertSegments) {
      launch(static_cast<const ConvertTable&>(table));
      table.items = 0;
      table.count = 0;
    }
  }
  if (table.count > 0) launch(static_cast<const ConvertTable&>(table));
}

}  // namespace jaxfuse::gpu
