// The CPU backend: one pass over the output, the epilogue applied to each tile of results in
// registers / L1 before its single store.
#pragma once

#include "common/plan_spec.h"

namespace jaxfuse::cpu {

struct FusedBuffers {
  const void* x = nullptr;
  const void* w = nullptr;
  const float* bias = nullptr;
  const float* bn_scale = nullptr;
  const float* bn_shift = nullptr;
  const float* bn_mean = nullptr;
  const float* bn_var = nullptr;
  const void* side = nullptr;
  const float* scalars = nullptr;  // kNumScalars values
  void* y = nullptr;
};

// Runs the plan. Throws std::runtime_error on an internal failure (e.g. out of memory).
void RunFused(const PlanSpec& spec, const FusedBuffers& buffers);

}  // namespace jaxfuse::cpu
