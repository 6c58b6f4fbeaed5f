#include "common/plan_spec.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <iterator>
#include <stdexcept>

#include "kernels/epilogue.h"

namespace jaxfuse {
namespace {

// Every size fits in int32, so kernels may index one dimension with an int, and products of a
// few of them never overflow int64.
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

[[noreturn]] void Fail(const std::string& what) {
  throw std::invalid_argument("invalid jaxfuse plan: " + what);
}

std::vector<std::string_view> Split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t end = text.find(sep, start);
    parts.push_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return parts;
}

int64_t ParseInt(std::string_view field, std::string_view text, int64_t lo, int64_t hi) {
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool whole = ptr == text.data() + text.size();
  if (ec == std::errc::result_out_of_range && whole) {
    Fail(std::string(field) + " entry " + std::string(text) + " is outside [" +
         std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  if (ec != std::errc() || !whole) {
    Fail(std::string(field) + " has a non-integer entry '" + std::string(text) + "'");
  }
  if (value < lo || value > hi) {
    Fail(std::string(field) + " entry " + std::to_string(value) + " is outside [" +
         std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return value;
}

// Plans are short (a full convolution plan is under 300 characters).
constexpr size_t kMaxTextLength = 1024;

// The characters the grammar uses: separators, letters, digits, '-' (negative padding) and '_'
// (per_activation). Nothing else, so no newline, control character, '#', quote or non-ASCII
// byte ever passes the parser.
bool InGrammar(char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
         ch == ';' || ch == '=' || ch == ',' || ch == '-' || ch == '_';
}

// Refuses field `index` if it has a character outside the grammar, naming the field by its key
// when the character comes after the '=' (the key is then all grammar characters).
void CheckCharacters(std::string_view field, size_t index) {
  for (size_t i = 0; i < field.size(); ++i) {
    if (InGrammar(field[i])) continue;
    const unsigned char ch = static_cast<unsigned char>(field[i]);
    char code[8];  // printable ASCII quoted, anything else as a \x escape
    std::snprintf(code, sizeof(code), ch > 0x20 && ch < 0x7f ? "'%c'" : "\\x%02x", ch);
    const size_t eq = field.find('=');
    const std::string name = index == 0 ? "the version tag"
                             : eq < i   ? "'" + std::string(field.substr(0, eq)) + "'"
                                        : "field " + std::to_string(index);
    Fail(name + " has a character outside the plan grammar (" + code + " at offset " +
         std::to_string(i) + ")");
  }
}

const char* FilterLayoutName(FilterLayout layout) {
  switch (layout) {
    case FilterLayout::kOIHW: return "OIHW";
    case FilterLayout::kHWIO: return "HWIO";
    case FilterLayout::kOHWI: return "OHWI";
  }
  return "?";
}

// The canonical form: jaxfuse.PlanSignature.encode()'s field order and spelling.
std::string Canonical(const PlanSpec& spec) {
  auto join = [](std::initializer_list<int64_t> values) {
    std::string out;
    for (int64_t v : values) out += (out.empty() ? "" : ",") + std::to_string(v);
    return out;
  };
  const char* dtype = spec.dtype == DType::kF32 ? "f32" : spec.dtype == DType::kF16 ? "f16"
                                                                                     : "bf16";
  std::string out = std::string("jaxfuse1;dtype=") + dtype +
                    ";layout=" + (spec.layout == Layout::kNCHW ? "NCHW" : "NHWC") +
                    (spec.mixed_layouts()
                         ? std::string(";olayout=") +
                               (spec.out_layout == Layout::kNCHW ? "NCHW" : "NHWC")
                         : std::string()) +
                    ";in=" + join({spec.n, spec.c, spec.h, spec.w}) + ";ops=";
  if (spec.has_conv) out += 'C';
  for (PointwiseOp op : spec.pointwise) out += static_cast<char>(op);
  if (spec.has_conv) {
    const ConvGeometry& g = spec.conv;
    out += ";conv=" + join({g.k, g.r, g.s, g.stride_h, g.stride_w, g.pad_t, g.pad_b, g.pad_l,
                            g.pad_r, g.dil_h, g.dil_w, g.groups}) +
           "," + FilterLayoutName(g.filter_layout) + "," + (g.allow_tf32 ? "1" : "0");
    if (spec.wide_filters()) out += ";wdtype=f32";
  }
  if (spec.bn != BnMode::kNone) {
    out += spec.bn == BnMode::kSpatial ? ";bn=spatial" : ";bn=per_activation";
  }
  if (spec.has(PointwiseOp::kActivation)) out += ";act=" + std::to_string(spec.activation);
  return out;
}

}  // namespace

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
  }
  return "?";
}

bool PlanSpec::has(PointwiseOp op) const {
  return std::find(pointwise.begin(), pointwise.end(), op) != pointwise.end();
}

std::vector<PlanSpec::Operand> PlanSpec::operands() const {
  std::vector<Operand> ops{{"x", input_elements(), true}};
  if (has_conv) ops.push_back({"w", filter_elements(), !wide_filters()});
  for (PointwiseOp op : pointwise) {
    switch (op) {
      case PointwiseOp::kBias: ops.push_back({"bias", out_c, false}); break;
      case PointwiseOp::kBatchNorm:
        for (const char* name : {"scale", "shift", "mean", "var"}) {
          ops.push_back({name, bn_param_elements(), false});
        }
        break;
      case PointwiseOp::kSideAdd: ops.push_back({"side", output_elements(), true}); break;
      case PointwiseOp::kActivation: break;
    }
  }
  ops.push_back({"scalars", kNumScalars, false});
  return ops;
}

PlanSpec PlanSpec::Parse(std::string_view text) {
  if (text.size() > kMaxTextLength) {
    Fail("the plan is " + std::to_string(text.size()) + " characters long; at most " +
         std::to_string(kMaxTextLength) + " are allowed");
  }
  PlanSpec spec;
  std::vector<std::string_view> fields = Split(text, ';');
  for (size_t i = 0; i < fields.size(); ++i) CheckCharacters(fields[i], i);
  if (fields[0] != "jaxfuse1") Fail("missing the 'jaxfuse1' version tag");
  // Each field at most once: with a repeated one, only one value would be validated.
  struct Field {
    std::string_view key, value;
    bool seen = false;
  };
  Field named[] = {{"dtype", {}}, {"layout", {}}, {"in", {}}, {"ops", {}},
                   {"conv", {}},  {"bn", {}},     {"act", {}}, {"wdtype", {}},
                   {"olayout", {}}};
  for (size_t i = 1; i < fields.size(); ++i) {
    const size_t eq = fields[i].find('=');
    if (eq == std::string_view::npos) Fail("field '" + std::string(fields[i]) + "' has no '='");
    const std::string_view key = fields[i].substr(0, eq), value = fields[i].substr(eq + 1);
    Field* field = std::find_if(std::begin(named), std::end(named),
                                [&](const Field& f) { return f.key == key; });
    if (field == std::end(named)) Fail("unknown field '" + std::string(key) + "'");
    if (field->seen) Fail("field '" + std::string(key) + "' is repeated");
    if (value.empty()) Fail("'" + std::string(key) + "' is empty");
    field->seen = true;
    field->value = value;
  }
  const std::string_view dtype_text = named[0].value, layout_text = named[1].value,
                         in_text = named[2].value, ops_text = named[3].value,
                         conv_text = named[4].value, bn_text = named[5].value,
                         act_text = named[6].value, wdtype_text = named[7].value,
                         olayout_text = named[8].value;
  if (dtype_text.empty() || layout_text.empty() || in_text.empty() || ops_text.empty()) {
    Fail("needs dtype, layout, in and ops fields");
  }
  if (dtype_text == "f32") spec.dtype = DType::kF32;
  else if (dtype_text == "f16") spec.dtype = DType::kF16;
  else if (dtype_text == "bf16") spec.dtype = DType::kBF16;
  else Fail("unknown dtype '" + std::string(dtype_text) + "'");
  if (layout_text == "NCHW") spec.layout = Layout::kNCHW;
  else if (layout_text == "NHWC") spec.layout = Layout::kNHWC;
  else Fail("unknown layout '" + std::string(layout_text) + "'");
  spec.out_layout = spec.layout;
  if (olayout_text == "NCHW") spec.out_layout = Layout::kNCHW;
  else if (olayout_text == "NHWC") spec.out_layout = Layout::kNHWC;
  else if (!olayout_text.empty()) Fail("unknown olayout '" + std::string(olayout_text) + "'");
  auto dims = Split(in_text, ',');
  if (dims.size() != 4) Fail("'in' needs 4 dimensions (N,C,H,W)");
  spec.n = ParseInt("in", dims[0], 0, kMaxDim);
  spec.c = ParseInt("in", dims[1], 1, kMaxDim);
  spec.h = ParseInt("in", dims[2], 1, kMaxDim);
  spec.w = ParseInt("in", dims[3], 1, kMaxDim);

  std::string seen;
  for (size_t i = 0; i < ops_text.size(); ++i) {
    char letter = ops_text[i];
    if (seen.find(letter) != std::string::npos) Fail(std::string("operator ") + letter + " repeats");
    seen.push_back(letter);
    if (letter == 'C') {
      if (i != 0) Fail("the convolution must be the first operator");
      spec.has_conv = true;
    } else if (letter == 'B' || letter == 'N' || letter == 'S' || letter == 'A') {
      spec.pointwise.push_back(static_cast<PointwiseOp>(letter));
    } else {
      Fail(std::string("unknown operator '") + letter + "'");
    }
  }

  spec.out_c = spec.c;
  spec.out_h = spec.h;
  spec.out_w = spec.w;
  if (spec.has_conv) {
    if (conv_text.empty()) Fail("the plan has a convolution but no 'conv' field");
    auto f = Split(conv_text, ',');
    if (f.size() != 14) Fail("'conv' needs 14 entries");
    ConvGeometry& g = spec.conv;
    constexpr int64_t kMaxPad = int64_t{1} << 30;
    g.k = ParseInt("conv.k", f[0], 1, kMaxDim);
    g.r = ParseInt("conv.r", f[1], 1, kMaxDim);
    g.s = ParseInt("conv.s", f[2], 1, kMaxDim);
    g.stride_h = ParseInt("conv.stride", f[3], 1, kMaxDim);
    g.stride_w = ParseInt("conv.stride", f[4], 1, kMaxDim);
    g.pad_t = ParseInt("conv.pad", f[5], -kMaxPad, kMaxPad);
    g.pad_b = ParseInt("conv.pad", f[6], -kMaxPad, kMaxPad);
    g.pad_l = ParseInt("conv.pad", f[7], -kMaxPad, kMaxPad);
    g.pad_r = ParseInt("conv.pad", f[8], -kMaxPad, kMaxPad);
    g.dil_h = ParseInt("conv.dilation", f[9], 1, kMaxDim);
    g.dil_w = ParseInt("conv.dilation", f[10], 1, kMaxDim);
    g.groups = ParseInt("conv.groups", f[11], 1, kMaxDim);
    if (f[12] == "OIHW") g.filter_layout = FilterLayout::kOIHW;
    else if (f[12] == "HWIO") g.filter_layout = FilterLayout::kHWIO;
    else if (f[12] == "OHWI") g.filter_layout = FilterLayout::kOHWI;
    else Fail("unknown filter layout '" + std::string(f[12]) + "'");
    g.allow_tf32 = ParseInt("conv.tf32", f[13], 0, 1) == 1;
    if (spec.c % g.groups != 0 || g.k % g.groups != 0) {
      Fail("groups must divide the input and output channels");
    }
    // Input coordinates, padding included, must fit in int32 too (kernels compute them so).
    if (spec.h + std::max<int64_t>(g.pad_t, 0) + std::max<int64_t>(g.pad_b, 0) > kMaxDim ||
        spec.w + std::max<int64_t>(g.pad_l, 0) + std::max<int64_t>(g.pad_r, 0) > kMaxDim) {
      Fail("the padded input is larger than 2^31 - 1 in height or width");
    }
    const int64_t eff_h = (g.r - 1) * g.dil_h + 1, eff_w = (g.s - 1) * g.dil_w + 1;
    const int64_t span_h = spec.h + g.pad_t + g.pad_b - eff_h;
    const int64_t span_w = spec.w + g.pad_l + g.pad_r - eff_w;
    if (span_h < 0 || span_w < 0) Fail("the convolution's output would be empty");
    spec.out_c = g.k;
    spec.out_h = span_h / g.stride_h + 1;
    spec.out_w = span_w / g.stride_w + 1;
  } else if (!conv_text.empty()) {
    Fail("'conv' given but the plan has no convolution");
  }
  if (spec.mixed_layouts() && !spec.has_conv) {
    Fail("'olayout' differs from 'layout' but the plan has no convolution");
  }
  spec.filter_dtype = spec.dtype;
  if (!wdtype_text.empty()) {
    if (!spec.has_conv) Fail("'wdtype' given but the plan has no convolution");
    if (wdtype_text == "f32") spec.filter_dtype = DType::kF32;
    else if (wdtype_text != dtype_text) Fail("wdtype must be f32 or the plan's dtype");
  }

  if (spec.has(PointwiseOp::kBatchNorm)) {
    if (bn_text == "spatial") spec.bn = BnMode::kSpatial;
    else if (bn_text == "per_activation") spec.bn = BnMode::kPerActivation;
    else Fail("batchnorm needs bn=spatial or bn=per_activation");
  } else if (!bn_text.empty()) {
    Fail("'bn' given but the plan has no batchnorm");
  }
  if (spec.has(PointwiseOp::kActivation)) {
    if (act_text.empty()) Fail("the activation needs an 'act' mode");
    spec.activation = static_cast<int>(ParseInt("act", act_text, 0, kNumActivationModes - 1));
  } else if (!act_text.empty()) {
    Fail("'act' given but the plan has no activation");
  }

  // Every tensor must be addressable with int64 offsets, with room to spare.
  const double limit = static_cast<double>(std::numeric_limits<int64_t>::max()) / 16;
  for (double count : {double(spec.n) * spec.c * spec.h * spec.w,
                       double(spec.n) * spec.out_c * spec.out_h * spec.out_w,
                       spec.has_conv ? double(spec.conv.k) * (spec.c / spec.conv.groups) *
                                           spec.conv.r * spec.conv.s
                                     : 0.0}) {
    if (count > limit) Fail("a tensor has too many elements");
  }
  spec.canonical = Canonical(spec);
  return spec;
}

}  // namespace jaxfuse
