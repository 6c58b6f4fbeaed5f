// The shared epilogue (kernels/epilogue.h) applied to rows of float32 results on the CPU.
#pragma once

#include <cstdint>
#include <vector>

#include "common/plan_spec.h"
#include "cpu/fused_cpu.h"

namespace jaxfuse::cpu {

// Where a row of `count` results lies: output channel, per-activation parameter index and
// output offset of its first element, and how each advances along the row.
struct RowPlace {
  int64_t channel, channel_step;
  int64_t param, param_step;
  int64_t offset, offset_step;
};

class Epilogue {
 public:
  // Folds batch norm into one scale and shift per parameter element, once per call.
  Epilogue(const PlanSpec& spec, const FusedParams& buffers);

  // Applies the pointwise operators to `values` and stores them into the output.
  void ApplyAndStore(float* values, int64_t count, const RowPlace& place) const;

 private:
  const PlanSpec& spec_;
  const FusedParams& buffers_;
  float conv_alpha_, side_alpha_, act_alpha_, act_beta_, act_gamma_;
  std::vector<float> bn_scale_, bn_shift_;
};

}  // namespace jaxfuse::cpu
