// The CPU backend: one pass over the output, the epilogue applied to each tile of results in
// registers / L1 before its single store.
#pragma once

#include "common/plan_spec.h"
#include "kernels/params.h"

namespace jaxfuse::cpu {

// Why the CPU backend cannot run the plan (a GPU kernel form: mixed layouts), or nullptr.
const char* Refuses(const PlanSpec& spec);

// Which CPU code runs the plan, for kernel_info: "cpu" (the implicit GEMM, or a pass over the
// input without a convolution) or "cpu_direct" (conv_direct_cpu.h). Every plan it does not
// refuse has one.
const char* SolverName(const PlanSpec& spec);

// Runs the plan. Throws std::runtime_error on an internal failure (e.g. out of memory).
void RunFused(const PlanSpec& spec, const FusedParams& buffers);

}  // namespace jaxfuse::cpu
