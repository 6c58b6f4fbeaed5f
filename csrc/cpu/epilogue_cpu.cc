#include "cpu/epilogue_cpu.h"

#include <algorithm>

#include "cpu/convert.h"
#include "cpu/multiversion.h"
#include "cpu/pass16.h"
#include "kernels/epilogue.h"

namespace jaxfuse::cpu {
namespace {

// Each pass below runs over a whole block with its inner loop along a row, so the compiler
// vectorizes it; a block is small enough (a register tile, or a few KiB) to stay in L1.

JF_ALWAYS_INLINE void AffineBlock(const Block& b, const float* scale, const float* shift) {
  for (int64_t r = 0; r < b.rows; ++r) {
    float* __restrict v = b.values + r * b.ld;
    if (b.channel_per_row) {
      const float s = scale[b.channel + r], t = shift[b.channel + r];
      for (int64_t c = 0; c < b.cols; ++c) v[c] = v[c] * s + t;
    } else {
      const float* __restrict s = scale + b.channel;
      const float* __restrict t = shift + b.channel;
      for (int64_t c = 0; c < b.cols; ++c) v[c] = v[c] * s[c] + t[c];
    }
  }
}

JF_ALWAYS_INLINE void ParamAffineBlock(const Block& b, const float* scale, const float* shift) {
  for (int64_t r = 0; r < b.rows; ++r) {
    float* __restrict v = b.values + r * b.ld;
    const float* __restrict s = scale + b.param + r * b.param_row;
    const float* __restrict t = shift + b.param + r * b.param_row;
    for (int64_t c = 0; c < b.cols; ++c) v[c] = v[c] * s[c] + t[c];
  }
}

JF_ALWAYS_INLINE void SideAddBlock(const Block& b, const void* side, DType dtype, float alpha) {
  for (int64_t r = 0; r < b.rows; ++r) {
    float* __restrict v = b.values + r * b.ld;
    const int64_t at = b.offset + r * b.out_row;
    switch (dtype) {
      case DType::kF32: {
        const float* __restrict z = static_cast<const float*>(side) + at;
        for (int64_t c = 0; c < b.cols; ++c) v[c] += alpha * z[c];
        break;
      }
      case DType::kF16: {
        const uint16_t* __restrict z = static_cast<const uint16_t*>(side) + at;
        for (int64_t c = 0; c < b.cols; ++c) v[c] += alpha * HalfToFloatSelect(z[c]);
        break;
      }
      case DType::kBF16: {
        const uint16_t* __restrict z = static_cast<const uint16_t*>(side) + at;
        for (int64_t c = 0; c < b.cols; ++c) v[c] += alpha * Bf16ToFloat(z[c]);
        break;
      }
    }
  }
}

template <int Mode>
JF_ALWAYS_INLINE void ActivateBlock(const Block& b, float alpha, float beta, float gamma) {
  for (int64_t r = 0; r < b.rows; ++r) {
    float* __restrict v = b.values + r * b.ld;
    for (int64_t c = 0; c < b.cols; ++c) v[c] = activate<Mode>(v[c], alpha, beta, gamma);
  }
}

JF_ALWAYS_INLINE void ActivateBlockDispatch(int mode, const Block& b, float alpha, float beta,
                                            float gamma) {
  switch (mode) {
    case kLogistic: return ActivateBlock<kLogistic>(b, alpha, beta, gamma);
    case kTanh: return ActivateBlock<kTanh>(b, alpha, beta, gamma);
    case kRelu: return ActivateBlock<kRelu>(b, alpha, beta, gamma);
    case kSoftrelu: return ActivateBlock<kSoftrelu>(b, alpha, beta, gamma);
    case kAbs: return ActivateBlock<kAbs>(b, alpha, beta, gamma);
    case kPower: return ActivateBlock<kPower>(b, alpha, beta, gamma);
    case kClippedRelu: return ActivateBlock<kClippedRelu>(b, alpha, beta, gamma);
    case kLeakyRelu: return ActivateBlock<kLeakyRelu>(b, alpha, beta, gamma);
    case kElu: return ActivateBlock<kElu>(b, alpha, beta, gamma);
    case kSilu: return ActivateBlock<kSilu>(b, alpha, beta, gamma);
    case kGelu: return ActivateBlock<kGelu>(b, alpha, beta, gamma);
    case kGeluTanh: return ActivateBlock<kGeluTanh>(b, alpha, beta, gamma);
    case kHardswish: return ActivateBlock<kHardswish>(b, alpha, beta, gamma);
    case kHardsigmoid: return ActivateBlock<kHardsigmoid>(b, alpha, beta, gamma);
    case kMish: return ActivateBlock<kMish>(b, alpha, beta, gamma);
    default: return;
  }
}

JF_MULTIVERSION void ApplyStages(const Block& b, const EpilogueStage* stages, int count,
                                 const PlanSpec& spec, const FusedParams& buffers,
                                 const float* scalars) {
  for (int i = 0; i < count; ++i) {
    const EpilogueStage& st = stages[i];
    switch (st.kind) {
      case EpilogueStage::kAffine: AffineBlock(b, st.scale, st.shift); break;
      case EpilogueStage::kParamAffine: ParamAffineBlock(b, st.scale, st.shift); break;
      case EpilogueStage::kSideAdd: SideAddBlock(b, buffers.side, spec.dtype, scalars[0]); break;
      default:
        ActivateBlockDispatch(spec.activation, b, scalars[1], scalars[2], scalars[3]);
        break;
    }
  }
  for (int64_t r = 0; r < b.rows; ++r) {
    StoreRow(b.values + r * b.ld, b.cols, spec.dtype, buffers.y, b.offset + r * b.out_row);
  }
}

template <DType D>
JF_ALWAYS_INLINE float LoadElement(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) return static_cast<const float*>(base)[i];
  if constexpr (D == DType::kF16) return HalfToFloatSelect(static_cast<const uint16_t*>(base)[i]);
  if constexpr (D == DType::kBF16) return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
  return 0.0f;
}

template <DType D>
JF_ALWAYS_INLINE void StoreElement(void* base, int64_t i, float v) {
  if constexpr (D == DType::kF32) static_cast<float*>(base)[i] = v;
  if constexpr (D == DType::kF16) static_cast<uint16_t*>(base)[i] = FloatToHalfSelect(v);
  if constexpr (D == DType::kBF16) static_cast<uint16_t*>(base)[i] = FloatToBf16Select(v);
}

template <DType D, bool kFromInput, bool kSide, int kAct, bool kChannelPerRow>
JF_ALWAYS_INLINE void FastRow(const float* __restrict v, int64_t at, int64_t cols,
                              const float* __restrict scale, const float* __restrict shift,
                              const FastArgs& f) {
  const void* __restrict input = f.input;
  const void* __restrict side = f.side;
  void* __restrict y = f.y;
  const float s0 = scale[0], t0 = shift[0];
  for (int64_t c = 0; c < cols; ++c) {
    float x = kFromInput ? LoadElement<D>(input, at + c) : v[c];
    x = kChannelPerRow ? x * s0 + t0 : x * scale[c] + shift[c];
    if (kSide) x += f.side_alpha * LoadElement<D>(side, at + c);
    StoreElement<D>(y, at + c, activate<kAct>(x, f.alpha, f.beta, f.gamma));
  }
}

// The same for float16, through float32 chunks (converted with F16C where there is).
template <bool kFromInput, bool kSide, int kAct, bool kChannelPerRow>
JF_ALWAYS_INLINE void FastRowHalf(const float* __restrict v, int64_t at, int64_t cols,
                                  const float* __restrict scale, const float* __restrict shift,
                                  const FastArgs& f) {
  constexpr int64_t kChunk = 512;
  alignas(64) float in[kChunk], side[kChunk], out[kChunk];
  const float s0 = scale[0], t0 = shift[0];
  for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
    const int64_t len = std::min(kChunk, cols - c0);
    const float* x = v + c0;
    if (kFromInput) {
      HalfRowToFloat(static_cast<const uint16_t*>(f.input) + at + c0, len, in);
      x = in;
    }
    if (kSide) HalfRowToFloat(static_cast<const uint16_t*>(f.side) + at + c0, len, side);
    for (int64_t c = 0; c < len; ++c) {
      float u = kChannelPerRow ? x[c] * s0 + t0 : x[c] * scale[c0 + c] + shift[c0 + c];
      if (kSide) u += f.side_alpha * side[c];
      out[c] = activate<kAct>(u, f.alpha, f.beta, f.gamma);
    }
    FloatRowToHalf(out, len, static_cast<uint16_t*>(f.y) + at + c0);
  }
}

