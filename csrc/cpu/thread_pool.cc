#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
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

struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
  std::exception_ptr error;  // the first exception a task threw (guarded by mu)

  // Claims and runs indices until none are left. An exception must not escape a worker
  // thread (that would terminate the process): it is kept and rethrown to the caller.
  void Work() {
    int64_t ran = 0;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
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
    }
    wake_.notify_all();
    job->Work();
    std::unique_lock<std::mutex> lock(job->mu);
    job->finished.wait(lock, [&] { return job->done.load() == n; });
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  void Loop() {
    while (true) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (stop_) return;
        job = jobs_.front();
        // A job leaves the queue once every index is claimed.
        if (job->next.load() >= job->n) {
          jobs_.pop_front();
          continue;
        }
      }
      job->Work();
      std::lock_guard<std::mutex> lock(mu_);
      if (!jobs_.empty() && jobs_.front() == job) jobs_.pop_front();
    }
  }

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
  if (n == 1 || NumThreads() == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  GlobalPool().Run(n, fn);
}

}  // namespace jaxfuse::cpu
