// XLA FFI handlers of the batched float conversion, "jaxfuse_convert_many", for platforms
// "CUDA" and "ROCM": operand i is converted into result i (float32, float16, bfloat16, any
// two different ones; the result's type says which). The initialize stage compiles and loads
// the one fixed kernel for the device, outside any CUDA-graph capture; the execute stage checks
// the buffers and enqueues one launch per table of segments on XLA's stream (nothing else), so
// the handler is command-buffer compatible. On the CPU the op lowers to XLA's own converts.
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/handlers.h"
#include "gpu/convert_many.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

namespace {

int TypeCode(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::F16: return 1;
    case ffi::DataType::BF16: return 2;
    default: return -1;
  }
}

ffi::Error Mismatch(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxfuse_convert_many: " + what);
}

// Fills `requests` from the call's buffers, or says which one does not fit.
ffi::Error Decode(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                  gpu::ConvertRequest* requests) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (in.has_error() || out.has_error()) {
      return Mismatch("operand and result " + std::to_string(i) + " must be buffers");
    }
    const int src = TypeCode(in->element_type()), dst = TypeCode((*out)->element_type());
    if (!gpu::ConvertPairSupported(src, dst)) {
      return Mismatch("operand " + std::to_string(i) + " is not a conversion between two "
                      "different types of float32, float16 and bfloat16");
    }
    if (in->element_count() != (*out)->element_count()) {
      return Mismatch("operand " + std::to_string(i) + " has " +
                      std::to_string(in->element_count()) + " elements, its result " +
                      std::to_string((*out)->element_count()));
    }
    requests[i] = {in->untyped_data(), (*out)->untyped_data(),
                   static_cast<int64_t>(in->element_count()), src, dst};
  }
  return ffi::Error::Success();
}

template <gpu::Platform kPlatform>
ffi::Error Initialize(int32_t device_ordinal, ffi::RemainingArgs, ffi::RemainingRets) {
  try {
    gpu::GetConvertKernel(kPlatform, device_ordinal);
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

template <gpu::Platform kPlatform>
ffi::Error Execute(void* stream, int32_t device_ordinal, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
  try {
    if (args.size() != rets.size()) {
      return Mismatch("takes as many operands as results, got " +
                      std::to_string(args.size()) + " and " + std::to_string(rets.size()));
    }
    // A network's parameters fit on the stack; more than that take the heap.
    constexpr size_t kOnStack = 256;
    gpu::ConvertRequest on_stack[kOnStack];
    std::vector<gpu::ConvertRequest> on_heap;
    gpu::ConvertRequest* requests = on_stack;
    if (args.size() > kOnStack) {
      on_heap.resize(args.size());
      requests = on_heap.data();
    }
    if (ffi::Error err = Decode(args, rets, requests); err.failure()) return err;
    // Normally a hit: the initialize stage loaded it.
    auto kernel = gpu::GetConvertKernel(kPlatform, device_ordinal);
    gpu::LaunchConvert(kPlatform, *kernel, stream, requests, static_cast<int>(args.size()));
    return ffi::Error::Success();
  } catch (const std::invalid_argument& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

auto InitializeBinding() {
  return ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
      .Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets();
}

auto ExecuteBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<void*>>()
      .Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets();
}

// Only kernel launches (and, under JAXFUSE_POISON_OUTPUTS, memsets) on the given stream.
constexpr auto kTraits = ffi::Traits::kCmdBufferCompatible;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kConvertManyCudaInitialize, Initialize<gpu::Platform::kCuda>,
                              InitializeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kConvertManyCuda, Execute<gpu::Platform::kCuda>, ExecuteBinding(),
                              {kTraits});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kConvertManyRocmInitialize, Initialize<gpu::Platform::kRocm>,
                              InitializeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kConvertManyRocm, Execute<gpu::Platform::kRocm>, ExecuteBinding(),
                              {kTraits});

}  // namespace jaxfuse
