#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxfuse::cpu {
namespace {

// ParallelFor calls running now. XLA runs independent ops concurrently, one per core when it
// can; once as many calls are in flight as there are threads the cores are taken, and the
// pool's workers step aside (their help would only add contention and polling).
std::atomic<int> in_flight{0};

bool CoresTaken() { return in_flight.load(std::memory_order_relaxed) >= NumThreads(); }

struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
  std::exception_ptr error;  // the first exception a task threw (guarded by mu)

  // Claims and runs indices until none are left (a pool worker stops early when the cores
  // are taken: the calling thread always finishes its job). An exception must not escape a
  // worker thread (that would terminate the process): it is kept and rethrown to the caller.
  void Work(bool worker) {
    int64_t ran = 0;
    while (!(worker && CoresTaken())) {
      const int64_t i = next.fetch_add(1);
      if (i >= n) break;
      try {
        (*fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      ++ran;
    }
    if (ran && done.fetch_add(ran) + ran == n) {
      std::lock_guard<std::mutex> lock(mu);
      finished.notify_all();
    }
  }
};

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(job);
      queued_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->Work(/*worker=*/false);
    // The last indices usually finish on other threads within microseconds: poll before
    // sleeping, so the caller does not pay a wake-up on every call.
    Poll([&] { return job->done.load(std::memory_order_acquire) == n; });
    std::unique_lock<std::mutex> lock(job->mu);
    job->finished.wait(lock, [&] { return job->done.load() == n; });
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  void Loop() {
    while (true) {
      SpinForWork();
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (stop_) return;
        job = jobs_.front();
        // A job leaves the queue once every index is claimed.
        if (job->next.load() >= job->n) {
          Pop();
          continue;
        }
      }
      job->Work(/*worker=*/true);
      std::lock_guard<std::mutex> lock(mu_);
      if (!jobs_.empty() && jobs_.front() == job) Pop();
    }
  }

  // Returns when ready() holds or after kSpinMicros, whichever comes first. Past
  // kYieldAfterMicros it offers its core to other threads between polls: on a machine whose
  // other cores are busy (shared, or a VM's), a worker polling on the core the caller
  // needs, or the caller polling on the one its worker holds, takes the time the other
  // would run in. On a 2-core VM (2026-12-07, scripts/cpu_contention_probe.py) a bf16/fp16
  // ResNet block at batch 1 took 300-340 us a call in some processes instead of 125 us
  // (plain jit: 220-270 us); with the yield, at most 190-230 us.
  template <class Ready>
  static void Poll(Ready ready) {
    const auto start = std::chrono::steady_clock::now();
    const auto until = start + std::chrono::microseconds(kSpinMicros);
    const auto patient = start + std::chrono::microseconds(kYieldAfterMicros);
    for (int i = 1; !ready(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (i % 64 == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now > until) return;
        if (now > patient) std::this_thread::yield();
      }
    }
  }

  // XLA runs a network's layers back to back: a worker that has just finished polls for the
  // next job a little while before it sleeps, which saves the wake-up latency of each call.
  void SpinForWork() const {
    Poll([this] { return queued_.load(std::memory_order_acquire) != 0; });
  }

  void Pop() {
    jobs_.pop_front();
    queued_.fetch_sub(1, std::memory_order_relaxed);
  }

  static constexpr int kSpinMicros = 100;
  static constexpr int kYieldAfterMicros = 20;
  std::atomic<int64_t> queued_{0};  // jobs_.size(), readable without the lock

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> jobs_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

Pool& GlobalPool() {
  // Leaked on purpose: worker threads must outlive static destructors run at exit.
  static Pool* pool = new Pool(std::max(NumThreads() - 1, 0));
  return *pool;
}

}  // namespace

int NumThreads() {
  static const int threads = [] {
    if (const char* env = std::getenv("JAXFUSE_NUM_THREADS")) {
      int value = std::atoi(env);
      if (value > 0) return std::min(value, 1024);
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return threads;
}

void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  // With the cores taken by concurrent calls, this one runs on its own thread.
  const int calls = in_flight.fetch_add(1, std::memory_order_acq_rel) + 1;
  struct Leave {
    ~Leave() { in_flight.fetch_sub(1, std::memory_order_acq_rel); }
  } leave;
  if (n == 1 || NumThreads() == 1 || calls >= NumThreads()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  GlobalPool().Run(n, fn);
}

}  // namespace jaxfuse::cpu
