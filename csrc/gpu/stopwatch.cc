#include "gpu/stopwatch.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace jaxfuse::gpu {
namespace {

struct Stopwatch {
  Platform platform;
  int ordinal;
  void* events[2];
};

std::mutex mu;
int64_t next_id = 1;
std::map<int64_t, Stopwatch>& Table() {
  static auto* table = new std::map<int64_t, Stopwatch>();
  return *table;
}

Stopwatch Find(int64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = Table().find(id);
  if (it == Table().end()) {
    throw std::invalid_argument("jaxfuse: no stopwatch " + std::to_string(id));
  }
  return it->second;
}

}  // namespace

int64_t NewStopwatch(Platform platform, int ordinal) {
  const Driver& driver = Driver::Get(platform);
  Stopwatch watch{platform, ordinal, {driver.CreateEvent(ordinal), nullptr}};
  try {
    watch.events[1] = driver.CreateEvent(ordinal);
  } catch (...) {
    driver.DestroyEvent(ordinal, watch.events[0]);
    throw;
  }
  std::lock_guard<std::mutex> lock(mu);
  Table()[next_id] = watch;
  return next_id++;
}

void MarkStopwatch(int64_t id, int mark, void* stream) {
  if (mark != 0 && mark != 1) throw std::invalid_argument("jaxfuse: stopwatch mark is 0 or 1");
  const Stopwatch watch = Find(id);
  Driver::Get(watch.platform).RecordEvent(watch.events[mark], stream);
}

double ReadStopwatch(int64_t id) {
  const Stopwatch watch = Find(id);
  return Driver::Get(watch.platform).ElapsedMs(watch.ordinal, watch.events[0], watch.events[1]);
}

void DeleteStopwatch(int64_t id) {
  Stopwatch watch;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = Table().find(id);
    if (it == Table().end()) return;
    watch = it->second;
    Table().erase(it);
  }
  const Driver& driver = Driver::Get(watch.platform);
  for (void* event : watch.events) driver.DestroyEvent(watch.ordinal, event);
}

}  // namespace jaxfuse::gpu
