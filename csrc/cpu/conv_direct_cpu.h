// The CPU convolution for geometry whose zero-padded input copy would dwarf the tensors (huge
// padding that strides or dilation mostly skip): each output pixel sums only the taps that land
// inside the input, read from the caller's buffer. Its scratch is bounded by the tensors: the
// filters as float32 (the size of w) and a block of output pixels per task.
#pragma once

#include "common/plan_spec.h"
#include "cpu/epilogue_cpu.h"
#include "kernels/params.h"

namespace jaxfuse::cpu {

// Runs the plan's convolution and epilogue into buffers.y.
void RunDirectConvolution(const PlanSpec& spec, const FusedParams& buffers,
                          const Epilogue& epilogue);

}  // namespace jaxfuse::cpu
