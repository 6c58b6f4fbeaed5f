#include "gpu/codegen.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kernels/epilogue.h"

namespace jaxfuse::gpu {
namespace {

// Builds source text. (No iostreams: some toolchains link libstdc++ statically into the
// extension, where stream locales are never initialized.)
class Text {
 public:
  Text& operator<<(std::string_view text) {
    out_.append(text);
    return *this;
  }
  template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int>>>
  Text& operator<<(Int value) {
    out_ += std::to_string(value);
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  std::string out_;
};

// Channels whose per-channel epilogue terms (4 floats each) a pointwise block tabulates in
// shared memory: at most 48 KiB, what a kernel may use without opting in to more.
constexpr int64_t kMaxTableChannels = 3072;
constexpr int64_t kTableFloatsPerChannel = 4;

unsigned GridFor(int64_t work_items, int threads, const DeviceInfo& device) {
  // Enough blocks to fill the device several times over; kernels loop beyond that.
  const int64_t wanted = (work_items + threads - 1) / threads;
  const int64_t cap = std::max<int64_t>(1, int64_t(device.sm_count > 0 ? device.sm_count : 80) * 16);
  return static_cast<unsigned>(std::clamp<int64_t>(wanted, 1, cap));
}

// The plan's sizes and types as compile-time constants (namespace jaxfuse::plan).
std::string PlanConstants(const PlanSpec& spec) {
  const ConvGeometry& g = spec.conv;
  Text s;
  s << "namespace jaxfuse {\nnamespace plan {\n"
    << "constexpr int kDtype = " << static_cast<int>(spec.dtype) << ";\n"
    << "typedef Storage<kDtype> Io;\n"
    << "constexpr bool kNHWC = " << (spec.layout == Layout::kNHWC ? "true" : "false") << ";\n"
    << "constexpr bool kOutNHWC = " << (spec.out_layout == Layout::kNHWC ? "true" : "false")
    << ";\n"
    << "constexpr i64 N = " << spec.n << ", C = " << spec.c << ", H = " << spec.h
    << ", W = " << spec.w << ";\n"
    << "constexpr i64 K = " << spec.out_c << ", P = " << spec.out_h << ", Q = " << spec.out_w
    << ";\n"
    << "constexpr i64 kOutElements = N * K * P * Q;\n"
    << "constexpr i64 kPerSample = K * P * Q;\n"
    << "constexpr int kFilterOIHW = 0, kFilterHWIO = 1, kFilterOHWI = 2;\n"
    << "constexpr i64 kMaxTableChannels = " << kMaxTableChannels << ";\n";
  if (spec.has_conv) {
    s << "constexpr int kFilterLayout = " << static_cast<int>(g.filter_layout) << ";\n"
      << "constexpr i64 R = " << g.r << ", S = " << g.s << ", SH = " << g.stride_h
      << ", SW = " << g.stride_w << ", PT = " << g.pad_t << ", PL = " << g.pad_l
      << ", DH = " << g.dil_h << ", DW = " << g.dil_w << ";\n"
      << "constexpr i64 G = " << g.groups << ", CG = C / G, KG = K / G;\n"
      << "constexpr bool kAllowTf32 = " << (g.allow_tf32 ? "true" : "false") << ";\n";
    // The filters' storage, and one filter value as the plan's dtype holds it: float32 filters
    // of a 16-bit plan are rounded to it first, as converting them before the call would.
    if (spec.wide_filters()) {
      s << "typedef Storage<0> FilterIo;\n"
        << "JF_DEVICE float filter_value(float v) { return Io::load(Io::store(v)); }\n";
    } else {
      s << "typedef Io FilterIo;\n"
        << "JF_DEVICE float filter_value(Io::type v) { return Io::load(v); }\n";
    }
  }
  s << "}  // namespace plan\n}  // namespace jaxfuse\n";
  return s.str();
}

// The operator chain as straight-line code: Epilogue::channel() loads and folds the
// per-channel terms once per channel, Epilogue::apply() runs the chain on one value.
std::string PlanEpilogue(const PlanSpec& spec) {
  const bool spatial_bn = spec.bn == BnMode::kSpatial;
  const bool per_activation_bn = spec.bn == BnMode::kPerActivation;
  Text s;
  // One operator of the chain on v, the side input's value at this element being `z`.
  const auto emit_op = [&](PointwiseOp op, const char* z) {
    switch (op) {
      case PointwiseOp::kBias: s << "    v += t.bias;\n"; break;
      case PointwiseOp::kBatchNorm:
        if (per_activation_bn) {
          s << "    v = bn_apply(v, bn_fold(p.bn_scale[param], p.bn_shift[param], "
               "p.bn_mean[param], p.bn_var[param], bn_epsilon));\n";
        } else {
          s << "    v = bn_apply(v, t.bn);\n";
        }
        break;
      case PointwiseOp::kSideAdd:
        s << "    v += side_alpha * " << z << ";\n";
        break;
      case PointwiseOp::kActivation:
        s << "    v = activate<" << spec.activation
          << ">(v, act_alpha, act_beta, act_gamma);\n";
        break;
    }
  };
  s << "namespace jaxfuse {\nnamespace plan {\n"
    << "struct Epilogue {\n"
    // 20 bytes, not 16: the tensor-core epilogues read one channel per 8 output columns from
    // a shared table, and a 128-byte stride would put every thread of a warp in the same four
    // banks (a 16-byte Channel made the epilogue-bound layers 2x slower on an H100).
    << "  struct Channel {\n"
    << "    float bias;\n"
    << "    BnFold bn;\n"
    << "    float unused;  // stride padding\n"
    << "    JF_DEVICE static Channel identity() { return Channel{0.0f, {0.0f, 1.0f, 0.0f}, 0.0f}; }\n"
    << "  };\n"
    << "  const FusedParams p;\n"
    << "  float conv_alpha, bn_epsilon, act_alpha, act_beta, act_gamma, side_alpha;\n"
    << "  JF_DEVICE explicit Epilogue(const FusedParams& params) : p(params) {\n"
    << "    conv_alpha = p.scalars[kConvAlpha];\n"
    << "    bn_epsilon = p.scalars[kBnEpsilon];\n"
    << "    act_alpha = p.scalars[kActAlpha];\n"
    << "    act_beta = p.scalars[kActBeta];\n"
    << "    act_gamma = p.scalars[kActGamma];\n"
    << "    side_alpha = p.scalars[kSideAlpha];\n"
    << "  }\n"
    // A channel's parameters as loaded (raw) and folded into its terms (fold), apart so a
    // kernel can issue the loads early and fold once they are needed (conv_wgmma).
    << "  struct Raw {\n"
    << "    float bias = 0.0f, scale = 1.0f, shift = 0.0f, mean = 0.0f, var = 1.0f;\n"
    << "  };\n"
    << "  JF_DEVICE Raw raw(i64 c) const {\n"
    << "    Raw r;\n";
  if (spec.has(PointwiseOp::kBias)) s << "    r.bias = p.bias[c];\n";
  if (spatial_bn) {
    s << "    r.scale = p.bn_scale[c];\n    r.shift = p.bn_shift[c];\n"
      << "    r.mean = p.bn_mean[c];\n    r.var = p.bn_var[c];\n";
  }
  s << "    return r;\n  }\n"
    << "  JF_DEVICE Channel fold(const Raw& r) const {\n"
    << "    Channel t = Channel::identity();\n";
  if (spec.has(PointwiseOp::kBias)) s << "    t.bias = r.bias;\n";
  if (spatial_bn) s << "    t.bn = bn_fold(r.scale, r.shift, r.mean, r.var, bn_epsilon);\n";
  s << "    return t;\n  }\n"
    << "  JF_DEVICE Channel channel(i64 c) const { return fold(raw(c)); }\n";
  // The same for kN consecutive channels from c (both multiples of 4), the parameters read
  // 16 bytes at a time where every array is 16-byte aligned (pointwise.cuh: kVectorTerms).
  std::string read = "0ull";  // the arrays channels() reads, ORed: 16-byte aligned or not
  if (spec.has(PointwiseOp::kBias)) read += " | reinterpret_cast<unsigned long long>(p.bias)";
  if (spatial_bn) {
    for (const char* array : {"bn_scale", "bn_shift", "bn_mean", "bn_var"}) {
      read += std::string(" | reinterpret_cast<unsigned long long>(p.") + array + ")";
    }
  }
  s << "  template <int kN>\n"
    << "  JF_DEVICE void channels(i64 c, Channel (&t)[kN]) const {\n"
    << "    const bool vectors = ((" << read << ") & 15) == 0;\n"
    << "    if (!vectors) {\n"
    << "      for (int j = 0; j < kN; ++j) t[j] = channel(c + j);\n"
    << "      return;\n"
    << "    }\n"
    << "#pragma unroll\n"
    << "    for (int j = 0; j < kN; ++j) t[j] = Channel::identity();\n";
  if (spec.has(PointwiseOp::kBias)) {
    s << "    float bias[kN];\n    load_floats<kN>(p.bias + c, bias);\n"
      << "#pragma unroll\n    for (int j = 0; j < kN; ++j) t[j].bias = bias[j];\n";
  }
  if (spatial_bn) {
    s << "    float scale[kN], shift[kN], mean[kN], var[kN];\n"
      << "    load_floats<kN>(p.bn_scale + c, scale);\n"
      << "    load_floats<kN>(p.bn_shift + c, shift);\n"
      << "    load_floats<kN>(p.bn_mean + c, mean);\n"
      << "    load_floats<kN>(p.bn_var + c, var);\n"
      << "#pragma unroll\n    for (int j = 0; j < kN; ++j) "
         "t[j].bn = bn_fold(scale[j], shift[j], mean[j], var[j], bn_epsilon);\n";
  }
  s << "  }\n"
    << "  static constexpr bool kSide = " << (spec.has(PointwiseOp::kSideAdd) ? "true" : "false")
    << ";\n"
    << "  // Whether apply() reads parameters per element (per-activation batch norm).\n"
    << "  static constexpr bool kElementParams = " << (per_activation_bn ? "true" : "false")
    << ";\n"
    << "  // v: the convolution's accumulator (or the input value); param: index into\n"
    << "  // per-activation parameters; out: flat index of the output element.\n"
    << "  JF_DEVICE float apply(float v, const Channel& t, i64 param, i64 out) const {\n";
  if (spec.has(PointwiseOp::kSideAdd)) {
    s << "    return apply_side(v, t, param, Io::load(static_cast<const Io::type*>(p.side)[out]));\n";
  } else {
    s << "    return apply_side(v, t, param, 0.0f);\n";
  }
  s << "  }\n"
    << "  // The same, with the side input's value z at this element already loaded (the\n"
    << "  // tensor-core epilogues load it in 16-byte words, ahead of the arithmetic).\n"
    << "  JF_DEVICE float apply_side(float v, const Channel& t, i64 param, float z) const {\n";
  if (spec.has_conv) s << "    v *= conv_alpha;\n";
  for (PointwiseOp op : spec.pointwise) emit_op(op, "z");
  s << "    return v;\n  }\n";
  // The chain's leading affine steps as one map per channel, v * scale + shift: the
  // convolution's alpha, then bias and spatial batch norm up to the first other operator. A
  // kernel that scales its filter taps by `scale` and starts its accumulators at `shift` then
  // runs only the rest of the chain (apply_rest) per output: the whole chain was about a
  // fifth of the depthwise kernel's instructions (7x7/960 bf16, relu6: 170 of 780). False
  // where the map is not finite or a batch norm is not a plain multiply-add (its exact form is
  // kept for those channels).
  size_t leading = 0;
  while (spec.has_conv && leading < spec.pointwise.size() &&
         (spec.pointwise[leading] == PointwiseOp::kBias ||
          (spec.pointwise[leading] == PointwiseOp::kBatchNorm && spatial_bn))) {
    ++leading;
  }
  s << "  JF_DEVICE bool leading_affine(const Channel& t, float& scale, float& shift) const {\n"
    << "    scale = " << (spec.has_conv ? "conv_alpha" : "1.0f") << ";\n"
    << "    shift = 0.0f;\n";
  for (size_t i = 0; i < leading; ++i) {
    if (spec.pointwise[i] == PointwiseOp::kBias) {
      s << "    shift += t.bias;\n";
    } else {
      s << "    if (!t.bn.plain()) return false;\n"
        << "    scale *= t.bn.mul;\n    shift = shift * t.bn.mul + t.bn.add;\n";
    }
  }
  s << "    return jf_isfinite(scale) && jf_isfinite(shift);\n  }\n"
    << "  // apply() after the leading affine steps: v is already scaled and shifted.\n"
    << "  JF_DEVICE float apply_rest(float v, const Channel& t, i64 param, i64 out) const {\n"
    << "    (void)t, (void)param, (void)out;\n";
  for (size_t i = leading; i < spec.pointwise.size(); ++i) {
    emit_op(spec.pointwise[i], "Io::load(static_cast<const Io::type*>(p.side)[out])");
  }
  s << "    return v;\n  }\n};\n}  // namespace plan\n}  // namespace jaxfuse\n";
  return s.str();
}

std::string TranslationUnit(const PlanSpec& spec, const std::string& extra_constants,
                            const std::vector<const char*>& kernel_files) {
  Text s;
  // The canonical form, never the text the plan was parsed from: nothing of a plan reaches the
  // compiler except enums and integers the parser produced.
  s << "// jaxfuse kernel for plan: " << spec.canonical << "\n"
    << "#include \"portable.h\"\n#include \"params.h\"\n#include \"epilogue.h\"\n\n"
    << PlanConstants(spec) << "\n" << PlanEpilogue(spec) << "\n";
  if (!extra_constants.empty()) {
    s << "namespace jaxfuse {\nnamespace plan {\n" << extra_constants << "}  // namespace plan\n}"
         "  // namespace jaxfuse\n\n";
  }
  for (const char* file : kernel_files) s << "#include \"" << file << "\"\n";
  return s.str();
}

// ----- implicit GEMM on tensor cores -----------------------------------------------------------

struct IgemmTile {
  int bm, bn, bk, warps_m, warps_n, stages, min_blocks;
  int elem = 2;  // bytes per operand element: 2 (fp16/bf16), 4 (fp32 through TF32)
  int Threads() const { return warps_m * warps_n * 32; }
  // Bytes of dynamic shared memory: the pipeline stages, or the fp32 epilogue tile (pitches as
  // in conv_igemm.cuh: kk-contiguous rows padded by 16 bytes, k-contiguous ones by 8 values).
  int SmemBytes(bool b_rows_are_k) const {
    const int pad = 16 / elem;
    const int a = bm * (bk + pad), b = b_rows_are_k ? bk * (bn + 8) : bn * (bk + pad);
    return std::max(stages * (a + b) * elem, bm * (bn + 4) * 4);
  }
};

// fp32 plans on the TF32 tensor-core kernel where the plan's precision allows TF32 (as lax's
// default does); JAXFUSE_TF32_KERNELS=0 keeps them on the exact direct kernel.
bool Tf32KernelsEnabled() {
  const char* value = std::getenv("JAXFUSE_TF32_KERNELS");
  return value == nullptr || std::string(value) != "0";
}

int ArchNumber(const std::string& arch) {
  return arch.rfind("sm_", 0) == 0 ? std::atoi(arch.c_str() + 3) : 0;
}

// Values of `dtype` in one 16-byte copy (a chunk, a vector lane group).
int ChunkValues(DType dtype) { return static_cast<int>(16 / dtype_size(dtype)); }

// Whether the tensor-core kernel applies to the plan on this device.
// The geometry and dtype conditions of the tensor-core kernels (IgemmApplies, WgmmaApplies).
bool IgemmShapeApplies(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const int64_t cg = spec.c / g.groups, kg = g.k / g.groups;
  const bool nhwc = spec.layout == Layout::kNHWC;
  // NHWC: B's rows must be runs of the filters in the order A's rows are (OIHW only as 1x1).
  // NCHW: A is gathered value by value, in whichever order B's rows are stored (kk = (c, r, s)
  // for OIHW filters of several taps, each pixel's taps then a 32-bit mask).
  const bool one_tap = g.r == 1 && g.s == 1;
  const bool oihw_ok = one_tap || (!nhwc && (g.r * g.s <= 32 || cg % 16 != 0));
  const bool filter_ok = g.filter_layout == FilterLayout::kHWIO ||
                         g.filter_layout == FilterLayout::kOHWI ||
                         (g.filter_layout == FilterLayout::kOIHW && oihw_ok);
  // Channel counts that are not whole 16-wide k-steps: NHWC taps of whole 16-byte chunks
  // stream in chunk by chunk, fewer channels are gathered (HWIO filters; NCHW: any, B gathered
  // too when its rows are not 16-byte runs).
  const bool channels_ok = cg % ChunkValues(spec.dtype) == 0 ||
                           g.filter_layout == FilterLayout::kHWIO || !nhwc;
  // NCHW: offsets within a k-tile's channel planes are ints.
  const bool planes_ok = nhwc || spec.h * spec.w < (int64_t{1} << 26);
  // fp32: TF32 where the plan's precision allows it, 16-byte rows of B (a few channels
  // gathered as for 16-bit plans, the 3-channel stem included).
  const bool dtype_ok = spec.dtype != DType::kF32 ||
                        (Tf32KernelsEnabled() && g.allow_tf32 && kg % 4 == 0);
  return !device.hip && ArchNumber(device.arch) >= 80 && dtype_ok && planes_ok &&
         filter_ok && channels_ok && kg % 8 == 0 &&
         g.r * g.s * cg < (int64_t{1} << 31) &&  // the k loop indexes the reduction with int
         spec.h * spec.w < (int64_t{1} << 31) && spec.out_h * spec.out_w < (int64_t{1} << 31);
}

// The mma.sync kernel (16-bit filters only: fp32 ones of a 16-bit plan take conv_wgmma).
bool IgemmApplies(const PlanSpec& spec, const DeviceInfo& device) {
  return IgemmShapeApplies(spec, device) && !spec.wide_filters() && !spec.mixed_layouts();
}

// A reduction that is not whole k-tiles and whose taps are not whole 16-byte chunks of NHWC
// pixels is gathered value by value through registers (conv_igemm.cuh: kGatherA).
bool GathersA(const PlanSpec& spec) {
  const int64_t cg = spec.c / spec.conv.groups;
  const bool chunks = spec.layout == Layout::kNHWC &&
                      cg % ChunkValues(spec.dtype) == 0;
  return cg % 16 != 0 && !chunks;
}

// Few channels and K-major filters (NCHW only): B's rows are not 16-byte runs, and B is gathered
// through registers like A (conv_igemm.cuh: kGatherB).
bool GathersB(const PlanSpec& spec) {
  return GathersA(spec) && spec.conv.filter_layout != FilterLayout::kHWIO;
}

// CTAs per multiprocessor for the 128x64 tile: TF32 plans gathering NCHW data over (c, r, s)
// (OIHW filters of several taps) hold more registers than two 256-thread CTAs leave (ptxas
// spilled), so one.
int Igemm128x64Blocks(const PlanSpec& spec) {
  const ConvGeometry& g = spec.conv;
  const bool flat = spec.layout == Layout::kNCHW && g.filter_layout == FilterLayout::kOIHW &&
                    g.r * g.s > 1;
  return spec.dtype == DType::kF32 && flat ? 1 : 2;
}

// The heuristic's tile first, then alternatives worth timing (distinct, fitting the device).
std::vector<IgemmTile> IgemmCandidates(const PlanSpec& spec, const DeviceInfo& device);

IgemmTile ChooseIgemmTile(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const int64_t cg = spec.c / g.groups, kg = g.k / g.groups;
  const int64_t m = spec.n * spec.out_h * spec.out_w;
  const int bk = cg % 32 == 0 || cg % 16 != 0 ? 32 : 16;
  const int sms = device.sm_count > 0 ? device.sm_count : 132;
  auto ctas = [&](int bm, int bn) {
    return ((m + bm - 1) / bm) * ((kg + bn - 1) / bn) * g.groups;
  };
  if (GathersA(spec)) {  // gathered A: two stages, tiles sized for occupancy
    // (B gathered too, with K-major filters: more registers than two 256-thread CTAs hold.)
    const int wide_blocks = GathersB(spec) ? 1 : 2;
    return ctas(128, 64) >= sms ? IgemmTile{128, 64, 32, 4, 2, 2, wide_blocks}
                                : IgemmTile{64, 64, 32, 2, 2, 2, 3};
  }
  // Largest tile that still gives every multiprocessor work.
  if (kg >= 128 && ctas(128, 128) >= sms) return {128, 128, bk, 2, 4, 4, 1};
  if (ctas(128, 64) >= sms) return {128, 64, bk, 4, 2, 4, Igemm128x64Blocks(spec)};
  return {64, 64, bk, 2, 2, 4, 2};
}

// ----- Hopper: warpgroup MMA ------------------------------------------------------------------

struct WgmmaTile {
  int bm, bn, stages, min_blocks;
  int splits = 1;       // split-K over a cluster of this many CTAs
  bool wide_b = false;  // fp32 filters: each stage also holds B's fp32 chunks (kWideB)
  int Threads() const { return bm / 64 * 128; }
  // Pipeline stages and the fp32 epilogue tile, which reuses them unless split (then it is
  // the receive area of the partial sums, arriving while the stages may still be in use),
  // plus alignment slack.
  int SmemBytes() const {
    const int staged = stages * ((bm + bn) * 128 + (wide_b ? bn * 256 : 0));
    const int tile = bm * (bn + 8) * 4;
    return (splits > 1 ? staged + tile : std::max(staged, tile)) + 1024;
  }
  // The epilogue's terms (20 bytes each) and the split-K barrier.
  int StaticSmemBytes() const { return bn * 20 + 8; }
};

// Values of the plan's dtype in a 128-byte k-tile row of the Hopper kernels: 64 16-bit ones,
// 32 fp32 ones (TF32).
int HopperKTile(const PlanSpec& spec) { return spec.dtype == DType::kF32 ? 32 : 64; }

bool WgmmaApplies(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  // fp32 (TF32, where IgemmApplies allows it): NHWC, whose rows of A are copied 16 bytes at
  // a time (NCHW's gathered rows are written for 16-bit values). fp32 filters of a 16-bit
  // plan: NHWC too, B in 16-byte chunks (HWIO or OHWI).
  const bool dtype_ok = spec.dtype != DType::kF32 || spec.layout == Layout::kNHWC;
  const bool filters_ok = !spec.wide_filters() || (spec.layout == Layout::kNHWC &&
                                                   g.filter_layout != FilterLayout::kOIHW);
  // An output layout of its own (a kernel form of NCHW plans): NHWC input, whose epilogue
  // writes NCHW planes (implicit_gemm.h: store_chunk_planes, any dtype).
  const bool layouts_ok = !spec.mixed_layouts() || spec.layout == Layout::kNHWC;
  return IgemmShapeApplies(spec, device) && dtype_ok && filters_ok && layouts_ok &&
         device.arch == "sm_90" &&
         (spec.c / g.groups) % HopperKTile(spec) == 0;
}

// A tile with as many CTAs per multiprocessor as shared memory and registers allow. With
// fp32 filters (`wide_b`) a stage is larger: fewer stages where four would not fit.
WgmmaTile MakeWgmmaTile(int bm, int bn, int stages, bool wide_b, int splits = 1) {
  WgmmaTile tile{bm, bn, stages, 1, splits, wide_b};
  while (tile.stages > 3 && tile.SmemBytes() + tile.StaticSmemBytes() > 227 * 1024) {
    --tile.stages;
  }
  const int per_sm = std::max(1, 227 * 1024 / tile.SmemBytes());
  const int regs_per_thread = bn / 2 + 56;  // accumulators + addressing and epilogue
  tile.min_blocks = std::max(1, std::min({per_sm, 65536 / (regs_per_thread * tile.Threads()), 4}));
  return tile;
}

WgmmaTile ChooseWgmmaTile(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const bool wide = spec.wide_filters();
  const int64_t kg = g.k / g.groups, m = spec.n * spec.out_h * spec.out_w;
  const int64_t k_tiles = g.r * g.s * (spec.c / g.groups) / HopperKTile(spec);
  const int sms = device.sm_count > 0 ? device.sm_count : 132;
  auto ctas = [&](int bm, int bn) {
    return ((m + bm - 1) / bm) * ((kg + bn - 1) / bn) * g.groups;
  };
  // The widest tile that still occupies every multiprocessor. Short reductions (few k-tiles)
  // are bound by loading and storing, not multiplying: they take narrower tiles, fewer stages
  // and more CTAs per multiprocessor, so one CTA's epilogue overlaps another's loads.
  int bm = 64, bn = 64;
  if (kg >= 256 && k_tiles >= 16 && ctas(128, 256) >= sms) {
    bm = 128, bn = 256;
  } else if (kg > 64 && ctas(128, 128) >= sms / 2) {
    bm = 128, bn = 128;
  } else if (ctas(128, 64) >= sms) {
    bm = 128;
  }
  return MakeWgmmaTile(bm, bn, static_cast<int>(std::clamp<int64_t>(k_tiles + 2, 3, 4)), wide);
}

std::vector<WgmmaTile> WgmmaCandidates(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const bool wide = spec.wide_filters();
  const int64_t kg = g.k / g.groups;
  const int64_t k_tiles = g.r * g.s * (spec.c / g.groups) / HopperKTile(spec);
  std::vector<WgmmaTile> all = {ChooseWgmmaTile(spec, device)};
  // Deep pipelines for long reductions, wide tiles for wide outputs, small ones for small M.
  const int deep = static_cast<int>(std::clamp<int64_t>(k_tiles + 2, 3, 6));
  const std::vector<WgmmaTile> extras = {
      MakeWgmmaTile(128, 128, deep, wide), MakeWgmmaTile(128, 256, 4, wide),
      MakeWgmmaTile(128, 64, 4, wide),     MakeWgmmaTile(64, 128, deep, wide),
      MakeWgmmaTile(128, 128, 3, wide),    MakeWgmmaTile(64, 64, 4, wide)};
  std::vector<WgmmaTile> candidates = extras;
  // Outputs too small to occupy the device: split the reduction over a cluster of CTAs.
  const int64_t m = spec.n * spec.out_h * spec.out_w;
  const int sms = device.sm_count > 0 ? device.sm_count : 132;
  std::vector<WgmmaTile> deep_rings;  // (the autotuner times them beyond the first four)
  for (const int bn : {64, 128}) {
    const int64_t tiles = ((m + 63) / 64) * ((kg + bn - 1) / bn) * g.groups;
    int splits = 1;
    while (splits < 8 && tiles * splits * 2 <= 2 * sms && k_tiles >= splits * 2 * 4) splits *= 2;
    if (splits > 1 && bn <= std::max<int64_t>(64, (kg + 63) / 64 * 64)) {
      // (float32 filters: deeper, as their stages hold twice the bytes of B in flight)
      const WgmmaTile t = MakeWgmmaTile(64, bn, wide ? 6 : 4, wide, splits);
      candidates.insert(candidates.begin(), t);
      // Also a ring that holds each CTA's whole share of the reduction in flight (its
      // k-tiles plus the two stages the pipeline keeps behind the copies; up to 12): at batch
      // 1 the grid is at most one CTA of one warpgroup per multiprocessor, latency bound
      // (Nsight Compute, 3x3/512 at batch 1 on an H100: 6% occupancy, DRAM 14% busy), and
      // every k-tile's copy then goes out at once. (It only shows where the filters come
      // from DRAM, as the autotuner now times small problems: autotune.cc.)
      const int per_cta = static_cast<int>(
          std::min<int64_t>((k_tiles + splits - 1) / splits + 2, 12));
      const WgmmaTile deep = MakeWgmmaTile(64, bn, per_cta, wide, splits);
      if (!wide && per_cta > t.stages && deep.stages == per_cta) {
        candidates.insert(candidates.begin() + 1, deep);
        deep_rings.push_back(deep);
      }
    }
  }
  // Up to four tiles, and each deep split-K ring besides.
  const auto is_deep = [&](const WgmmaTile& t) {
    return std::any_of(deep_rings.begin(), deep_rings.end(), [&](const WgmmaTile& d) {
      return d.bn == t.bn && d.stages == t.stages && d.splits == t.splits;
    });
  };
  int regular = static_cast<int>(all.size());
  for (const WgmmaTile& t : candidates) {
    if (regular >= 4 && !is_deep(t)) continue;
    const bool seen = std::any_of(all.begin(), all.end(), [&](const WgmmaTile& u) {
      return u.bm == t.bm && u.bn == t.bn && u.stages == t.stages && u.splits == t.splits;
    });
    if (!seen && t.bn <= std::max<int64_t>(64, (kg + 63) / 64 * 64) &&
        t.SmemBytes() + t.StaticSmemBytes() <= std::max(device.max_smem_per_block, 48 * 1024)) {
      all.push_back(t);
      if (!is_deep(t)) ++regular;
    }
  }
  return all;
}

std::string WgmmaConstants(const WgmmaTile& t) {
  Text s;
  s << "constexpr int kBM = " << t.bm << ", kBN = " << t.bn << ";\n"
    << "constexpr int kStages = " << t.stages << ", kMinBlocks = " << t.min_blocks << ";\n"
    << "constexpr int kSmemBytes = " << t.SmemBytes() << ", kSplits = " << t.splits << ";\n"
    << "}  // namespace plan\n}  // namespace jaxfuse\n";
  // Only split-K kernels are launched as clusters.
  if (t.splits > 1) {
    s << "#define JF_CLUSTER_DIMS __cluster_dims__(" << t.splits << ", 1, 1)\n";
  } else {
    s << "#define JF_CLUSTER_DIMS\n";
  }
  s << "namespace jaxfuse {\nnamespace plan {\n";
  return s.str();
}

// ----- Hopper: warp-specialized, loads through the copy engine (TMA) ------------------------

struct TmaTile {
  int bn, stages, epi_cols;
  int blocks = 1;         // per multiprocessor
  bool pingpong = false;  // consumers take whole tiles in turn (conv_tma.cuh: kPingPong)
  int bm = 128;           // output pixels per tile
  bool swap = false;      // channels as wgmma's M, pixels as its N (conv_tma.cuh: kSwapAB)
  // A halo tile (conv_tma.cuh: kHalo): a stage holds its input window, `halo_box_bytes`, and
  // `halo_filter_bytes` of filters stay resident (one more barrier).
  bool halo = false;
  int halo_box_bytes = 0, halo_filter_bytes = 0;
  static constexpr int kThreads = 384;
  // Dynamic shared memory: the ring of stages, two staging tiles, the ring's barriers, and
  // alignment slack; plus the static per-warpgroup tables of epilogue terms (20 bytes each).
  int SmemBytes() const {  // (ping-pong: two more barriers, the consumers' turns)
    const int stage = halo ? (halo_box_bytes + 1023) / 1024 * 1024 : (bm + bn) * 128;
    return stages * stage + halo_filter_bytes + 2 * 64 * (epi_cols + 4) * 4 + 16 * stages +
           (pingpong ? 16 : 0) + (halo ? 8 : 0) + 1024;
  }
  int StaticSmemBytes() const { return 2 * bn * 20; }
};

// The im2col map's bounding box of window corners along one spatial dimension: corners at
// -pad, -pad + stride, ... for every output position (and no more), the box's far edge given
// relative to the last input position.
std::pair<int64_t, int64_t> CornerBox(int64_t in, int64_t out, int64_t stride, int64_t pad) {
  return {-pad, -pad + (out - 1) * stride - (in - 1)};
}

bool TmaApplies(const PlanSpec& spec, const DeviceInfo& device) {
  // The im2col map walks NHWC pixels (channels innermost); fp32 through TF32 (conv_tma.cuh).
  if (!WgmmaApplies(spec, device) || spec.layout != Layout::kNHWC || spec.wide_filters()) {
    return false;  // (fp32 filters: conv_wgmma alone converts them as they load)
  }
  const ConvGeometry& g = spec.conv;
  const bool k_major = g.filter_layout != FilterLayout::kHWIO;
  if (k_major && g.filter_layout == FilterLayout::kOIHW && (g.r != 1 || g.s != 1)) return false;
  const auto [lw, uw] = CornerBox(spec.w, spec.out_w, g.stride_w, g.pad_l);
  const auto [lh, uh] = CornerBox(spec.h, spec.out_h, g.stride_h, g.pad_t);
  auto corner_ok = [](int64_t v) { return v >= -128 && v <= 127; };  // 4-D im2col maps
  const int64_t elem = dtype_size(spec.dtype);
  return corner_ok(lw) && corner_ok(uw) && corner_ok(lh) && corner_ok(uh) &&
         g.stride_w <= 8 && g.stride_h <= 8 &&  // the copy engine's traversal strides
         (g.s - 1) * g.dil_w < 256 && (g.r - 1) * g.dil_h < 256 &&  // tap offsets
         spec.n * spec.h * spec.w * spec.c * elem < (int64_t{1} << 40) &&
         g.r * g.s * (spec.c / g.groups) < (int64_t{1} << 31) && spec.n < (int64_t{1} << 31);
}

// TF32 with [kk][k] filters: the producer warpgroup transposes B (conv_tma.cuh), which needs
// three stages and more registers than a producer sharing its multiprocessor has.
bool TmaTransposesB(const PlanSpec& spec) {
  return spec.dtype == DType::kF32 && spec.conv.filter_layout == FilterLayout::kHWIO;
}

// conv_tma's ping-pong tiles are autotuner candidates unless JAXFUSE_TMA_PINGPONG=0.
bool TmaPingPongEnabled() {
  const char* value = std::getenv("JAXFUSE_TMA_PINGPONG");
  return value == nullptr || std::string(value) != "0";
}

// Tiles with the operands swapped (conv_tma.cuh: kSwapAB): 16-bit plans whose groups have 64
// output channels, with [kk][k] (HWIO) filters, whose 64x64 copy-engine tiles are then
// wgmma's MN-major A. Candidates (ping-pong ones) unless JAXFUSE_TMA_SWAP=0.
bool TmaSwapApplies(const PlanSpec& spec) {
  const char* value = std::getenv("JAXFUSE_TMA_SWAP");
  const bool enabled = value == nullptr || std::string(value) != "0";
  return enabled && TmaPingPongEnabled() && spec.dtype != DType::kF32 &&
         spec.conv.k / spec.conv.groups == 64 && spec.conv.filter_layout == FilterLayout::kHWIO;
}

// Halo tiles (conv_tma.cuh: kHalo): swapped 256-pixel tiles for stride-1, undilated layers
// of one group with 64 input and 64 output channels and at most 9 taps (their filters stay
// resident), writing NHWC; candidates unless JAXFUSE_TMA_HALO=0. On an H100 (session 10,
// bf16, the chain in registers) ResNet-50's 3x3/64 layer ran 118 us on them at batch 256
// against 146 us on the swapped 256-pixel tile (34.8 against 40.5 us at batch 64).
bool TmaHaloApplies(const PlanSpec& spec) {
  const char* value = std::getenv("JAXFUSE_TMA_HALO");
  const ConvGeometry& g = spec.conv;
  return (value == nullptr || std::string(value) != "0") && TmaSwapApplies(spec) &&
         g.groups == 1 && spec.c == 64 && g.r * g.s > 1 && g.r * g.s <= 9 &&
         g.stride_h == 1 && g.stride_w == 1 && g.dil_h == 1 && g.dil_w == 1 &&
         spec.out_layout == Layout::kNHWC;
}

TmaTile MakeHaloTile(const PlanSpec& spec) {
  TmaTile tile{64, 2, 64, 1, true, 256, true};  // a stage per consumer
  tile.halo = true;
  tile.halo_box_bytes = static_cast<int>((8 + spec.conv.s - 1) * (256 / 8 + spec.conv.r - 1) * 128);
  tile.halo_filter_bytes = static_cast<int>(spec.conv.r * spec.conv.s * 64 * 128);
  return tile;
}

// As many stages as shared memory holds (at most 8), for `blocks` blocks per multiprocessor.
TmaTile MakeTmaTile(int bn, int blocks, int max_smem, int max_stages = 8,
                    bool pingpong = false, int bm = 128, bool swap = false) {
  TmaTile tile{bn, max_stages, bn >= 256 ? 32 : 64, blocks, pingpong, bm, swap};
  const int budget = blocks == 1 ? max_smem : max_smem / 2 - 1024;  // the SM's 228 KB, halved
  while (tile.stages > 2 && tile.SmemBytes() + tile.StaticSmemBytes() > budget) --tile.stages;
  return tile;
}

// Output tiles as wide as the channels allow (each stage's activations then feed more
// multiplies) and narrower ones (more tiles: fewer idle multiprocessors in the last wave);
// for short reductions also two blocks per multiprocessor, one's epilogue overlapping the
// other's loads and multiplies. The autotuner times them.
std::vector<TmaTile> TmaCandidates(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const int64_t kg = g.k / g.groups, m = spec.n * spec.out_h * spec.out_w;
  const int64_t k_tiles = g.r * g.s * (spec.c / g.groups) / HopperKTile(spec);
  const int sms = device.sm_count > 0 ? device.sm_count : 132;
  const int max_smem = std::max(device.max_smem_per_block, 48 * 1024);
  std::vector<TmaTile> all;
  for (const int bn : {256, 128, 64}) {
    if (bn > std::max<int64_t>(64, (kg + 63) / 64 * 64)) continue;  // mostly past the channels
    const int64_t tiles = (m + 127) / 128 * ((kg + bn - 1) / bn) * g.groups;
    if (bn > 64 && tiles < sms / 2) continue;  // most multiprocessors would idle
    const TmaTile tile = MakeTmaTile(bn, 1, max_smem);
    if (tile.stages >= 3) all.push_back(tile);
  }
  if (k_tiles <= 8 && !TmaTransposesB(spec)) {
    // 64 wide: a 64x128 multiply needs more than 80 registers to issue.
    const TmaTile tile = MakeTmaTile(64, 2, max_smem, static_cast<int>(std::min<int64_t>(
                                                          4, std::max<int64_t>(2, k_tiles + 1))));
    if (tile.stages >= 2) all.push_back(tile);
  }
  // The ping-pong schedule: the autotuner picked it for the 3x3 layers of ResNet-50 with 64,
  // 128 and 512 channels at batch 256 (H100, bf16: 1.14-1.32x cuDNN, the cooperative
  // schedule 0.97-1.22x).
  if (TmaPingPongEnabled()) {
    const size_t single = all.size();
    for (size_t i = 0; i < single; ++i) {
      if (all[i].blocks == 1 && all[i].bn <= 128) {  // (its turn barriers may cost a stage)
        const TmaTile tile = MakeTmaTile(all[i].bn, 1, max_smem, all[i].stages, true);
        if (tile.stages >= 3) all.push_back(tile);
      }
    }
  }
  // 64 output channels: the operands swapped (kSwapAB), 256 or 128 pixels a tile, ping-pong.
  if (TmaSwapApplies(spec)) {
    for (const int bm : {256, 128}) {
      const TmaTile tile = MakeTmaTile(64, 1, max_smem, 8, true, bm, true);
      if (tile.stages >= 3) all.push_back(tile);
    }
  }
  if (TmaHaloApplies(spec)) {
    const TmaTile tile = MakeHaloTile(spec);
    if (tile.SmemBytes() + tile.StaticSmemBytes() <= max_smem) all.push_back(tile);
  }
  return all;
}

std::string TmaConstants(const TmaTile& t) {
  Text s;
  s << "constexpr int kBM = " << t.bm << ", kBN = " << t.bn << ", kStages = " << t.stages
    << ", kEpiCols = " << t.epi_cols << ", kBlocks = " << t.blocks << ";\n"
    << "constexpr bool kPingPong = " << (t.pingpong ? "true" : "false") << ";\n"
    << "constexpr bool kSwapAB = " << (t.swap ? "true" : "false") << ";\n"
    << "constexpr bool kHalo = " << (t.halo ? "true" : "false") << ";\n"
    << "constexpr int kSmemBytes = " << t.SmemBytes() << ";\n";
  return s.str();
}

// CUtensorMapDataType of a plan dtype's values.
int TensorMapDataType(DType dtype) {
  switch (dtype) {
    case DType::kF16: return 6;   // CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    case DType::kBF16: return 9;  // CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    default: return 7;            // CU_TENSOR_MAP_DATA_TYPE_FLOAT32
  }
}

// An NHWC input as the copy engine sees it: a 4-D tensor (C, W, H, N) of the plan's dtype,
// the fields every input map shares (boxes and the im2col window are the caller's).
TensorMapSpec NhwcInputMap(const PlanSpec& spec) {
  const uint64_t elem = dtype_size(spec.dtype);
  TensorMapSpec x;
  x.data_type = TensorMapDataType(spec.dtype);
  x.rank = 4;
  const uint64_t dims[4] = {uint64_t(spec.c), uint64_t(spec.w), uint64_t(spec.h), uint64_t(spec.n)};
  std::copy(dims, dims + 4, x.dims);
  x.strides[0] = spec.c * elem;
  x.strides[1] = spec.w * spec.c * elem;
  x.strides[2] = spec.h * spec.w * spec.c * elem;
  return x;
}

// The input as an im2col map (NHWC: dimensions C, W, H, N), one k-tile of channels (128
// bytes) x 128 pixels a copy, and, unless the producer transposes B itself (TmaTransposesB),
// the filters as a 2-D tiled map: [R*S*CG][K] (HWIO: 64 x 64 boxes) or [K][R*S*CG] (OHWI, 1x1
// OIHW: a k-tile x bn boxes).
std::vector<TensorMapSpec> TmaMaps(const PlanSpec& spec, const TmaTile& tile) {
  const ConvGeometry& g = spec.conv;
  const uint64_t elem = dtype_size(spec.dtype);
  TensorMapSpec x = NhwcInputMap(spec);
  x.im2col = true;
  x.element_strides[1] = static_cast<uint32_t>(g.stride_w);
  x.element_strides[2] = static_cast<uint32_t>(g.stride_h);
  const auto [lw, uw] = CornerBox(spec.w, spec.out_w, g.stride_w, g.pad_l);
  const auto [lh, uh] = CornerBox(spec.h, spec.out_h, g.stride_h, g.pad_t);
  x.lower[0] = static_cast<int>(lw), x.lower[1] = static_cast<int>(lh);
  x.upper[0] = static_cast<int>(uw), x.upper[1] = static_cast<int>(uh);
  const uint32_t k_tile = static_cast<uint32_t>(HopperKTile(spec));
  x.channels = k_tile;
  x.pixels = static_cast<uint32_t>(tile.bm);
  if (tile.halo) {  // a tiled box: 64 channels x the window's columns x its rows, one image
    x.im2col = false;
    x.element_strides[1] = x.element_strides[2] = 1;
    x.lower[0] = x.lower[1] = x.upper[0] = x.upper[1] = 0;
    x.channels = x.pixels = 0;
    x.box[0] = 64;
    x.box[1] = static_cast<uint32_t>(8 + g.s - 1);
    x.box[2] = static_cast<uint32_t>(tile.bm / 8 + g.r - 1);
    x.box[3] = 1;
  }
  if (TmaTransposesB(spec)) return {x};

  TensorMapSpec w;
  w.filters = true;
  w.data_type = x.data_type;
  w.rank = 2;
  const uint64_t reduction = uint64_t(g.r * g.s * (spec.c / g.groups));
  if (g.filter_layout == FilterLayout::kHWIO) {
    w.dims[0] = g.k, w.dims[1] = reduction;
    w.strides[0] = g.k * elem;
    w.box[0] = 64, w.box[1] = 64;
  } else {
    w.dims[0] = reduction, w.dims[1] = g.k;
    w.strides[0] = reduction * elem;
    w.box[0] = k_tile, w.box[1] = static_cast<uint32_t>(tile.bn);
  }
  return {x, w};
}

std::vector<IgemmTile> IgemmCandidates(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const int64_t cg = spec.c / g.groups, kg = g.k / g.groups;
  const bool b_rows_are_k = g.filter_layout == FilterLayout::kHWIO;
  const int bk = cg % 32 == 0 || cg % 16 != 0 ? 32 : 16;
  const int elem = spec.dtype == DType::kF32 ? 4 : 2;
  std::vector<IgemmTile> all = {ChooseIgemmTile(spec, device)};
  std::vector<IgemmTile> extras =
      GathersA(spec) ? std::vector<IgemmTile>{{128, 64, 32, 4, 2, 2, GathersB(spec) ? 1 : 2},
                                            {64, 64, 32, 2, 2, 2, 3}}
                   : std::vector<IgemmTile>{{128, 128, bk, 2, 4, 4, 1},
                                            {128, 64, bk, 4, 2, 4, Igemm128x64Blocks(spec)},
                                            {64, 64, bk, 2, 2, 4, 3}};
  // Few output channels (MobileNet's 16- and 24-channel projections): a tile as narrow as
  // they are, so a CTA's copies and epilogue are not three quarters padding.
  if (!GathersA(spec) && kg <= 32) extras.push_back({128, kg <= 16 ? 16 : 32, bk, 4, 1, 4, 4});
  // Short reductions fill few stages: no more than they use, so more CTAs fit (a one-k-tile
  // 1x1 layer's CTA then holds two stages, not four).
  const int64_t k_tiles = (g.r * g.s * cg + bk - 1) / bk;
  auto fit_stages = [&](IgemmTile& t) {
    t.elem = elem;
    t.stages = static_cast<int>(std::min<int64_t>(t.stages, std::max<int64_t>(2, k_tiles + 1)));
  };
  fit_stages(all[0]);
  for (IgemmTile& t : extras) fit_stages(t);
  for (const IgemmTile& t : extras) {
    const bool seen = std::any_of(all.begin(), all.end(), [&](const IgemmTile& u) {
      return u.bm == t.bm && u.bn == t.bn && u.stages == t.stages;
    });
    if (!seen && t.bn <= std::max<int64_t>(64, (kg + 63) / 64 * 64) &&
        t.SmemBytes(b_rows_are_k) <= device.max_smem_per_block) {
      all.push_back(t);
    }
  }
  return all;
}

std::string IgemmConstants(const IgemmTile& t, bool b_rows_are_k) {
  Text s;
  s << "constexpr int kBM = " << t.bm << ", kBN = " << t.bn << ", kBK = " << t.bk << ";\n"
    << "constexpr int kWarpsM = " << t.warps_m << ", kWarpsN = " << t.warps_n << ";\n"
    << "constexpr int kStages = " << t.stages << ", kMinBlocks = " << t.min_blocks << ";\n"
    << "constexpr int kSmemBytes = " << t.SmemBytes(b_rows_are_k) << ";\n";
  return s.str();
}

// ----- few-channel stems (conv_stem.cuh) -------------------------------------------------------

// One tile of the stem kernel: bm output pixels of one output row (32 rows a warp), all
// channels, split between warps_n warps; the epilogue staged through shared memory or run in
// registers.
struct StemTile {
  int bm, warps_n, min_blocks;
  bool staged = true;
  int Threads() const { return bm / 32 * warps_n * 32; }
};

// Where conv_stem.cuh applies: 16-bit NHWC data of at most 4 channels, one group, no
// dilation, K a multiple of 8 up to 128, and image rows of an even count of values.
bool StemApplies(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  return !device.hip && ArchNumber(device.arch) >= 80 && spec.has_conv &&
         spec.dtype != DType::kF32 && !spec.wide_filters() && spec.layout == Layout::kNHWC &&
         g.groups == 1 && g.dil_h == 1 && g.dil_w == 1 && spec.c <= 4 && g.k % 8 == 0 && g.k <= 128 &&
         (spec.w * spec.c) % 2 == 0 && g.r <= 16 && g.s <= 16 && g.stride_w <= 8 &&
         spec.n * spec.out_h * spec.out_w < (int64_t{1} << 31);
}

// Values in one shared-memory window row of a stem tile (whole 16-byte words).
int64_t StemWindowPitch(const PlanSpec& spec, int bm) {
  const int64_t col_steps = (spec.conv.s + 3) / 4;
  const int64_t pixels = (bm - 1) * spec.conv.stride_w + 4 * col_steps;
  const int64_t words = (pixels * spec.c + 1) / 2 + 1;
  return (2 * words + 7) / 8 * 8;
}

// (The tile's width is the output channels: StemApplies asks for a multiple of 8.)
int64_t StemSmemBytes(const PlanSpec& spec, const StemTile& tile) {
  const int64_t bn = spec.conv.k;
  const int64_t b_frags = spec.conv.r * ((spec.conv.s + 3) / 4) * (bn / 8) * 32 * 8;
  const int64_t windows = 2 * spec.conv.r * StemWindowPitch(spec, tile.bm) * 2;
  return b_frags + windows + (tile.staged ? tile.bm * (bn + 4) * 4 : 0);
}

std::vector<StemTile> StemCandidates(const PlanSpec& spec, const DeviceInfo& device) {
  std::vector<StemTile> all;
  if (!StemApplies(spec, device)) return all;
  const int64_t n_tiles = spec.conv.k / 8;
  // The kernel's static table of epilogue terms (Epilogue::Channel, 20 bytes a channel)
  // shares the opt-in limit with the dynamic bytes.
  const int64_t static_bytes = n_tiles * 8 * 20;
  for (const StemTile tile : {StemTile{128, 2, 2}, StemTile{128, 1, 2}, StemTile{64, 1, 3},
                              StemTile{128, 1, 3, false}, StemTile{64, 1, 5, false}}) {
    if (n_tiles % tile.warps_n == 0 &&
        StemSmemBytes(spec, tile) + static_bytes <= device.max_smem_per_block) {
      all.push_back(tile);
    }
  }
  return all;
}

// The stem kernel applies and one of its tiles fits the device's shared memory.
bool StemOffered(const PlanSpec& spec, const DeviceInfo& device) {
  return !StemCandidates(spec, device).empty();
}

std::string StemConstants(const PlanSpec& spec, const StemTile& t) {
  Text s;
  s << "constexpr int kBM = " << t.bm << ", kBN = " << spec.conv.k
    << ", kWarpsN = " << t.warps_n << ", kMinBlocks = " << t.min_blocks << ";\n"
    << "constexpr int kMmaDtype = " << (spec.dtype == DType::kBF16 ? 2 : 1)
    << ";\nconstexpr bool kStaged = " << (t.staged ? "true" : "false") << ";\n"
    << "constexpr int kWinPitch = " << StemWindowPitch(spec, t.bm)
    << ", kSmemBytes = " << StemSmemBytes(spec, t) << ";\n";
  return s.str();
}

// ----- depthwise convolution on CUDA cores (conv_depthwise.cuh) -------------------------------

// One tiling of the tiled depthwise kernel: a CTA computes a th x tw tile of output pixels for
// a slice of cs channels; each thread a bh x bw block of them for one 32-bit word of channels.
struct DepthwiseTile {
  int cs = 0, bh = 1, bw = 1, th = 1, tw = 1, fill = 4, threads = 0;
  int walk = 1;  // tiles a CTA computes in turn (two windows in shared memory when > 1)
  bool large_filter = false;  // more than 5x5 taps
  // Windows copied by the bulk tensor copy engine (sm_90): one thread issues a tile's whole
  // window, padding zero-filled by the copy, where cp.async takes every thread through
  // per-chunk address arithmetic before the first byte is asked for.
  bool tma = false;
  bool twin = false;  // cp.async beside copy-engine tilings (sm_90): named so it can be forced
  int64_t window = 0, smem = 0, tiles = 0, ctas = 0;
  int64_t rs = 0;            // filter taps
  int64_t box_rows = 0, box_cols = 0;  // the window's input rows and columns
  double seconds = 0;  // the cost model's estimate
  // Resident CTAs ptxas must allow: registers capped at 128 a thread (2048 threads / 16
  // warps), except for large filters, whose taps alone take most of that.
  int MinBlocks() const { return large_filter ? 1 : std::max(1, 16 / ((threads + 31) / 32)); }
  std::string Name() const {
    return std::to_string(th) + "x" + std::to_string(tw) + "x" + std::to_string(cs) + " b" +
           std::to_string(bh) + "x" + std::to_string(bw) + (tma ? " tma" : "") +
           (twin ? " cp.async" : "") + (walk > 1 ? " walk" + std::to_string(walk) : "");
  }
  // Dynamic shared memory as conv_depthwise.cuh lays it out: the windows (each 128-byte
  // aligned for the copy engine, from a base the kernel aligns), the taps (fp32), the 20-byte
  // epilogue terms per channel, and with the copy engine a barrier per window.
  int64_t SmemBytes() const {
    const int64_t windows = walk > 1 ? 2 : 1;
    if (!tma) return windows * window + (rs * 4 + 20) * cs;
    const int64_t pitch = (window + 127) / 128 * 128;
    return 128 + (windows * pitch + (rs * 4 + 20) * cs + 7) / 8 * 8 + 8 * windows;
  }
  // The same tiling, each CTA walking `tiles_a_cta` tiles of its slice.
  DepthwiseTile Walking(int tiles_a_cta, int64_t slices) const {
    DepthwiseTile t = *this;
    t.walk = tiles_a_cta;
    t.smem = t.SmemBytes();
    t.ctas = slices * ((tiles + tiles_a_cta - 1) / tiles_a_cta);
    return t;
  }
  // The same tiling, its windows copied by the copy engine.
  DepthwiseTile Bulk() const {
    DepthwiseTile t = *this;
    t.tma = true;
    t.smem = t.SmemBytes();
    return t;
  }
};

bool IsDepthwise(const PlanSpec& spec) {
  const ConvGeometry& g = spec.conv;
  return g.groups == spec.c && g.k == spec.c && spec.layout == Layout::kNHWC &&
         !spec.mixed_layouts() &&
         g.filter_layout == FilterLayout::kHWIO && !spec.wide_filters();
}

// Per output axis, for a tile of `tile` outputs in blocks of `block`: the blocks with work and
// the input positions (inside the input) the tiles copy, summed over the axis's tiles.
struct AxisCount {
  int64_t blocks = 0, loaded = 0;
};
AxisCount CountAxis(int64_t out, int64_t in, int64_t stride, int64_t pad, int64_t window,
                    int tile, int block) {
  AxisCount a;
  const int64_t extent = (tile - 1) * stride + window;  // input positions per tile
  for (int64_t t = 0; t * tile < out; ++t) {
    a.blocks += std::min<int64_t>(tile / block, (out - t * tile + block - 1) / block);
    const int64_t lo = std::max<int64_t>(0, t * tile * stride - pad);
    const int64_t hi = std::min<int64_t>(in, t * tile * stride - pad + extent);
    a.loaded += std::max<int64_t>(0, hi - lo);
  }
  return a;
}

// The tilings worth timing, best first by a cost model of an H100-class device: the longer of
// issuing the kernel's instructions (counts per block, copy and CTA calibrated on its sm_90
// SASS; 128 fp32 lanes a multiprocessor at 1.6 GHz, 70% issue efficiency with 16 or more warps
// resident) and moving its bytes (3 TB/s, halo re-reads from L2 at 30% of a DRAM byte, at most
// the bytes in flight over 0.8 us of latency: half of each resident CTA's tile), plus one
// CTA's duration (the tail, and all there is at batch 1). Empty if no tiling applies.
std::vector<DepthwiseTile> DepthwiseCandidates(const PlanSpec& spec, const DeviceInfo& device) {
  const ConvGeometry& g = spec.conv;
  const int elem = static_cast<int>(dtype_size(spec.dtype));
  const int ch = 4 / elem;          // channels per 32-bit word
  const int cvt = elem == 2 ? 1 : 0;  // a conversion per channel of each word read, a pack
  const int64_t c = spec.c, n = spec.n, p = spec.out_h, q = spec.out_w;
  const int64_t rs = g.r * g.s;
  std::vector<DepthwiseTile> all;
  // Filter taps live in registers: larger filters take the vector kernel.
  if (!IsDepthwise(spec) || c % ch != 0 || rs * ch > 98 || n * p * q <= 0 ||
      spec.h * spec.w * c >= (int64_t{1} << 40)) {
    return all;
  }
  const int64_t window_h = (g.r - 1) * g.dil_h + 1, window_w = (g.s - 1) * g.dil_w + 1;
  const int sms = device.sm_count > 0 ? device.sm_count : 132;
  const int64_t smem_limit = std::min<int64_t>(device.max_smem_per_block, 227 * 1024);
  const double clock = 1.6e9, efficiency = 0.7, bandwidth = 3.0e12, latency = 0.8e-6;
  const double x_bytes = double(n) * spec.h * spec.w * c * elem;
  const double y_bytes = double(n) * p * q * c * elem;
  // Per thread: its taps and per-channel terms from the CTA's table, the tile's coordinates,
  // the barrier; per channel, building the table (loads, conversions, the batch-norm fold).
  const double prologue = double(rs) + 5.0 * ch + 45;
  const double table = 3.0 * rs + 40;  // per channel
  // Slices of 64 bytes or more (128 best): a warp's copies and stores then cover whole 32-byte
  // sectors, and the 64-byte units DRAM fetches, of every pixel; narrower only when C is.
  std::vector<int> slices;
  const int64_t min_slice = std::min<int64_t>(c, (64 + elem - 1) / elem);
  for (int64_t cs = ch; cs <= std::min<int64_t>(c, 64 * ch); cs += ch) {
    if (c % cs == 0 && cs >= min_slice) slices.push_back(static_cast<int>(cs));
  }
  // Per axis, per block size and blocks a tile (up to 4 x 16 rows, 8 x 16 columns).
  AxisCount rows[5][17], cols[9][17];
  for (int b = 1; b <= 8; ++b) {
    for (int nb = 1; nb <= 16; ++nb) {
      if (b <= 4) rows[b][nb] = CountAxis(p, spec.h, g.stride_h, g.pad_t, window_h, nb * b, b);
      cols[b][nb] = CountAxis(q, spec.w, g.stride_w, g.pad_l, window_w, nb * b, b);
    }
  }
  std::vector<DepthwiseTile> scored;
  for (int bh = 1; bh <= std::min<int64_t>(4, p); ++bh) {
    for (int bw = 1; bw <= std::min<int64_t>(8, q); ++bw) {
      const int64_t in_rows = (bh - 1) * g.stride_h + window_h;
      const int64_t in_cols = (bw - 1) * g.stride_w + window_w;
      // Registers (ptxas caps them at 128 up to 5x5 filters): taps, terms, accumulators, a
      // converted input row (an overestimate: ptxas reloads taps from the table if it must).
      const int64_t regs = 24 + ch * (rs + 4 + bh * bw + in_cols) + in_cols;
      if (regs > (rs > 25 ? 168 : 120)) continue;
      // Per block: FMAs and epilogue, shared loads (and conversions), stores (and packing).
      const double per_block = double(ch) * bh * bw * (rs + 7) +
                               double(in_rows) * in_cols * (1 + cvt * ch) +
                               double(bh) * bw * (1 + cvt) + 10;
      for (int nbh = 1; nbh <= 16 && (nbh - 1) * bh < p; ++nbh) {
        const int th = nbh * bh;
        const AxisCount& ah = rows[bh][nbh];
        for (int nbw = 1; nbw <= 16 && (nbw - 1) * bw < q; ++nbw) {
          const int tw = nbw * bw;
          const AxisCount& aw = cols[bw][nbw];
          const int64_t tile_rows = (th - 1) * g.stride_h + window_h;
          const int64_t tile_cols = (tw - 1) * g.stride_w + window_w;
          const int64_t tiles = n * ((p + th - 1) / th) * ((q + tw - 1) / tw);
          for (const int cs : slices) {
            DepthwiseTile t;
            t.cs = cs, t.bh = bh, t.bw = bw, t.th = th, t.tw = tw, t.large_filter = rs > 25;
            t.threads = cs / ch * nbh * nbw;
            // The input window, then the taps (fp32) and the 20-byte epilogue terms per channel.
            t.window = tile_rows * tile_cols * cs * elem;
            t.rs = rs, t.box_rows = tile_rows, t.box_cols = tile_cols;
            t.smem = t.SmemBytes();
            t.fill = (int64_t{cs} * elem) % 16 == 0 && (c * elem) % 16 == 0 ? 16 : 4;
            t.tiles = tiles;
            t.ctas = (c / cs) * tiles;
            // A warp or more (tiny outputs: all their words), at most 512 threads.
            if (t.threads < std::min<int64_t>(32, c / ch * p * q) || t.threads > 512 ||
                t.smem > smem_limit ||
                t.ctas > std::numeric_limits<int32_t>::max()) {
              continue;
            }
            const int warps = (t.threads + 31) / 32;
            const double lanes = warps * 32.0 / t.threads;  // idle lanes of a partial warp
            const int64_t regs_per_cta = (regs + 7) / 8 * 8 * warps * 32;
            const int per_sm = static_cast<int>(std::min<int64_t>(
                {64 / warps, 228 * 1024 / (t.smem + 1024), 65536 / regs_per_cta, 32}));
            if (per_sm < 1) continue;
            const int64_t row_chunks = tile_cols * cs * elem / t.fill;
            const double chunks = double(tiles) * (c / cs) * tile_rows * row_chunks;
            const double per_chunk = t.threads % row_chunks == 0 ? 8 : 14;
            const double work =
                (double(n) * c / ch * ah.blocks * aw.blocks * per_block + chunks * per_chunk) *
                lanes;
            const double loaded = double(n) * c * ah.loaded * aw.loaded * elem;
            const double bytes = x_bytes + y_bytes + 0.3 * std::max(0.0, loaded - x_bytes);
            const double used_sms = std::min<double>(sms, t.ctas);
            const double resident = std::min<double>(per_sm, std::ceil(t.ctas / double(sms)));
            const double issue_rate =
                used_sms * 128 * clock * efficiency * std::min(1.0, resident * warps / 16);
            const double issue =
                (work + double(t.ctas) * (t.threads * prologue + cs * table) * lanes) / issue_rate;
            const double in_flight = used_sms * resident * t.smem * 0.5;
            const double memory = bytes / std::min(bandwidth, in_flight / latency);
            const double per_thread =
                (work / lanes) / (double(t.ctas) * t.threads) + prologue + cs * table / t.threads;
            const double cta = latency + per_thread * warps / (4 * clock * efficiency);
            t.seconds = std::max(issue, memory) + cta;
            scored.push_back(t);
          }
        }
      }
    }
  }
  std::sort(scored.begin(), scored.end(), [](const DepthwiseTile& a, const DepthwiseTile& b) {
    return a.seconds < b.seconds;
  });
  // The best; then, within 1.5x of its estimate, the best with another channel slice, the best
  // with a block shape not yet taken, the best with a tile of half or twice the area of every
  // one taken; then any that differs from all taken in one of those ways.
  const auto other_slice = [&](const DepthwiseTile& t) {
    return std::all_of(all.begin(), all.end(),
                       [&](const DepthwiseTile& u) { return t.cs != u.cs; });
  };
  const auto other_block = [&](const DepthwiseTile& t) {
    return std::all_of(all.begin(), all.end(),
                       [&](const DepthwiseTile& u) { return t.bh != u.bh || t.bw != u.bw; });
  };
  const auto other_area = [&](const DepthwiseTile& t) {
    return std::all_of(all.begin(), all.end(), [&](const DepthwiseTile& u) {
      const double ratio = double(t.th) * t.tw / (double(u.th) * u.tw);
      return ratio >= 2 || ratio <= 0.5;
    });
  };
  const auto distinct = [&](const DepthwiseTile& t) {
    return std::all_of(all.begin(), all.end(), [&](const DepthwiseTile& u) {
      const double ratio = double(t.th) * t.tw / (double(u.th) * u.tw);
      return t.cs != u.cs || t.bh != u.bh || t.bw != u.bw || ratio >= 2 || ratio <= 0.5;
    });
  };
  for (const auto& wanted : std::vector<std::function<bool(const DepthwiseTile&)>>{
           [](const DepthwiseTile&) { return true; }, other_slice, other_block, other_area,
           distinct, distinct, distinct}) {
    for (const DepthwiseTile& t : scored) {
      if (all.size() >= 4 || (!all.empty() && t.seconds > 1.5 * all[0].seconds)) break;
      if (wanted(t)) {
        all.push_back(t);
        break;
      }
    }
  }
  // The best tiling walking 2 and 4 tiles a CTA, where that still leaves two CTAs a
  // multiprocessor: measured against the rest (the cost model above does not rank them).
  if (!all.empty()) {
    const DepthwiseTile best = all[0];
    for (const int walk : {2, 4}) {
      const DepthwiseTile t = best.Walking(walk, c / best.cs);
      if (t.smem <= smem_limit && t.window % 16 == 0 && t.ctas >= 2 * sms) all.push_back(t);
    }
  }
  // On sm_90 every tiling copies its windows with the copy engine where a box can (16-byte
  // rows of channels, at most 256 rows and columns), and the best one is timed with cp.async
  // too, so autotuning keeps the older copy wherever it is faster.
  if (!device.hip && device.arch == "sm_90" && !all.empty()) {
    const DepthwiseTile best = all[0];
    size_t bulk = 0;
    for (DepthwiseTile& t : all) {
      const DepthwiseTile b = t.Bulk();
      if (t.fill == 16 && t.box_rows <= 256 && t.box_cols <= 256 && b.smem <= smem_limit &&
          n < (int64_t{1} << 31)) {
        t = b;
        ++bulk;
      }
    }
    if (bulk > 0 && all[0].tma) {
      all.push_back(best);
      all.back().twin = true;
    }
  }
  return all;
}

// The copy engine's map of a depthwise plan's input for `t`'s windows: NHWC as a 4-D tensor
// (C, W, H, N), a box of the slice's channels x the window's columns x its rows x one image,
// unswizzled (the kernel reads the window pixel-major, as cp.async lays it out).
TensorMapSpec DepthwiseMap(const PlanSpec& spec, const DepthwiseTile& t) {
  TensorMapSpec x = NhwcInputMap(spec);
  x.swizzle = 0;
  x.box[0] = static_cast<uint32_t>(t.cs);
  x.box[1] = static_cast<uint32_t>(t.box_cols);
  x.box[2] = static_cast<uint32_t>(t.box_rows);
  x.box[3] = 1;
  return x;
}

// The vector kernel: 16 bytes of channels a thread, any filter size.
bool DepthwiseVectorApplies(const PlanSpec& spec) {
  return IsDepthwise(spec) && spec.c % ChunkValues(spec.dtype) == 0;
}

int DepthwiseVariants(const PlanSpec& spec, const DeviceInfo& device) {
  const int tiled = static_cast<int>(DepthwiseCandidates(spec, device).size());
  return std::max(1, tiled + (DepthwiseVectorApplies(spec) ? 1 : 0));
}

std::string DepthwiseConstants(const DepthwiseTile& t) {
  Text s;
  s << "constexpr int kBH = " << t.bh << ", kBW = " << t.bw << ", kTH = " << t.th
    << ", kTW = " << t.tw << ", kCS = " << t.cs << ", kWalk = " << t.walk << ";\n"
    << "constexpr int kFill = " << t.fill << ", kThreads = " << t.threads
    << ", kMinBlocks = " << t.MinBlocks() << ";\n"
    << "constexpr int kSmemBytes = " << t.smem << ";\n"
    << "}  // namespace plan\n}  // namespace jaxfuse\n#define JF_DEPTHWISE_TILED 1\n"
    << (t.tma ? "#define JF_DEPTHWISE_TMA 1\n" : "")
    << "namespace jaxfuse {\nnamespace plan {\n";
  return s.str();
}

// ----- depthwise convolution in NCHW (conv_planes.cuh) ----------------------------------------

// One tiling of the planar depthwise kernel: a CTA computes a th x tw tile of output pixels of
// `planes` (image, channel) planes, each thread bh x cw outputs (bh rows of cw columns).
struct PlanesTile {
  int th = 0, tw = 0, bh = 0, cw = 1, planes = 0;
  int threads = 0;  // 0: the kernel does not apply
  int min_blocks = 0;  // > 0: registers capped so that this many CTAs fit a multiprocessor
  int64_t ctas = 0;
  std::string Name() const {
    return std::to_string(th) + "x" + std::to_string(tw) + " p" + std::to_string(planes) +
           " b" + std::to_string(bh) + (cw > 1 ? " c" + std::to_string(cw) : "") +
           (min_blocks > 0 ? " o" + std::to_string(min_blocks) : "");
  }
};

bool IsPlanarDepthwise(const PlanSpec& spec) {
  const ConvGeometry& g = spec.conv;
  return spec.has_conv && g.groups == spec.c && g.k == spec.c &&
         spec.layout == Layout::kNCHW && !spec.mixed_layouts();
}

// Static shared memory, and the taps a thread keeps in registers (9x9 at most).
constexpr int64_t kPlanesSmemBytes = 48 * 1024;
constexpr int64_t kPlanesMaxTaps = 81;
constexpr int kMaxThreadsPerSm = 2048;

// The tiling for `spec` with `bh` output rows and `cw` columns a thread: output rows of up to 64
// columns whole, wider ones in tiles of 32-64 columns (the width that leaves the fewest idle
// columns); up to 256 threads a plane; whole small planes several a CTA while the CTAs still
// fill the device twice over. Two columns a thread need an even tile width; their rows a tile
// are the count that leaves the fewest idle rows (the most of those).
PlanesTile PlanesTileFor(const PlanSpec& spec, const DeviceInfo& device, int bh_max = 4,
                         int cw = 1) {
  const ConvGeometry& g = spec.conv;
  PlanesTile t;
  if (!IsPlanarDepthwise(spec) || int64_t{g.r} * g.s > kPlanesMaxTaps ||
      spec.output_elements() == 0) {
    return t;
  }
  const int64_t p = spec.out_h, q = spec.out_w, plane_count = spec.n * spec.c;
  int tw = static_cast<int>(std::min<int64_t>(q, 64));
  if (q > 64) {
    int64_t fewest = std::numeric_limits<int64_t>::max();
    for (int width : {32, 40, 48, 56, 64}) {
      const int64_t covered = (q + width - 1) / width * width;
      if (covered <= fewest) fewest = covered, tw = width;
    }
  }
  if (tw % cw != 0) return t;
  const int bh = static_cast<int>(std::min<int64_t>(bh_max, p));
  const int columns = tw / cw;  // threads a row of the tile
  int rows = static_cast<int>(std::min<int64_t>(std::max(1, 256 / columns), (p + bh - 1) / bh));
  if (cw > 1) {
    const auto covered = [&](int r) { return (p + int64_t{r} * bh - 1) / (int64_t{r} * bh) * r; };
    for (int r = rows - 1; r >= 1; --r) {
      if (covered(r) < covered(rows)) rows = r;
    }
  }
  int planes = 1;
  if (int64_t{rows} * bh >= p && tw >= q) {
    const int64_t filling = plane_count / (2 * std::max(device.sm_count, 1));
    planes = static_cast<int>(std::clamp<int64_t>(filling, 1, std::max(1, 256 / (columns * rows))));
  }
  // (The window as conv_planes.cuh lays it out: with pairs, one more column where the left
  // padding is odd and an even row pitch.)
  const bool pairs = cw == 2 && spec.w % 2 == 0;
  const auto smem = [&] {
    const int64_t wh = int64_t{rows * bh - 1} * g.stride_h + int64_t{g.r - 1} * g.dil_h + 1;
    int64_t ww = int64_t{tw - 1} * g.stride_w + int64_t{g.s - 1} * g.dil_w + 1;
    if (pairs) ww = (ww + (g.pad_l % 2 + 2) % 2 + 1) / 2 * 2;
    return planes * wh * ww * 4;
  };
  while (smem() > kPlanesSmemBytes) {  // (large strides or dilations)
    if (planes > 1) {
      planes = (planes + 1) / 2;
    } else if (rows > 1) {
      rows = (rows + 1) / 2;
    } else if (tw > 8 && cw == 1) {
      tw = (tw + 1) / 2;
    } else if (tw > 8 && tw % 4 == 0) {  // (two columns a thread: the width stays even)
      tw /= 2;
    } else {
      return t;
    }
  }
  const int th = rows * bh;
  const int64_t ctas = (plane_count + planes - 1) / planes * ((p + th - 1) / th) *
                       ((q + tw - 1) / tw);
  if (ctas > std::numeric_limits<int32_t>::max()) return t;
  t.th = th, t.tw = tw, t.bh = bh, t.cw = cw, t.planes = planes;
  t.threads = tw / cw * rows * planes;
  t.ctas = ctas;
  return t;
}

// The planar kernel's candidates, the first its default: 4 rows a thread; the same with
// registers for a whole multiprocessor of threads (filters up to 3x3, where the cap costs few
// spills); 8 rows a thread, a taller window a CTA; 4 and 8 rows of two columns a thread (even
// tile widths), whose window moves in pairs where the planes' width is even.
std::vector<PlanesTile> PlanesCandidates(const PlanSpec& spec, const DeviceInfo& device) {
  std::vector<PlanesTile> out;
  const PlanesTile first = PlanesTileFor(spec, device);
  if (first.threads == 0) return out;
  out.push_back(first);
  const int full = kMaxThreadsPerSm / first.threads;
  if (!device.hip && int64_t{spec.conv.r} * spec.conv.s <= 9 && full > 1) {
    PlanesTile capped = first;
    capped.min_blocks = std::min(full, 32);
    out.push_back(capped);
  }
  if (const PlanesTile tall = PlanesTileFor(spec, device, 8);
      tall.threads > 0 && tall.Name() != first.Name()) {
    out.push_back(tall);
  }
  // Two columns a thread, 4 and 8 rows.
  for (int bh : {4, 8}) {
    const PlanesTile paired = PlanesTileFor(spec, device, bh, 2);
    const bool distinct = std::none_of(out.begin(), out.end(), [&](const PlanesTile& t) {
      return t.Name() == paired.Name();
    });
    if (paired.threads > 0 && distinct) out.push_back(paired);
  }
  return out;
}

std::string PlanesConstants(const PlanesTile& t) {
  Text s;
  s << "constexpr int kTH = " << t.th << ", kTW = " << t.tw << ", kBH = " << t.bh
    << ", kCW = " << t.cw << ", kPlanes = " << t.planes
    << ", kMinBlocks = " << std::max(t.min_blocks, 1) << ";\n";
  return s.str();
}

}  // namespace

namespace {

// One k-step of wgmma as a device function: `head` is its declaration, `operand(i)` names the
// accumulator of register i; the transposes say which operands are MN-major (16-bit only).
std::string WgmmaStep(const std::string& head, int n, int dtype, bool a_mn_major,
                      bool b_mn_major, const std::function<std::string(int)>& operand) {
  const int regs = n / 2;
  const bool tf32 = dtype == 0;
  const char* type = tf32 ? "tf32" : dtype == 2 ? "bf16" : "f16";
  Text s;
  s << "namespace jaxfuse {\nnamespace wgmma {\n"
    << head << " {\n"
    << "  asm volatile(\n"
    << "      \"{\\n.reg .pred p;\\nsetp.ne.b32 p, %" << regs + 2 << ", 0;\\n\"\n"
    << "      \"wgmma.mma_async.sync.aligned.m64n" << n << (tf32 ? "k8" : "k16") << ".f32." << type
    << "." << type << " {\"\n      \"";
  for (int i = 0; i < regs; ++i) {
    s << "%" << i << (i + 1 < regs ? ", " : "");
    if (i % 16 == 15 && i + 1 < regs) s << "\"\n      \"";
  }
  // scale-d = p (accumulate), scale-a = scale-b = 1, then the transposes of A and B (TF32
  // takes none: both K-major).
  s << "}, %" << regs << ", %" << regs + 1 << ", p, 1, 1";
  if (!tf32) s << ", " << (a_mn_major ? 1 : 0) << ", " << (b_mn_major ? 1 : 0);
  s << ";\\n}\\n\"\n      : ";
  for (int i = 0; i < regs; ++i) {
    s << "\"+f\"(" << operand(i) << ")" << (i + 1 < regs ? ", " : "");
    if (i % 8 == 7 && i + 1 < regs) s << "\n        ";
  }
  s << "\n      : \"l\"(a), \"l\"(b), \"r\"(1));\n}\n}  // namespace wgmma\n}  // namespace jaxfuse\n";
  return s.str();
}

}  // namespace

std::string WgmmaFunction(int n, int dtype, bool b_mn_major) {
  return WgmmaStep("JF_DEVICE void mma_64xN(float (&d)[" + std::to_string(n / 2) +
                       "], u64 a, u64 b)",
                   n, dtype, false, b_mn_major,
                   [](int i) { return "d[" + std::to_string(i) + "]"; });
}

std::string WgmmaSwappedFunction(int n, int dtype) {
  return WgmmaStep("JF_DEVICE void mma_swapped(float (&d)[" + std::to_string(n / 64) +
                       "][32], u64 a, u64 b)",
                   n, dtype, true, false, [](int i) {
                     return "d[" + std::to_string(i / 32) + "][" + std::to_string(i % 32) + "]";
                   });
}

// The pointwise kernel's shape: each thread moves `vec_bytes` (16, or 8 for 16-bit data) a
// step, in at most 8 blocks of 256 threads per multiprocessor (each then streams several
// vectors, with kUnroll of them in flight), or one vector per thread for
// small tensors (the grid's threads cover the tensor; with whole channel vectors per pixel,
// the threads past a multiple of them idle): jaxfuse_pointwise then loads it first
// (pointwise.cuh: kSingleVector). `vector_terms`: pointwise.cuh's kVectorTerms.
struct PointwiseShape {
  int vec_bytes = 16;
  bool vector_terms = false;
};

struct PointwiseLaunch {
  unsigned grid;
  bool fixed_channels;  // NHWC, whole vectors of channels per pixel
  bool single;          // one vector a thread
};

PointwiseLaunch PointwiseLaunchFor(const PlanSpec& spec, const DeviceInfo& device,
                                   const PointwiseShape& shape) {
  const int lanes = shape.vec_bytes / static_cast<int>(dtype_size(spec.dtype));
  const int64_t elements = spec.output_elements();
  PointwiseLaunch launch;
  launch.fixed_channels = spec.layout == Layout::kNHWC && spec.c % lanes == 0;
  launch.grid = std::min(GridFor(elements / lanes + 1, 256, device),
                         static_cast<unsigned>(std::max(device.sm_count, 1) * 8));
  int64_t threads = int64_t{launch.grid} * 256;
  if (launch.fixed_channels) threads -= threads % (spec.c / lanes);
  launch.single = threads >= elements / lanes;
  return launch;
}

// The pointwise kernel's variants, autotuned: first the block table of 16-byte vectors (the
// heuristic's choice); for single vectors of fixed channels (NHWC) or of one channel (NCHW)
// with per-channel parameters, each thread reading its own terms (kVectorTerms); and for
// small 16-bit tensors, where the kernel's time is a few memory latencies, both with 8-byte
// vectors (twice the threads, each with half the work, as XLA's loop fusions at batch 1). On an H100 at batch 1 (session 9,
// scripts/variant_sweep.py) these won every NA layer of the benchmark (2.9 / 3.0 / 1.7 us
// against 3.2 / 3.3 / 2.3 us for the first); blocks of 128 threads gained nothing.
std::vector<PointwiseShape> PointwiseShapes(const PlanSpec& spec, const DeviceInfo& device) {
  std::vector<PointwiseShape> shapes{{16, false}};
  const bool per_channel = spec.has(PointwiseOp::kBias) || spec.bn == BnMode::kSpatial;
  auto offer = [&](int vec_bytes) {
    const PointwiseShape table{vec_bytes, false};
    const PointwiseLaunch launch = PointwiseLaunchFor(spec, device, table);
    if (!launch.single) return;
    if (vec_bytes != 16) shapes.push_back(table);
    const int lanes = vec_bytes / static_cast<int>(dtype_size(spec.dtype));
    // Terms of its own: NHWC with 4 channels or more a thread (whole 16-byte parameter
    // loads), or NCHW planes of whole vectors (one channel a vector: a block spans a few
    // channels, and a table would fold all C of them).
    const bool channel_per_vector =
        spec.layout == Layout::kNCHW && (spec.h * spec.w) % lanes == 0;
    if (per_channel && ((launch.fixed_channels && lanes % 4 == 0) || channel_per_vector)) {
      shapes.push_back({vec_bytes, true});
    }
  };
  offer(16);
  if (dtype_size(spec.dtype) == 2) offer(8);
  return shapes;
}

int CountVariants(const PlanSpec& spec, const DeviceInfo& device) {
  if (!spec.has_conv) return static_cast<int>(PointwiseShapes(spec, device).size());
  if (WgmmaApplies(spec, device)) {
    const size_t tma = TmaApplies(spec, device) ? TmaCandidates(spec, device).size() : 0;
    return static_cast<int>(WgmmaCandidates(spec, device).size() + tma);
  }
  if (IgemmApplies(spec, device) || StemOffered(spec, device)) {
    const size_t igemm = IgemmApplies(spec, device) ? IgemmCandidates(spec, device).size() : 0;
    return static_cast<int>(igemm + StemCandidates(spec, device).size());
  }
  if (IsDepthwise(spec)) return DepthwiseVariants(spec, device);
  if (const size_t planes = PlanesCandidates(spec, device).size(); planes > 0) {
    return static_cast<int>(planes) + 1;  // the planar kernel's tilings, conv_direct
  }
  return 1;
}

GeneratedKernel GenerateKernel(const PlanSpec& spec, const DeviceInfo& device, int variant) {
  GeneratedKernel out;
  variant = std::max(variant, 0);  // (indices past a solver's last variant clamp below)
  const int64_t elements = spec.output_elements();
  if (!spec.has_conv) {
    const std::vector<PointwiseShape> shapes = PointwiseShapes(spec, device);
    const PointwiseShape& shape = shapes[std::min<size_t>(variant, shapes.size() - 1)];
    const PointwiseLaunch launch = PointwiseLaunchFor(spec, device, shape);
    // pointwise.cuh: kChannelTable.
    const unsigned table_bytes =
        (!launch.fixed_channels || launch.single) && spec.c <= kMaxTableChannels &&
                !shape.vector_terms
            ? static_cast<unsigned>(kTableFloatsPerChannel * spec.c * sizeof(float))
            : 0;
    out.solver = "pointwise";
    if (shape.vec_bytes != 16) out.tile = std::to_string(shape.vec_bytes) + "B";
    if (shape.vector_terms) out.tile += out.tile.empty() ? "vector terms" : " vector terms";
    out.source = TranslationUnit(
        spec,
        std::string("constexpr bool kSingleVector = ") + (launch.single ? "true" : "false") +
            ";\nconstexpr bool kVectorTerms = " + (shape.vector_terms ? "true" : "false") +
            ";\nconstexpr int kVecBytes = " + std::to_string(shape.vec_bytes) + ";\n",
        {"pointwise.cuh"});
    out.entries.push_back({"jaxfuse_pointwise", launch.grid, 256, table_bytes, shape.vec_bytes});
    out.entries.push_back({"jaxfuse_pointwise_scalar", launch.grid, 256, table_bytes, 1});
    return out;
  }
  const EntryPoint direct{"jaxfuse_conv_direct", GridFor(elements, 256, device), 256, 0, 1};
  if (WgmmaApplies(spec, device)) {
    const std::vector<WgmmaTile> tiles = WgmmaCandidates(spec, device);
    // Variants past the cp.async kernel's tiles are the warp-specialized TMA kernel's.
    const std::vector<TmaTile> tma_tiles =
        TmaApplies(spec, device) ? TmaCandidates(spec, device) : std::vector<TmaTile>{};
    const int tma_variant = variant - static_cast<int>(tiles.size());
    if (tma_variant >= 0 && !tma_tiles.empty()) {
      const TmaTile tile =
          tma_tiles[std::min<int>(tma_variant, static_cast<int>(tma_tiles.size()) - 1)];
      const ConvGeometry& g = spec.conv;
      const int64_t m = spec.n * spec.out_h * spec.out_w, kg = g.k / g.groups;
      const int64_t tiles_total =
          tile.halo ? spec.n * ((spec.out_h + tile.bm / 8 - 1) / (tile.bm / 8)) *
                          ((spec.out_w + 7) / 8)
                    : (m + tile.bm - 1) / tile.bm * ((kg + tile.bn - 1) / tile.bn) * g.groups;
      const int sms = device.sm_count > 0 ? device.sm_count : 132;
      out.solver = "conv_tma";
      out.tile = std::to_string(tile.bm) + "x" + std::to_string(tile.bn) + " s" +
                 std::to_string(tile.stages) + " e" + std::to_string(tile.epi_cols) + " b" +
                 std::to_string(tile.blocks) + (tile.pingpong ? " pp" : "") +
                 (tile.swap ? " sw" : "") + (tile.halo ? " halo" : "");
      out.compile_arch = "sm_90a";
      const int dtype = spec.dtype == DType::kBF16 ? 2 : spec.dtype == DType::kF16 ? 1 : 0;
      // (conv_tma.cuh names both multiplies; the one a tile does not use is a stub.)
      out.source = TranslationUnit(spec, TmaConstants(tile), {}) +
                   WgmmaFunction(tile.bn, dtype,
                                 dtype != 0 && g.filter_layout == FilterLayout::kHWIO) +
                   (tile.swap ? WgmmaSwappedFunction(tile.bm, dtype)
                              : std::string("namespace jaxfuse {\nnamespace wgmma {\n"
                                            "template <typename D>\n"
                                            "JF_DEVICE void mma_swapped(D&, u64, u64) {}\n"
                                            "}  // namespace wgmma\n}  // namespace jaxfuse\n")) +
                   "#include \"conv_tma.cuh\"\n#include \"conv_direct.cuh\"\n";
      EntryPoint entry{"jaxfuse_conv_tma",
                       static_cast<unsigned>(std::min<int64_t>(tiles_total, sms * tile.blocks)),
                       TmaTile::kThreads, static_cast<unsigned>(tile.SmemBytes()), 16};
      entry.tensor_maps = TmaMaps(spec, tile);
      out.entries.push_back(entry);
      out.entries.push_back(direct);
      return out;
    }
    const WgmmaTile tile = tiles[std::clamp<int>(variant, 0, static_cast<int>(tiles.size()) - 1)];
    const ConvGeometry& g = spec.conv;
    const int64_t m = spec.n * spec.out_h * spec.out_w, kg = g.k / g.groups;
    const int64_t blocks = ((m + tile.bm - 1) / tile.bm) * ((kg + tile.bn - 1) / tile.bn) *
                           g.groups * tile.splits;
    const int dtype = spec.dtype == DType::kBF16 ? 2 : spec.dtype == DType::kF16 ? 1 : 0;
    out.solver = "conv_wgmma";
    out.tile = std::to_string(tile.bm) + "x" + std::to_string(tile.bn) + " s" +
               std::to_string(tile.stages) + " b" + std::to_string(tile.min_blocks) +
               (tile.splits > 1 ? " k/" + std::to_string(tile.splits) : "");
    out.compile_arch = "sm_90a";
    out.source = TranslationUnit(spec, WgmmaConstants(tile), {}) +
                 WgmmaFunction(tile.bn, dtype, g.filter_layout == FilterLayout::kHWIO) +
                 "#include \"conv_wgmma.cuh\"\n#include \"conv_direct.cuh\"\n";
    out.entries.push_back({"jaxfuse_conv_wgmma", static_cast<unsigned>(blocks),
                           static_cast<unsigned>(tile.Threads()),
                           static_cast<unsigned>(tile.SmemBytes()), 16});
    out.entries.push_back(direct);
    return out;
  }
  if (IgemmApplies(spec, device) || StemOffered(spec, device)) {
    const std::vector<IgemmTile> tiles =
        IgemmApplies(spec, device) ? IgemmCandidates(spec, device) : std::vector<IgemmTile>{};
    // Variants past the mma.sync kernel's tiles (if it applies) are the stem kernel's.
    const std::vector<StemTile> stems = StemCandidates(spec, device);
    const int stem_variant = variant - static_cast<int>(tiles.size());
    if (stem_variant >= 0 && !stems.empty()) {
      const StemTile tile =
          stems[std::min<int>(stem_variant, static_cast<int>(stems.size()) - 1)];
      const int64_t segments = (spec.out_w + tile.bm - 1) / tile.bm;
      const int64_t tiles_total = spec.n * spec.out_h * segments;
      const int sms = device.sm_count > 0 ? device.sm_count : 132;
      out.solver = "conv_stem";
      out.tile = std::to_string(tile.bm) + "x" + std::to_string(spec.conv.k) +
                 " w" + std::to_string(tile.Threads() / 32) + " b" +
                 std::to_string(tile.min_blocks) + (tile.staged ? "" : " r");
      out.source = TranslationUnit(spec, StemConstants(spec, tile),
                                   {"conv_stem.cuh", "conv_direct.cuh"});
      out.entries.push_back(
          {"jaxfuse_conv_stem",
           static_cast<unsigned>(std::min<int64_t>(tiles_total, int64_t{sms} * tile.min_blocks)),
           static_cast<unsigned>(tile.Threads()),
           static_cast<unsigned>(StemSmemBytes(spec, tile)), 16});
      out.entries.push_back(direct);
      return out;
    }
    const IgemmTile tile = tiles[std::clamp<int>(variant, 0, static_cast<int>(tiles.size()) - 1)];
    const ConvGeometry& g = spec.conv;
    const bool b_rows_are_k = g.filter_layout == FilterLayout::kHWIO;
    const int64_t m = spec.n * spec.out_h * spec.out_w, kg = g.k / g.groups;
    const int64_t blocks = ((m + tile.bm - 1) / tile.bm) * ((kg + tile.bn - 1) / tile.bn) * g.groups;
    out.solver = "conv_igemm";
    out.tile = std::to_string(tile.bm) + "x" + std::to_string(tile.bn) + "x" +
               std::to_string(tile.bk) + " s" + std::to_string(tile.stages) + " b" +
               std::to_string(tile.min_blocks);
    out.source = TranslationUnit(spec, IgemmConstants(tile, b_rows_are_k),
                                 {"conv_igemm.cuh", "conv_direct.cuh"});
    out.entries.push_back({"jaxfuse_conv_igemm", static_cast<unsigned>(blocks),
                           static_cast<unsigned>(tile.Threads()),
                           static_cast<unsigned>(tile.SmemBytes(b_rows_are_k)), 16});
    out.entries.push_back(direct);
    return out;
  }
  if (IsDepthwise(spec)) {
    // The tiled kernel's tilings, then the vector kernel (the only one for filters too large
    // for registers; otherwise a candidate autotuning times against them).
    const std::vector<DepthwiseTile> tiles = DepthwiseCandidates(spec, device);
    const int count = static_cast<int>(tiles.size()) + (DepthwiseVectorApplies(spec) ? 1 : 0);
    const int v = std::clamp<int>(variant, 0, std::max(count, 1) - 1);
    if (v < static_cast<int>(tiles.size())) {
      const DepthwiseTile& tile = tiles[v];
      out.solver = "conv_depthwise";
      out.tile = tile.Name();
      out.source = TranslationUnit(spec, DepthwiseConstants(tile),
                                   {"conv_depthwise.cuh", "conv_direct.cuh"});
      EntryPoint entry{"jaxfuse_conv_depthwise", static_cast<unsigned>(tile.ctas),
                       static_cast<unsigned>(tile.threads), static_cast<unsigned>(tile.smem),
                       tile.fill};
      if (tile.tma) entry.tensor_maps = {DepthwiseMap(spec, tile)};
      out.entries.push_back(entry);
      out.entries.push_back(direct);
      return out;
    }
    if (DepthwiseVectorApplies(spec)) {
      const int lanes = ChunkValues(spec.dtype);
      out.solver = "conv_depthwise";
      out.tile = "vector";
      out.source = TranslationUnit(spec, "", {"conv_depthwise.cuh", "conv_direct.cuh"});
      out.entries.push_back({"jaxfuse_conv_depthwise_vector",
                             GridFor(elements / lanes, 256, device), 256, 0, 16});
      out.entries.push_back(direct);
      return out;
    }
  }
  // NCHW depthwise: the planar kernel's tilings, or (the last variant, a candidate autotuning
  // times against them) conv_direct.
  if (const std::vector<PlanesTile> tiles = PlanesCandidates(spec, device);
      static_cast<size_t>(variant) < tiles.size()) {
    const PlanesTile& planes = tiles[variant];
    out.solver = "conv_planes";
    out.tile = planes.Name();
    out.source = TranslationUnit(spec, PlanesConstants(planes),
                                 {"conv_direct.cuh", "conv_planes.cuh"});
    // (Two columns a thread move pairs of values: the buffers aligned to a pair, else
    // conv_direct runs.)
    const int pair_bytes = planes.cw == 2 ? 2 * (spec.dtype == DType::kF32 ? 4 : 2) : 1;
    out.entries.push_back({"jaxfuse_conv_planes", static_cast<unsigned>(planes.ctas),
                           static_cast<unsigned>(planes.threads), 0, pair_bytes});
    out.entries.push_back(direct);
    return out;
  }
  out.solver = "conv_direct";
  out.source = TranslationUnit(spec, "", {"conv_direct.cuh"});
  out.entries.push_back(direct);
  return out;
}

}  // namespace jaxfuse::gpu
