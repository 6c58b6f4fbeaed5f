#include "ffi/plan_registry.h"

#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

namespace jaxfuse {

// The process-wide registry behind LookupPlan's per-thread cache.
std::shared_ptr<const PlanSpec> LookupShared(std::string_view text);

std::shared_ptr<const PlanSpec> LookupPlan(std::string_view text) {
  // Per thread, by the address of the attribute's characters (stable for an executable's
  // lifetime; the contents are compared too, in case the memory was reused): no allocation or
  // string hashing on the execute path.
  struct Recent {
    std::string text;
    std::shared_ptr<const PlanSpec> spec;
  };
  thread_local std::unordered_map<const char*, Recent> recent;
  if (auto it = recent.find(text.data()); it != recent.end() && it->second.text == text) {
    return it->second.spec;
  }
  if (recent.size() > 4096) recent.clear();
  auto spec = LookupShared(text);
  recent[text.data()] = {std::string(text), spec};
  return spec;
}

std::shared_ptr<const PlanSpec> LookupShared(std::string_view text) {
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
