// Stopwatches on a device's stream: the device time between two points of an XLA program, for
// timing candidate solvers at plan-compile time (jaxfuse/measure.py). A program marks the start
// and the end with the "jaxfuse_stopwatch" custom call (ffi/stopwatch_handler.cc); the host
// reads the elapsed time once the program has run. Host work and launch latency before the
// first mark are not counted, so a few-microsecond kernel is timed as well as a long one.
#pragma once

#include <cstdint>

#include "gpu/runtime.h"

namespace jaxfuse::gpu {

// A new stopwatch on device `ordinal` (two timing events); its id never repeats.
int64_t NewStopwatch(Platform platform, int ordinal);
// Records mark 0 (start) or 1 (end) of stopwatch `id` on `stream`. Throws for an unknown id.
void MarkStopwatch(int64_t id, int mark, void* stream);
// Milliseconds from the last start mark to the last end mark (waits for the end).
double ReadStopwatch(int64_t id);
void DeleteStopwatch(int64_t id);

}  // namespace jaxfuse::gpu
