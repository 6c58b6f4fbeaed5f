// Decoding and checking the fused call's operands against its plan, shared by the CPU and GPU
// handlers: every buffer's dtype and element count is checked before any kernel touches it.
#pragma once

#include <string>
#include <vector>

#include "common/plan_spec.h"
#include "kernels/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

struct DecodedOperands {
  std::vector<const void*> ptrs;  // in PlanSpec::operands() order
  void* out = nullptr;
};

// Fills `decoded` or returns an error naming the operand that does not match the plan.
xla::ffi::Error DecodeOperands(const PlanSpec& spec, xla::ffi::RemainingArgs args,
                               xla::ffi::Result<xla::ffi::AnyBuffer> out,
                               DecodedOperands* decoded);

// The decoded buffers as the kernels' parameter block (shared by every backend).
FusedParams BindParams(const PlanSpec& spec, const DecodedOperands& decoded);

}  // namespace jaxfuse