template <DType D, bool kFromInput, bool kSide, int kAct, bool kChannelPerRow>
JF_ALWAYS_INLINE void FastRowAny(const float* v, int64_t at, int64_t cols, const float* scale,
                                 const float* shift, const FastArgs& f) {
  if constexpr (D == DType::kF16) {
    FastRowHalf<kFromInput, kSide, kAct, kChannelPerRow>(v, at, cols, scale, shift, f);
  } else {
    FastRow<D, kFromInput, kSide, kAct, kChannelPerRow>(v, at, cols, scale, shift, f);
  }
}

// float16 rows that lie back to back in the output (a block of whole NHWC pixels, or of NCHW
// planes) are converted several at a time: one conversion call per ~512 elements, not per row.
template <bool kFromInput, bool kSide, int kAct>
JF_ALWAYS_INLINE void FastRowsHalfPacked(const Block& b, const FastArgs& f) {
  constexpr int64_t kChunk = 512;
  alignas(64) float in[kChunk], side[kChunk], res[kChunk];
  const int64_t group = std::max<int64_t>(1, kChunk / b.cols);
  for (int64_t r0 = 0; r0 < b.rows; r0 += group) {
    const int64_t nr = std::min(group, b.rows - r0), len = nr * b.cols;
    const int64_t at = b.offset + r0 * b.out_row;
    if (kFromInput) HalfRowToFloat(static_cast<const uint16_t*>(f.input) + at, len, in);
    if (kSide) HalfRowToFloat(static_cast<const uint16_t*>(f.side) + at, len, side);
    for (int64_t r = 0; r < nr; ++r) {
      const float* x = kFromInput ? in + r * b.cols : b.values + (r0 + r) * b.ld;
      const float* z = side + r * b.cols;
      float* o = res + r * b.cols;
      if (b.channel_per_row) {
        const float s0 = f.scale[b.channel + r0 + r], t0 = f.shift[b.channel + r0 + r];
        for (int64_t c = 0; c < b.cols; ++c) {
          float u = x[c] * s0 + t0;
          if (kSide) u += f.side_alpha * z[c];
          o[c] = activate<kAct>(u, f.alpha, f.beta, f.gamma);
        }
      } else {
        const float* sc = f.scale + b.channel;
        const float* sh = f.shift + b.channel;
        for (int64_t c = 0; c < b.cols; ++c) {
          float u = x[c] * sc[c] + sh[c];
          if (kSide) u += f.side_alpha * z[c];
          o[c] = activate<kAct>(u, f.alpha, f.beta, f.gamma);
        }
      }
    }
    FloatRowToHalf(res, len, static_cast<uint16_t*>(f.y) + at);
  }
}

