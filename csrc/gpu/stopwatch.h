// Stopwatches on a device's stream: the device time between two points of an XLA program, for
// timing candidate solvers at plan-compile time (jaxfuse/measure.py). A program marks the start
// and the end with the "jaxfuse_stopwatch" custom call (ffi/stopwatch_handler.cc); the host
// reads the elapsed time once the program has run.
//
// The start mark also closes a gate on the stream that the end mark opens (a word in pinned
// host memory the stream waits on, where the driver's stream memory operations work): the device starts the timed work only once the host has
// queued all of it, so the device time is the work's own, not the pace of the host's launches
// (which a whole model hides behind earlier layers). The host's own time between the marks is
// read too: it is what the work costs where nothing hides it (small problems).
#pragma once

#include <cstdint>

#include "gpu/runtime.h"

namespace jaxfuse::gpu {

struct StopwatchReading {
  double device_ms;  // from the start mark to the end mark, on the device
  double host_ms;    // from the start mark's launch to the end mark's, on the host
  bool gated;        // whether the device waited for the end mark (see above)
  bool gate_timed_out;  // the gate opened by itself: the host waited for the device between
                        // the marks (e.g. an allocation that synchronizes); turn gating off
};

// A new stopwatch on device `ordinal`; its id never repeats.
int64_t NewStopwatch(Platform platform, int ordinal);
// Records mark 0 (start) or 1 (end) of stopwatch `id` on `stream`. Throws for an unknown id.
void MarkStopwatch(int64_t id, int mark, void* stream);
// Whether later start marks close the gate (on by default where the driver can).
void SetStopwatchGate(int64_t id, bool enabled);
// The times from the last start mark to the last end mark (waits for the end).
StopwatchReading ReadStopwatch(int64_t id);
void DeleteStopwatch(int64_t id);

}  // namespace jaxfuse::gpu
