// XLA FFI handler for platform "cpu": decode, check, run the fused chain on the host.
#include <exception>
#include <memory>

#include "cpu/fused_cpu.h"
#include "ffi/handlers.h"
#include "ffi/operands.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

namespace {

ffi::Error FusedChainCpu(ffi::Dictionary attrs, ffi::RemainingArgs args,
                         ffi::Result<ffi::AnyBuffer> out) {
  try {
    std::shared_ptr<const PlanSpec> spec;
    DecodedOperands decoded;
    if (ffi::Error err = DecodeCall(attrs, args, out, &spec, &decoded); err.failure()) return err;
    cpu::RunFused(*spec, BindParams(*spec, decoded));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCpu, FusedChainCpu,
                              ffi::Ffi::Bind()
                                  .Attrs()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jaxfuse