template <DType D, bool kFromInput, bool kSide, int kAct>
JF_ALWAYS_INLINE void FastRows(const Block& b, const FastArgs& f) {
  if constexpr (D == DType::kF16) {
    if (b.out_row == b.cols && b.cols <= 256) {
      return FastRowsHalfPacked<kFromInput, kSide, kAct>(b, f);
    }
  }
  for (int64_t r = 0; r < b.rows; ++r) {
    const int64_t at = b.offset + r * b.out_row;
    const float* v = b.values + r * b.ld;
    if (b.channel_per_row) {
      FastRowAny<D, kFromInput, kSide, kAct, true>(v, at, b.cols, f.scale + b.channel + r,
                                                   f.shift + b.channel + r, f);
    } else {
      FastRowAny<D, kFromInput, kSide, kAct, false>(v, at, b.cols, f.scale + b.channel,
                                                    f.shift + b.channel, f);
    }
  }
}

template <DType D, bool kFromInput>
JF_ALWAYS_INLINE void FastDispatch(const Block& b, const FastArgs& f, bool side, int act) {
  switch (act + (side ? kNumActivationModes : 0)) {
    case kPassthru: return FastRows<D, kFromInput, false, kPassthru>(b, f);
    case kRelu: return FastRows<D, kFromInput, false, kRelu>(b, f);
    case kClippedRelu: return FastRows<D, kFromInput, false, kClippedRelu>(b, f);
    case kLeakyRelu: return FastRows<D, kFromInput, false, kLeakyRelu>(b, f);
    case kHardswish: return FastRows<D, kFromInput, false, kHardswish>(b, f);
    case kHardsigmoid: return FastRows<D, kFromInput, false, kHardsigmoid>(b, f);
    case kNumActivationModes + kPassthru: return FastRows<D, kFromInput, true, kPassthru>(b, f);
    case kNumActivationModes + kRelu: return FastRows<D, kFromInput, true, kRelu>(b, f);
    case kNumActivationModes + kClippedRelu:
      return FastRows<D, kFromInput, true, kClippedRelu>(b, f);
    case kNumActivationModes + kLeakyRelu: return FastRows<D, kFromInput, true, kLeakyRelu>(b, f);
    case kNumActivationModes + kHardswish: return FastRows<D, kFromInput, true, kHardswish>(b, f);
    case kNumActivationModes + kHardsigmoid:
      return FastRows<D, kFromInput, true, kHardsigmoid>(b, f);
    default: return;
  }
}

