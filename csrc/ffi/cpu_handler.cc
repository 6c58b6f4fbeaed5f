// XLA FFI handler for platform "cpu": decode, check, run the fused chain on the host.
#include <exception>

#include "cpu/fused_cpu.h"
#include "ffi/handlers.h"
#include "ffi/operands.h"
#include "ffi/plan_registry.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace ffi = xla::ffi;

namespace {

ffi::Error FusedChainCpu(std::string_view plan, ffi::RemainingArgs args,
                         ffi::Result<ffi::AnyBuffer> out) {
  try {
    auto spec = LookupPlan(plan);
    DecodedOperands decoded;
    if (ffi::Error err = DecodeOperands(*spec, args, out, &decoded); err.failure()) return err;
    cpu::RunFused(*spec, BindParams(*spec, decoded));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, e.what());
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFusedChainCpu, FusedChainCpu,
                              ffi::Ffi::Bind()
                                  .Attr<std::string_view>("plan")
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jaxfuse
