// XLA FFI handler for platform "cpu": decode, check, run the fused chain on the host.
//
// Unlike the GPU handlers it keeps no instantiate-stage state: jaxlib registers the handlers
// queued before the CPU client exists ahead of the queued types (jaxlib 0.10-0.11), and a
// handler whose state type is not yet known is refused. Its per-call lookup (a per-thread map
// by the attribute's address) costs nothing beside a host kernel's milliseconds.
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
    if (ffi::Error err = ParsePlan(attrs, &spec); err.failure()) return err;
    DecodedOperands decoded;
    if (ffi::Error err = DecodeOperands(*spec, spec->operands(), args, out, &decoded);
        err.failure()) {
      return err;
    }
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
