// The shared epilogue (kernels/epilogue.h) applied to blocks of float32 results on the CPU.
#pragma once

#include <cstdint>
#include <vector>

#include "common/plan_spec.h"
#include "cpu/fused_cpu.h"

namespace jaxfuse::cpu {

// A block of float32 results, `rows` x `cols`, row r at `values + r * ld`, bound for the output
// at element `offset + r * out_row + c` (columns are contiguous in the output and in the side
// input). The output channel advances either with the rows (a row per channel: NCHW) or with
// the columns (a row per pixel: NHWC). Per-activation batch-norm parameters are contiguous
// along a row too: element (r, c) uses parameter `param + r * param_row + c`.
struct Block {
  float* values;
  int64_t rows, cols, ld;
  int64_t offset, out_row;
  int64_t channel;
  bool channel_per_row;
  int64_t param, param_row;
};

// One operator of the folded chain: v * scale + shift per channel (kAffine) or per parameter
// element (kParamAffine), the side input's add, or the activation.
struct EpilogueStage {
  enum Kind : int { kAffine, kParamAffine, kSideAdd, kActivation } kind;
  const float* scale;
  const float* shift;
};

// The common chains (a per-channel affine, a side add, a simple activation, each optional, in
// that order) in the form a single pass applies: v * scale[c] + shift[c] (+ side_alpha * z),
// then the activation (passthru, relu, clipped_relu, leaky_relu, hardswish or hardsigmoid).
struct SinglePass {
  const float* scale;
  const float* shift;
  bool side;
  int activation;
  float side_alpha, alpha, beta, gamma;
};

// The single-pass form's operands: v = x * scale + shift (per channel), then optionally
// + side_alpha * side, then the activation, then the store, in one loop along each row. Values
// come from the block (a conv tile) or, for a plan without convolution, straight from `input`.
struct FastArgs {
  const float* scale;
  const float* shift;
  const void* input;
  const void* side;
  void* y;
  float side_alpha, alpha, beta, gamma;
};

class Epilogue {
 public:
  // Folds the convolution's alpha, bias and spatial batch norm into one scale and shift per
  // channel wherever they are adjacent in the chain, once per call.
  Epilogue(const PlanSpec& spec, const FusedParams& buffers);

  // Applies the pointwise operators to the block (in place) and stores it into the output.
  void Apply(const Block& block) const;

  // The chain as a single pass, or nullptr when it is not one of the common chains.
  const SinglePass* single_pass() const { return fast_ ? &single_ : nullptr; }

  // Whether ApplyToInput can run this chain (one pass straight from the input to the output).
  bool reads_input() const { return fast_; }
  // For a chain without convolution: Apply to the input elements at the block's output
  // offsets (the output has the input's shape); `values` is not used.
  void ApplyToInput(const Block& block) const;

 private:
  const PlanSpec& spec_;
  const FusedParams& buffers_;
  float scalars_[4];  // side alpha, activation alpha, beta, gamma
  std::vector<EpilogueStage> stages_;
  bool fast_ = false;
  SinglePass single_{};
  std::vector<std::vector<float>> arrays_;  // storage behind the stages' scale and shift
};

}  // namespace jaxfuse::cpu
