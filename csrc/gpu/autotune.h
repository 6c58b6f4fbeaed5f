// Autotuning at plan-compile time: every variant (tile configuration) of a plan's kernel runs
// on the device on random inputs of the plan's shapes; the fastest whose output agrees with
// variant 0's (the heuristic's choice) wins. A variant that computes something else can never
// be chosen, however fast.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "common/plan_spec.h"
#include "gpu/codegen.h"
#include "gpu/runtime.h"

namespace jaxfuse::gpu {

struct TuningResult {
  int best = 0;                    // variant index
  std::vector<double> ms;          // per variant; < 0 when it failed or disagreed
};

// `binaries[i]` is variant i compiled ("" if it failed to compile). Throws std::runtime_error
// when the device cannot run the measurement (e.g. out of memory); the caller then keeps 0.
TuningResult Autotune(Platform platform, const PlanSpec& spec, int ordinal,
                      const std::vector<GeneratedKernel>& variants,
                      const std::vector<std::string>& binaries);

// JAXFUSE_AUTOTUNE=0 turns autotuning off (variant 0 is used).
bool AutotuneEnabled();

// Held while anything in this process times work on a device (the variant autotuner here, the
// solver chooser in Python): concurrent plan compilations must not share the GPU while one of
// them measures, or each would time the other's kernels too. Timed: the autotuner waits at
// most a few seconds for it, so a holder that needs a kernel tuned can never deadlock.
std::timed_mutex& DeviceTimingMutex();

// Seconds the autotuner has waited for DeviceTimingMutex on the calling thread, in all: a
// plan's compile tells its own wait for a measurement that held the device (Python's find
// step compiles XLA's candidate beside the fused kernel's compile) from the kernel's work.
double ThreadTimingWaitSeconds();

}  // namespace jaxfuse::gpu
