// The CPU backend: one pass over the output, the epilogue applied to each tile of results in
// registers / L1 before its single store.
#pragma once

#include "common/plan_spec.h"
#include "kernels/params.h"

namespace jaxfuse::cpu {

// Throws std::invalid_argument if the CPU backend refuses the plan (see fused_cpu.cc).
void CheckSupported(const PlanSpec& spec);

// Runs the plan. Throws std::invalid_argument for a plan CheckSupported refuses and
// std::runtime_error on an internal failure (e.g. out of memory).
void RunFused(const PlanSpec& spec, const FusedParams& buffers);

}  // namespace jaxfuse::cpu
