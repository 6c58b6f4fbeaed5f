// Decoding and checking the fused call's operands against its plan, shared by the CPU and GPU
// handlers: every buffer's dtype and element count is checked before any kernel touches it.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/plan_spec.h"
#include "kernels/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

struct DecodedOperands {
  static constexpr size_t kMax = 16;  // a chain takes at most 9 (x w bias 4xBN side scalars)
  std::array<const void*, kMax> ptrs{};  // in PlanSpec::operands() order
  size_t count = 0;
  void* out = nullptr;
};

// The call's one attribute, the encoded plan, or an error. Handlers bind the attribute
// dictionary and check it here rather than letting XLA decode a typed attribute: a custom call
// with missing or extra attributes then fails like any other mismatch, with our message.
xla::ffi::Error PlanAttribute(const xla::ffi::Dictionary& attrs, std::string_view* plan);

// The plan the call's attribute names (parsed once per process), or an error naming what is
// wrong with the attributes or the plan.
xla::ffi::Error ParsePlan(const xla::ffi::Dictionary& attrs,
                          std::shared_ptr<const PlanSpec>* spec);

// Fills `decoded` or returns an error naming the operand that does not match the plan, whose
// operands (PlanSpec::operands()) are `expected`. Allocates nothing.
xla::ffi::Error DecodeOperands(const PlanSpec& spec,
                               const std::vector<PlanSpec::Operand>& expected,
                               xla::ffi::RemainingArgs args,
                               xla::ffi::Result<xla::ffi::AnyBuffer> out,
                               DecodedOperands* decoded);

// The decoded buffers as the kernels' parameter block (shared by every backend).
FusedParams BindParams(const PlanSpec& spec, const DecodedOperands& decoded);

}  // namespace jaxfuse
