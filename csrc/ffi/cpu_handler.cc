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

ffi::Error FusedChainCpu(ffi::Dictionary attrs, ffi::RemainingArgs args,
                         ffi::Result<ffi::AnyBuffer> out) {
  try {
    std::string_view plan;
    if (ffi::Error err = PlanAttribute(attrs, &plan); err.failure()) return err;
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
                                  .Attrs()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jaxfuse
