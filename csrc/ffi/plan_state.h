// What XLA keeps per fused custom call for an executable's lifetime: the plan, parsed and
// checked once at the FFI instantiate stage, and what the execute stage needs of it, so that
// stage neither parses, looks up by string nor allocates.
#pragma once

#include <memory>
#include <vector>

#include "common/plan_spec.h"
#include "ffi/operands.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

struct PlanState {
  explicit PlanState(std::shared_ptr<const PlanSpec> plan)
      : spec(std::move(plan)), operands(spec->operands()) {}
  std::shared_ptr<const PlanSpec> spec;
  std::vector<PlanSpec::Operand> operands;  // spec->operands(), in call order
};

// The state of a call whose attributes are `attrs` (the plan string), or the error naming
// what is wrong with them. `State` derives from PlanState and holds the type id XLA assigned
// it (each platform's handlers have their own state type: each XLA runtime numbers types).
template <typename State>
xla::ffi::ErrorOr<std::unique_ptr<State>> InstantiatePlan(const xla::ffi::Dictionary& attrs) {
  std::shared_ptr<const PlanSpec> spec;
  if (xla::ffi::Error err = ParsePlan(attrs, &spec); err.failure()) {
    return xla::ffi::Unexpected<xla::ffi::Error>(std::move(err));
  }
  return std::make_unique<State>(std::move(spec));
}

}  // namespace jaxfuse
