// The CPU convolution: an implicit GEMM over a float32 NHWC view of the input, register tiles
// of output pixels x output channels, the epilogue applied to each tile before its one store.
#pragma once

#include "common/plan_spec.h"
#include "cpu/epilogue_cpu.h"
#include "kernels/params.h"

namespace jaxfuse::cpu {

// Whether the convolution reads a zero-padded float32 copy of the input (the implicit GEMM
// below). Not where that copy would be far larger than x, w and y together (huge padding that
// strides or dilation mostly skip): those run RunDirectConvolution (conv_direct_cpu.h), whose
// scratch is bounded by the tensors.
bool UsesPaddedCopy(const PlanSpec& spec);

// Runs the plan's convolution and epilogue into buffers.y.
void RunConvolution(const PlanSpec& spec, const FusedParams& buffers, const Epilogue& epilogue);

}  // namespace jaxfuse::cpu
