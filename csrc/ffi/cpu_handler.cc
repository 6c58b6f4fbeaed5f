// XLA FFI handler for platform "cpu": decode, check, run the fused chain on the host.
//
// Unlike the GPU handlers it keeps no instantiate-stage state: jaxlib registers the handlers
// queued before the CPU client exists ahead of the queued types (jaxlib 0.10-0.11), and a
// handler whose state type is not yet known is refused. Its per-call lookup (a per-thread map
// by the attribute's address) costs nothing beside a host kernel's milliseconds.
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "cpu/convert.h"
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
    if (const char* refused = cpu::Refuses(*spec)) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, refused);
    }
    DecodedOperands decoded;
    if (ffi::Error err = DecodeOperands(*spec, spec->operands(), args, out, &decoded);
        err.failure()) {
      return err;
    }
    // float32 filters of a 16-bit plan: rounded to the plan's dtype first, as converting them
    // before the call would (the host kernels read filters in the plan's dtype).
    std::vector<uint16_t> narrowed;
    if (spec->wide_filters()) {
      narrowed.resize(static_cast<size_t>(spec->filter_elements()));
      cpu::StoreRow(static_cast<const float*>(decoded.ptrs[1]), spec->filter_elements(),
                    spec->dtype, narrowed.data(), 0);
      decoded.ptrs[1] = narrowed.data();
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
