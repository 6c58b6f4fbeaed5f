// The "jaxfuse_stopwatch" custom call (CUDA, ROCM): records mark 0 or 1 of a stopwatch
// (gpu/stopwatch.h) on XLA's stream. Its operands only order it after the values they are;
// its one small result is never written. Not command-buffer compatible on purpose: it must run
// as its own step on the stream, where the program reaches it.
#include <exception>
#include <stdexcept>

#include "ffi/handlers.h"
#include "gpu/stopwatch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

namespace {

ffi::Error Mark(void* stream, int64_t stopwatch, int64_t mark, ffi::RemainingArgs,
                ffi::Result<ffi::AnyBuffer>) {
  try {
    gpu::MarkStopwatch(stopwatch, static_cast<int>(mark), stream);
    return ffi::Error::Success();
  } catch (const std::invalid_argument& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<void*>>()
      .Attr<int64_t>("stopwatch")
      .Attr<int64_t>("mark")
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kStopwatchGpu, Mark, Binding());

}  // namespace jaxfuse
