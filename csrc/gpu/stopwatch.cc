#include "gpu/stopwatch.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace jaxfuse::gpu {
namespace {

using Clock = std::chrono::steady_clock;
// How long a closed gate waits for its end mark before it opens by itself (a program that
// fails between the marks must not leave XLA's stream held).
// Queuing a timing program takes milliseconds; a host that waits longer is waiting for the
// device, which waits for the gate.
constexpr auto kGateTimeout = std::chrono::milliseconds(250);

class Stopwatch {
 public:
  Stopwatch(Platform platform, int ordinal)
      : driver_(Driver::Get(platform)), ordinal_(ordinal) {
    try {
      events_[0] = driver_.CreateEvent(ordinal);
      events_[1] = driver_.CreateEvent(ordinal);
      if (driver_.StreamGatesWork(ordinal)) {
        gate_host_ = static_cast<volatile uint32_t*>(
            driver_.AllocateMappedHost(ordinal, &gate_device_));
      }
    } catch (...) {
      Release();
      throw;
    }
  }
  ~Stopwatch() { Release(); }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

  // Mark 0: close the gate, then the start event; a watchdog opens the gate if mark 1 never
  // comes. Mark 1: the end event, then open the gate.
  void Mark(int mark, void* stream, const std::shared_ptr<Stopwatch>& self) {
    std::unique_lock<std::mutex> lock(mu_);
    if (mark == 0) {
      OpenLocked();  // a start without an end: never leave an earlier gate closed
      timed_out_ = false, ended_ = false;
      if (gate_host_ != nullptr && gate_enabled_) {
        driver_.WaitValue(ordinal_, stream, gate_device_, generation_ + 1);
        ++generation_;
        open_ = false;
        std::thread([self, generation = generation_] { self->Watch(generation); }).detach();
      }
      driver_.RecordEvent(events_[0], stream);
      host_[0] = Clock::now();
    } else {
      driver_.RecordEvent(events_[1], stream);
      host_[1] = Clock::now();
      gated_ = !open_, ended_ = true;
      OpenLocked();
    }
  }

  void SetGate(bool enabled) {
    std::lock_guard<std::mutex> lock(mu_);
    gate_enabled_ = enabled;
  }

  StopwatchReading Read() {
    Clock::time_point start, end;
    bool gated, timed_out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      start = host_[0], end = host_[1], gated = gated_, timed_out = timed_out_;
    }
    const double device_ms = driver_.ElapsedMs(ordinal_, events_[0], events_[1]);
    return {device_ms, std::chrono::duration<double, std::milli>(end - start).count(), gated,
            timed_out};
  }

 private:
  void Watch(uint32_t generation) noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kGateTimeout, [&] { return open_ || generation_ != generation; });
    if (!open_ && generation_ == generation) {
      timed_out_ = true;
      OpenLocked();
    }
  }

  // A host store to pinned memory: nothing here can fail or wait.
  void OpenLocked() noexcept {
    if (open_) return;
    __atomic_store_n(gate_host_, generation_, __ATOMIC_RELEASE);
    open_ = true;
    cv_.notify_all();
  }

  void Release() noexcept {
    try {
      std::lock_guard<std::mutex> lock(mu_);
      OpenLocked();
      // The device may still be reading the gate word until the end event has passed (or
      // when the last start had no end mark): then the 64 bytes are left behind.
      if (gate_host_ != nullptr && ended_ && driver_.EventDone(events_[1])) {
        driver_.FreeMappedHost(ordinal_, const_cast<uint32_t*>(gate_host_));
      }
      for (void* event : events_) driver_.DestroyEvent(ordinal_, event);
    } catch (...) {  // a broken context: nothing more to release
    }
  }

  const Driver& driver_;
  const int ordinal_;
  void* events_[2] = {nullptr, nullptr};
  volatile uint32_t* gate_host_ = nullptr;  // null where stream gates do not work
  void* gate_device_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t generation_ = 0;
  bool open_ = true;
  bool gate_enabled_ = true;
  bool gated_ = false;
  bool timed_out_ = false;
  bool ended_ = true;  // the last start mark has its end mark
  Clock::time_point host_[2];
};

std::mutex table_mu;
int64_t next_id = 1;
std::map<int64_t, std::shared_ptr<Stopwatch>>& Table() {
  static auto* table = new std::map<int64_t, std::shared_ptr<Stopwatch>>();
  return *table;
}

std::shared_ptr<Stopwatch> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(table_mu);
  auto it = Table().find(id);
  if (it == Table().end()) {
    throw std::invalid_argument("jaxfuse: no stopwatch " + std::to_string(id));
  }
  return it->second;
}

}  // namespace

int64_t NewStopwatch(Platform platform, int ordinal) {
  auto watch = std::make_shared<Stopwatch>(platform, ordinal);
  std::lock_guard<std::mutex> lock(table_mu);
  Table()[next_id] = std::move(watch);
  return next_id++;
}

void MarkStopwatch(int64_t id, int mark, void* stream) {
  if (mark != 0 && mark != 1) throw std::invalid_argument("jaxfuse: stopwatch mark is 0 or 1");
  const std::shared_ptr<Stopwatch> watch = Find(id);
  watch->Mark(mark, stream, watch);
}

void SetStopwatchGate(int64_t id, bool enabled) { Find(id)->SetGate(enabled); }

StopwatchReading ReadStopwatch(int64_t id) { return Find(id)->Read(); }

void DeleteStopwatch(int64_t id) {
  std::shared_ptr<Stopwatch> watch;  // freed here, or by a watchdog still holding it
  std::lock_guard<std::mutex> lock(table_mu);
  auto it = Table().find(id);
  if (it == Table().end()) return;
  watch = std::move(it->second);
  Table().erase(it);
}

}  // namespace jaxfuse::gpu
