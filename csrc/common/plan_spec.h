// PlanSpec: the C++ view of jaxfuse.signature.PlanSignature, parsed from the one string
// attribute every fused custom call carries. Parsing validates everything, so handlers never
// trust Python (or a hand-edited exported module) for sizes they index with.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace jaxfuse {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum class Layout : int { kNCHW = 0, kNHWC = 1 };
enum class FilterLayout : int { kOIHW = 0, kHWIO = 1, kOHWI = 2 };
enum class BnMode : int { kNone = 0, kSpatial = 1, kPerActivation = 2 };
// Pointwise operators after the (optional) convolution, in plan order.
enum class PointwiseOp : char { kBias = 'B', kBatchNorm = 'N', kSideAdd = 'S', kActivation = 'A' };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

struct ConvGeometry {
  int64_t k = 0, r = 1, s = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_t = 0, pad_b = 0, pad_l = 0, pad_r = 0;
  int64_t dil_h = 1, dil_w = 1;
  int64_t groups = 1;
  FilterLayout filter_layout = FilterLayout::kOIHW;
  bool allow_tf32 = true;
};

struct PlanSpec {
  // The plan re-serialized from the parsed fields (jaxfuse.PlanSignature.encode()'s form):
  // the only string form of a plan used in cache keys and generated source. Built from enums
  // and integers, so it holds no byte of the parsed text, and two spellings of one plan (fields
  // in another order, "007" for "7") have one canonical form.
  std::string canonical;
  DType dtype = DType::kF32;
  // The filters' dtype: the plan's, or float32 for a 16-bit plan whose filters are kept in
  // float32 (each is rounded to the plan's dtype as it loads, exactly as a conversion before
  // the convolution would round it, so no separate conversion pass runs on every call).
  DType filter_dtype = DType::kF32;
  Layout layout = Layout::kNCHW;
  // The output's layout (and the side input's and per-activation parameters'): the input's,
  // except in a kernel form of NCHW plans (jaxfuse.solvers.kernel_forms) that reads NHWC input
  // and writes NCHW. Written by the Hopper tensor-core kernels, the stem kernel and the direct
  // kernel (their fallback for misaligned buffers); the host backend refuses it.
  Layout out_layout = Layout::kNCHW;
  int64_t n = 0, c = 0, h = 0, w = 0;
  bool has_conv = false;
  ConvGeometry conv;
  std::vector<PointwiseOp> pointwise;
  BnMode bn = BnMode::kNone;
  int activation = 0;
  // Derived: output channels and spatial size.
  int64_t out_c = 0, out_h = 0, out_w = 0;

  // Throws std::invalid_argument with a message naming the bad field. The grammar is strict:
  // known fields, each at most once, values built only of letters, digits, ',', '-' and '_'.
  static PlanSpec Parse(std::string_view text);

  bool has(PointwiseOp op) const;
  int64_t input_elements() const { return n * c * h * w; }
  int64_t output_elements() const { return n * out_c * out_h * out_w; }
  int64_t filter_elements() const { return conv.k * (c / conv.groups) * conv.r * conv.s; }
  // Whether the filters are float32 while the plan computes in a 16-bit dtype.
  bool wide_filters() const { return has_conv && filter_dtype != dtype; }
  // Whether the output's layout differs from the input's.
  bool mixed_layouts() const { return out_layout != layout; }
  // Elements of one batch-norm parameter array (per channel or per activation).
  int64_t bn_param_elements() const {
    return bn == BnMode::kPerActivation ? out_c * out_h * out_w : out_c;
  }
  // The operands in call order (x, w?, bias?, scale/shift/mean/var?, side?, scalars):
  // element counts and whether each has the plan's dtype (else float32; the filters have
  // filter_dtype).
  struct Operand {
    const char* name;
    int64_t elements;
    bool plan_dtype;
  };
  std::vector<Operand> operands() const;
};

}  // namespace jaxfuse
