// Decoding and checking the fused call's operands against its plan, shared by the CPU and GPU
// handlers: every buffer's dtype and element count is checked before any kernel touches it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/plan_spec.h"
#include "kernels/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

struct DecodedOperands {
  std::vector<const void*> ptrs;  // in PlanSpec::operands() order
  void* out = nullptr;
};

// The call's one attribute, the encoded plan, or an error. Handlers bind the attribute
// dictionary and check it here rather than letting XLA decode a typed attribute: a custom call
// with missing or extra attributes then fails like any other mismatch, with our message.
xla::ffi::Error PlanAttribute(const xla::ffi::Dictionary& attrs, std::string_view* plan);

// Fills `decoded` or returns an error naming the operand that does not match the plan.
xla::ffi::Error DecodeOperands(const PlanSpec& spec, xla::ffi::RemainingArgs args,
                               xla::ffi::Result<xla::ffi::AnyBuffer> out,
                               DecodedOperands* decoded);

// What an execute-stage handler needs: the plan named by the call's attribute (parsed once per
// process) and its operands, checked against it. Throws std::invalid_argument for a malformed
// plan; returns an error for a mismatched call.
xla::ffi::Error DecodeCall(const xla::ffi::Dictionary& attrs, xla::ffi::RemainingArgs args,
                           xla::ffi::Result<xla::ffi::AnyBuffer> out,
                           std::shared_ptr<const PlanSpec>* spec, DecodedOperands* decoded);

// The decoded buffers as the kernels' parameter block (shared by every backend).
FusedParams BindParams(const PlanSpec& spec, const DecodedOperands& decoded);

}  // namespace jaxfuse
