// The buffers of one fused call, as every backend sees them. Host C++ fills it from the FFI
// operands; GPU kernels receive it by value as their only parameter, so its layout is shared
// by construction (this header is compiled by both the host compiler and NVRTC / hiprtc).
#pragma once

namespace jaxfuse {

struct FusedParams {
  const void* x;          // input, the plan's dtype and layout
  const void* w;          // filters (plans with a convolution)
  const float* bias;      // (K,)
  const float* bn_scale;  // (K,) spatial, or the per-sample shape per_activation
  const float* bn_shift;
  const float* bn_mean;
  const float* bn_var;
  const void* side;       // side input, the output's shape and dtype
  const float* scalars;   // kNumScalars runtime scalars (epilogue.h: ScalarIndex)
  void* y;                // output
};

// A tensor map (CUtensorMap): 128 opaque bytes the driver encodes on the host and the copy
// engine reads from the kernel's parameters.
struct alignas(64) TensorMap {
  unsigned long long words[16];
};

// The parameters of kernels that load through the copy engine: a tensor map for the input and
// one for the filters (encoded per launch: they hold the buffers' addresses), then the buffers.
struct TmaParams {
  TensorMap x, w;
  FusedParams p;
};

}  // namespace jaxfuse
