// The parameter block of jaxfuse_convert_many (convert_many.cuh): a table of conversion
// segments, filled by the host (gpu/convert_many.cc) and passed to the kernel by value, so its
// layout is shared by construction (this header is compiled by the host compiler and by
// NVRTC / hiprtc, like params.h).
//
// The kernel's work is a flat range of items, numbered across the segments in table order:
// a vectorized segment (both buffers 16-byte aligned) has one item per whole chunk of
// kConvertChunk elements, then one per leftover element; any other segment one per element.
#pragma once

namespace jaxfuse {

// Element type codes: the numbering of jaxfuse::DType (0 f32, 1 f16, 2 bf16).
constexpr int kConvertChunk = 8;          // elements per vector item (16 bytes of 16-bit data)
constexpr int kMaxConvertSegments = 96;   // keeps the table under the 4 KB parameter limit

struct ConvertSegment {
  const void* src;
  void* dst;
  long long elements;
  long long first;  // the segment's first item in the launch
  unsigned int codes;  // source code | destination code << 4 | vectorized << 8
};

struct ConvertTable {
  long long items;  // items in all segments
  int count;        // segments in use
  int unused;
  ConvertSegment segments[kMaxConvertSegments];
};

static_assert(sizeof(ConvertTable) <= 4096, "kernel parameters are limited to 4 KB");

}  // namespace jaxfuse
