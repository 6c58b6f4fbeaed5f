#include "cpu/epilogue_cpu.h"

#include "cpu/convert.h"
#include "kernels/epilogue.h"

namespace jaxfuse::cpu {
namespace {

template <int Mode>
void ActivateRow(float* v, int64_t count, float a, float b, float g) {
  for (int64_t i = 0; i < count; ++i) v[i] = activate<Mode>(v[i], a, b, g);
}

void ActivateRowDispatch(int mode, float* v, int64_t count, float a, float b, float g) {
  switch (mode) {
    case kLogistic: return ActivateRow<kLogistic>(v, count, a, b, g);
    case kTanh: return ActivateRow<kTanh>(v, count, a, b, g);
    case kRelu: return ActivateRow<kRelu>(v, count, a, b, g);
    case kSoftrelu: return ActivateRow<kSoftrelu>(v, count, a, b, g);
    case kAbs: return ActivateRow<kAbs>(v, count, a, b, g);
    case kPower: return ActivateRow<kPower>(v, count, a, b, g);
    case kClippedRelu: return ActivateRow<kClippedRelu>(v, count, a, b, g);
    case kLeakyRelu: return ActivateRow<kLeakyRelu>(v, count, a, b, g);
    case kElu: return ActivateRow<kElu>(v, count, a, b, g);
    default: return;
  }
}

}  // namespace

Epilogue::Epilogue(const PlanSpec& spec, const FusedParams& buffers)
    : spec_(spec), buffers_(buffers) {
  const float* s = buffers.scalars;
  conv_alpha_ = s[kConvAlpha];
  side_alpha_ = s[kSideAlpha];
  act_alpha_ = s[kActAlpha];
  act_beta_ = s[kActBeta];
  act_gamma_ = s[kActGamma];
  if (spec.has(PointwiseOp::kBatchNorm)) {
    const int64_t n = spec.bn_param_elements();
    bn_scale_.resize(n);
    bn_shift_.resize(n);
    const float eps = s[kBnEpsilon];
    for (int64_t i = 0; i < n; ++i) {
      bn_scale_[i] = bn_fold_scale(buffers.bn_scale[i], buffers.bn_var[i], eps);
      bn_shift_[i] = bn_fold_shift(buffers.bn_shift[i], buffers.bn_mean[i], bn_scale_[i]);
    }
  }
}

void Epilogue::ApplyAndStore(float* v, int64_t count, const RowPlace& p) const {
  if (spec_.has_conv && conv_alpha_ != 1.0f) {
    for (int64_t i = 0; i < count; ++i) v[i] *= conv_alpha_;
  }
  for (PointwiseOp op : spec_.pointwise) {
    switch (op) {
      case PointwiseOp::kBias: {
        const float* b = buffers_.bias;
        for (int64_t i = 0; i < count; ++i) v[i] += b[p.channel + i * p.channel_step];
        break;
      }
      case PointwiseOp::kBatchNorm: {
        const bool per_channel = spec_.bn == BnMode::kSpatial;
        const int64_t base = per_channel ? p.channel : p.param;
        const int64_t step = per_channel ? p.channel_step : p.param_step;
        for (int64_t i = 0; i < count; ++i) {
          v[i] = v[i] * bn_scale_[base + i * step] + bn_shift_[base + i * step];
        }
        break;
      }
      case PointwiseOp::kSideAdd:
        for (int64_t i = 0; i < count; ++i) {
          v[i] += side_alpha_ *
                  LoadAsFloat(buffers_.side, p.offset + i * p.offset_step, spec_.dtype);
        }
        break;
      case PointwiseOp::kActivation:
        ActivateRowDispatch(spec_.activation, v, count, act_alpha_, act_beta_, act_gamma_);
        break;
    }
  }
  if (p.offset_step == 1) {
    switch (spec_.dtype) {
      case DType::kF32: {
        float* y = static_cast<float*>(buffers_.y) + p.offset;
        for (int64_t i = 0; i < count; ++i) y[i] = v[i];
        return;
      }
      case DType::kF16: {
        uint16_t* y = static_cast<uint16_t*>(buffers_.y) + p.offset;
        for (int64_t i = 0; i < count; ++i) y[i] = FloatToHalf(v[i]);
        return;
      }
      case DType::kBF16: {
        uint16_t* y = static_cast<uint16_t*>(buffers_.y) + p.offset;
        for (int64_t i = 0; i < count; ++i) y[i] = FloatToBf16(v[i]);
        return;
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    StoreFromFloat(buffers_.y, p.offset + i * p.offset_step, spec_.dtype, v[i]);
  }
}

}  // namespace jaxfuse::cpu