// The branch-free activations (selects, adds, multiplies, a division): their loops vectorize.
// conv_cpu.cc's register-tile store (ActivateVec) handles exactly these too.
bool IsFastActivation(int mode) {
  return mode == kPassthru || mode == kRelu || mode == kClippedRelu || mode == kLeakyRelu ||
         mode == kHardswish || mode == kHardsigmoid;
}

JF_MULTIVERSION void FastApply(const Block& b, const FastArgs& f, DType dtype, bool from_input,
                               bool side, int act) {
  if (dtype != DType::kF32 && Pass16(b, f, dtype, from_input, side, act)) return;
  switch (dtype) {
    case DType::kF32:
      return from_input ? FastDispatch<DType::kF32, true>(b, f, side, act)
                        : FastDispatch<DType::kF32, false>(b, f, side, act);
    case DType::kF16:
      return from_input ? FastDispatch<DType::kF16, true>(b, f, side, act)
                        : FastDispatch<DType::kF16, false>(b, f, side, act);
    case DType::kBF16:
      return from_input ? FastDispatch<DType::kBF16, true>(b, f, side, act)
                        : FastDispatch<DType::kBF16, false>(b, f, side, act);
  }
}

}  // namespace

Epilogue::Epilogue(const PlanSpec& spec, const FusedParams& buffers)
    : spec_(spec), buffers_(buffers) {
  const float* s = buffers.scalars;
  scalars_[0] = s[kSideAlpha];
  scalars_[1] = s[kActAlpha];
  scalars_[2] = s[kActBeta];
  scalars_[3] = s[kActGamma];
  // A pending per-channel v * scale + shift, composed from the chain's affine operators in
  // order until an operator that is not one (side add, activation, per-activation batch norm).
  const int64_t channels = spec.out_c;
  std::vector<float> scale, shift;
  bool pending = false;
  auto start = [&](float alpha) {
    if (!pending) {
      scale.assign(channels, alpha);
      shift.assign(channels, 0.0f);
      pending = true;
    }
  };
  auto push = [&](EpilogueStage::Kind kind, std::vector<float> a, std::vector<float> b) {
    const float* pa = a.data();
    const float* pb = b.data();
    arrays_.push_back(std::move(a));
    arrays_.push_back(std::move(b));
    stages_.push_back({kind, pa, pb});
  };
  auto flush = [&] {
    if (pending) push(EpilogueStage::kAffine, std::move(scale), std::move(shift));
    pending = false;
  };
  if (spec.has_conv && s[kConvAlpha] != 1.0f) start(s[kConvAlpha]);
  for (PointwiseOp op : spec.pointwise) {
    switch (op) {
      case PointwiseOp::kBias:
        start(1.0f);
        for (int64_t c = 0; c < channels; ++c) shift[c] += buffers.bias[c];
        break;
      case PointwiseOp::kBatchNorm: {
        // Per channel (or parameter element) v -> (v - center) * mul + add, kernels/
        // epilogue.h's bn_fold. Plain folds (center 0) compose with the pending affine step;
        // if any is not plain, the centering is applied first, as a step of its own.
        const int64_t n = spec.bn_param_elements();
        std::vector<float> center(n), mul(n), add(n);
        bool plain = true;
        for (int64_t i = 0; i < n; ++i) {
          const BnFold f = bn_fold(buffers.bn_scale[i], buffers.bn_shift[i], buffers.bn_mean[i],
                                   buffers.bn_var[i], s[kBnEpsilon]);
          center[i] = f.center;
          mul[i] = f.mul;
          add[i] = f.add;
          plain = plain && f.plain();
        }
        if (spec.bn == BnMode::kSpatial && plain) {
          start(1.0f);
          for (int64_t c = 0; c < channels; ++c) {
            scale[c] *= mul[c];
            shift[c] = shift[c] * mul[c] + add[c];
          }
        } else if (spec.bn == BnMode::kSpatial) {
          start(1.0f);
          for (int64_t c = 0; c < channels; ++c) shift[c] -= center[c];
          flush();
          scale = std::move(mul);
          shift = std::move(add);
          pending = true;
        } else {
          flush();
          if (!plain) {
            for (float& c : center) c = -c;
            push(EpilogueStage::kParamAffine, std::vector<float>(n, 1.0f), std::move(center));
          }
          push(EpilogueStage::kParamAffine, std::move(mul), std::move(add));
        }
        break;
      }
      case PointwiseOp::kSideAdd:
        flush();
        stages_.push_back({EpilogueStage::kSideAdd, nullptr, nullptr});
        break;
      case PointwiseOp::kActivation:
        flush();
        if (spec.activation != kPassthru) {
          stages_.push_back({EpilogueStage::kActivation, nullptr, nullptr});
        }
        break;
    }
  }
  flush();

  // The single-pass form applies when the stages are [affine] [side add] [activation] in
  // that order (each optional) and the activation is a cheap one.
  size_t i = 0;
  if (i < stages_.size() && stages_[i].kind == EpilogueStage::kAffine) {
    single_.scale = stages_[i].scale;
    single_.shift = stages_[i].shift;
    ++i;
  } else {  // the identity
    arrays_.emplace_back(channels, 1.0f);
    single_.scale = arrays_.back().data();
    arrays_.emplace_back(channels, 0.0f);
    single_.shift = arrays_.back().data();
  }
  if (i < stages_.size() && stages_[i].kind == EpilogueStage::kSideAdd) {
    single_.side = true;
    ++i;
  }
  single_.activation = kPassthru;
  if (i < stages_.size() && stages_[i].kind == EpilogueStage::kActivation &&
      IsFastActivation(spec.activation)) {
    single_.activation = spec.activation;
    ++i;
  }
  fast_ = i == stages_.size();
  single_.side_alpha = scalars_[0];
  single_.alpha = scalars_[1];
  single_.beta = scalars_[2];
  single_.gamma = scalars_[3];
}

void Epilogue::Apply(const Block& block) const {
  if (fast_) {
    const FastArgs f{single_.scale, single_.shift, nullptr, buffers_.side, buffers_.y,
                     scalars_[0], scalars_[1], scalars_[2], scalars_[3]};
    FastApply(block, f, spec_.dtype, false, single_.side, single_.activation);
    return;
  }
  ApplyStages(block, stages_.data(), static_cast<int>(stages_.size()), spec_, buffers_, scalars_);
}

void Epilogue::ApplyToInput(const Block& block) const {
  const FastArgs f{single_.scale, single_.shift, buffers_.x, buffers_.side, buffers_.y,
                   scalars_[0], scalars_[1], scalars_[2], scalars_[3]};
  FastApply(block, f, spec_.dtype, true, single_.side, single_.activation);
}

}  // namespace jaxfuse::cpu
