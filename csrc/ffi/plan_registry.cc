#include "ffi/plan_registry.h"

#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

namespace jaxfuse {

std::shared_ptr<const PlanSpec> LookupPlan(std::string_view text) {
  static std::shared_mutex mu;
  static auto* plans = new std::unordered_map<std::string, std::shared_ptr<const PlanSpec>>();
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = plans->find(std::string(text));
    if (it != plans->end()) return it->second;
  }
  auto parsed = std::make_shared<const PlanSpec>(PlanSpec::Parse(text));
  std::unique_lock<std::shared_mutex> lock(mu);
  return plans->emplace(std::string(text), std::move(parsed)).first->second;
}

}  // namespace jaxfuse
