// A process-wide pool of worker threads for the CPU kernels. Several XLA threads may call
// ParallelFor at once; each call's own thread takes part in its work, so calls never wait on
// each other to make progress.
#pragma once

#include <cstdint>
#include <functional>

namespace jaxfuse::cpu {

// Threads the CPU kernels use: $JAXFUSE_NUM_THREADS, else the machine's hardware threads.
int NumThreads();

// Runs fn(i) for every i in [0, n), spread over the pool; returns when all are done, and
// then rethrows the first exception any fn(i) threw.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace jaxfuse::cpu
