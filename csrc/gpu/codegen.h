// Code generation: a PlanSpec becomes one translation unit for the runtime compiler: the
// plan's sizes as constants, its operator chain as a straight-line epilogue, and the kernel
// files (csrc/kernels/) that apply to it. MIOpen calls the kernel choice a "solver".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/plan_spec.h"

namespace jaxfuse::gpu {

// What the code generator needs to know about the target device.
struct DeviceInfo {
  std::string arch;                 // "sm_90", "gfx90a", ...
  int sm_count = 0;                 // multiprocessors / compute units
  int max_smem_per_block = 48 * 1024;  // opt-in dynamic shared memory limit, bytes
  bool hip = false;
};

// The copy engine's view of one buffer (a CUtensorMap), for kernels that load through bulk
// tensor copies (TMA). The map holds the buffer's address, so the launcher encodes it for each
// launch from this description; everything else is fixed by the plan.
struct TensorMapSpec {
  bool filters = false;  // the filters' map (else the input's)
  bool im2col = false;   // an im2col map of an NHWC input (else a tiled map)
  int data_type = 0;     // CUtensorMapDataType
  int rank = 0;
  uint64_t dims[5] = {};     // elements, innermost dimension first
  uint64_t strides[4] = {};  // bytes, of dimensions 1 .. rank - 1
  uint32_t box[5] = {};      // tiled maps: elements per copy along each dimension
  uint32_t element_strides[5] = {1, 1, 1, 1, 1};
  int lower[2] = {}, upper[2] = {};  // im2col: the bounding box of window corners (W, H)
  uint32_t channels = 0, pixels = 0;  // im2col: channels per pixel, pixels per copy
  int swizzle = 3;  // CUtensorMapSwizzle: 3 = 128-byte (the tensor-core tiles), 0 = none
};

// One kernel entry point of the compiled module and how to launch it.
struct EntryPoint {
  std::string name;
  unsigned grid = 1, block = 256, shared_bytes = 0;
  int alignment = 1;  // bytes every plan-dtype buffer must be aligned to for this entry
  // Kernels that take TmaParams (csrc/kernels/params.h): the input's map, then the filters'.
  std::vector<TensorMapSpec> tensor_maps;
};

struct GeneratedKernel {
  std::string solver;                // e.g. "pointwise", "conv_direct"
  std::string tile;                  // the variant's tile, e.g. "128x128 s4" ("" if none)
  std::string source;                // the main translation unit
  std::string compile_arch;          // the compiler's target (e.g. "sm_90a" for wgmma)
  std::vector<EntryPoint> entries;   // fastest first; the last one applies to any alignment
};

// The device function `jaxfuse::wgmma::mma_64xN(float (&d)[N / 2], u64 a, u64 b)` for one
// tile width N, dtype (1 fp16, 2 bf16, 0 fp32 as TF32) and B major-ness: d += A (64x16) *
// B (16xN) (64x8 * 8xN for TF32, B K-major), both from shared-memory descriptors (see
// csrc/kernels/wgmma.h). Its operand list has N / 2 registers, so it is generated rather than
// written out for every N.
std::string WgmmaFunction(int n, int dtype, bool b_mn_major);

// `jaxfuse::wgmma::mma_swapped(float (&d)[N / 64][32], u64 a, u64 b)`: the same with A
// MN-major and B K-major, N = the tile's pixels (conv_tma.cuh: kSwapAB), register i of the
// accumulator being d[i / 32][i % 32] (one 64-pixel block of the tile per row of d).
std::string WgmmaSwappedFunction(int n, int dtype);

// How many variants (tile configurations) of the plan's kernel there are to choose from;
// variant 0 is the heuristic's choice, and autotuning times the others against it.
int CountVariants(const PlanSpec& spec, const DeviceInfo& device);

// The source for one variant (clamped to the valid range).
GeneratedKernel GenerateKernel(const PlanSpec& spec, const DeviceInfo& device, int variant = 0);

}  // namespace jaxfuse::gpu
