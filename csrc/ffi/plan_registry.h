// Parsed plans, memoized by their signature string: a handler parses each plan once per
// process, however many times it runs.
#pragma once

#include <memory>
#include <string_view>

#include "common/plan_spec.h"

namespace jaxfuse {

// Returns the parsed plan for `text`; throws std::invalid_argument for a malformed one.
std::shared_ptr<const PlanSpec> LookupPlan(std::string_view text);

}  // namespace jaxfuse
