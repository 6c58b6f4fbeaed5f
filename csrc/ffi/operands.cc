#include "ffi/operands.h"

#include <stdexcept>

#include "ffi/plan_registry.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

namespace {

ffi::DataType PlanDataType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ffi::DataType::F32;
    case DType::kF16: return ffi::DataType::F16;
    case DType::kBF16: return ffi::DataType::BF16;
  }
  return ffi::DataType::INVALID;
}

ffi::Error Mismatch(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxfuse fused chain: " + what);
}

}  // namespace

ffi::Error PlanAttribute(const ffi::Dictionary& attrs, std::string_view* plan) {
  // 'uses_pdl' is XLA's: a command buffer may start the kernel before the previous one ends
  // (each kernel waits for it first: portable.h, await_previous_kernel).
  const size_t expected = 1 + (attrs.contains("uses_pdl") ? 1 : 0);
  if (attrs.size() != expected || !attrs.contains("plan")) {
    std::string names;
    for (std::string_view name : attrs) names += (names.empty() ? " " : ", ") + std::string(name);
    return Mismatch("the custom call takes the attribute 'plan' (and XLA's 'uses_pdl'); got " +
                    std::to_string(attrs.size()) + " attributes" + names);
  }
  if (expected == 2 && attrs.get<bool>("uses_pdl").has_error()) {
    return Mismatch("the attribute 'uses_pdl' must be a bool");
  }
  auto value = attrs.get<std::string_view>("plan");
  if (value.has_error()) return Mismatch("the attribute 'plan' must be a string");
  *plan = *value;
  return ffi::Error::Success();
}

ffi::Error ParsePlan(const ffi::Dictionary& attrs, std::shared_ptr<const PlanSpec>* spec) {
  std::string_view plan;
  if (ffi::Error err = PlanAttribute(attrs, &plan); err.failure()) return err;
  try {
    *spec = LookupPlan(plan);
  } catch (const std::invalid_argument& e) {  // a malformed plan
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  }
  return ffi::Error::Success();
}

ffi::Error DecodeOperands(const PlanSpec& spec, const std::vector<PlanSpec::Operand>& expected,
                          ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out,
                          DecodedOperands* decoded) {
  if (args.size() != expected.size() || expected.size() > DecodedOperands::kMax) {
    return Mismatch("the plan takes " + std::to_string(expected.size()) + " operands, got " +
                    std::to_string(args.size()));
  }
  const ffi::DataType plan_type = PlanDataType(spec.dtype);
  decoded->count = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return Mismatch(std::string(expected[i].name) + " is not a buffer");
    const ffi::DataType want = expected[i].plan_dtype ? plan_type : ffi::DataType::F32;
    if (buffer->element_type() != want) {
      return Mismatch(std::string(expected[i].name) + " has the wrong dtype");
    }
    if (static_cast<int64_t>(buffer->element_count()) != expected[i].elements) {
      return Mismatch(std::string(expected[i].name) + " has " +
                      std::to_string(buffer->element_count()) + " elements, expected " +
                      std::to_string(expected[i].elements));
    }
    decoded->ptrs[decoded->count++] = buffer->untyped_data();
  }
  if (out->element_type() != plan_type ||
      static_cast<int64_t>(out->element_count()) != spec.output_elements()) {
    return Mismatch("the output buffer does not match the plan");
  }
  decoded->out = out->untyped_data();
  return ffi::Error::Success();
}

FusedParams BindParams(const PlanSpec& spec, const DecodedOperands& d) {
  FusedParams b{};
  size_t i = 0;
  b.x = d.ptrs[i++];
  if (spec.has_conv) b.w = d.ptrs[i++];
  for (PointwiseOp op : spec.pointwise) {
    switch (op) {
      case PointwiseOp::kBias: b.bias = static_cast<const float*>(d.ptrs[i++]); break;
      case PointwiseOp::kBatchNorm:
        b.bn_scale = static_cast<const float*>(d.ptrs[i++]);
        b.bn_shift = static_cast<const float*>(d.ptrs[i++]);
        b.bn_mean = static_cast<const float*>(d.ptrs[i++]);
        b.bn_var = static_cast<const float*>(d.ptrs[i++]);
        break;
      case PointwiseOp::kSideAdd: b.side = d.ptrs[i++]; break;
      case PointwiseOp::kActivation: break;
    }
  }
  b.scalars = static_cast<const float*>(d.ptrs[i++]);
  b.y = d.out;
  return b;
}

}  // namespace jaxfuse
