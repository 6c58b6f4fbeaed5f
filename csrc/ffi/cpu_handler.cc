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

cpu::FusedBuffers BindBuffers(const PlanSpec& spec, const DecodedOperands& d) {
  cpu::FusedBuffers b;
  size_t i = 0;
  b.x = d.ptrs[i++];
  if (spec.has_conv) b.w = d.ptrs[i++];
  for (PointwiseOp op : spec.pointwise) {
    switch (op) {
      case PointwiseOp::kBias: b.bias = static_cast<const float*>(d.ptrs[i++]); break;
      case PointwiseOp::kBatchNorm:
        b.bn_scale = static_cast<const float*>(d.ptrs[i++]);
        b.bn_shift = static_cast<const float*>(d.ptrs[i++]);
        b.bn_mean = static_cast<const float*>(d.ptrs[i++]);
        b.bn_var = static_cast<const float*>(d.ptrs[i++]);
        break;
      case PointwiseOp::kSideAdd: b.side = d.ptrs[i++]; break;
      case PointwiseOp::kActivation: break;
    }
  }
  b.scalars = static_cast<const float*>(d.ptrs[i++]);
  b.y = d.out;
  return b;
}

ffi::Error FusedChainCpu(std::string_view plan, ffi::RemainingArgs args,
                         ffi::Result<ffi::AnyBuffer> out) {
  try {
    auto spec = LookupPlan(plan);
    DecodedOperands decoded;
    if (ffi::Error err = DecodeOperands(*spec, args, out, &decoded); err.failure()) return err;
    cpu::RunFused(*spec, BindBuffers(*spec, decoded));
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
