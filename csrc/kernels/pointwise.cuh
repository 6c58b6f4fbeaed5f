// Plans without a convolution (N, A, NA, BA, BNSA, ...): one pass over the tensor, the
// epilogue applied to each element between its single load and single store.
//
// jaxfuse_pointwise moves 16 bytes per thread per step (needs 16-byte aligned buffers);
// jaxfuse_pointwise_scalar handles any alignment. The host picks one per call.
#pragma once

namespace jaxfuse {
namespace kernels {

using namespace plan;

// Channel of the element at flat index i.
JF_DEVICE i64 input_channel(i64 i) { return kNHWC ? i % C : (i / (H * W)) % C; }

JF_DEVICE void pointwise_element(const Epilogue& ep, const Io::type* JF_RESTRICT x,
                                 Io::type* JF_RESTRICT y, i64 i) {
  y[i] = Io::store(ep.apply(Io::load(x[i]), ep.channel(input_channel(i)), i % kPerSample, i));
}

}  // namespace kernels
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(256) jaxfuse_pointwise(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::kernels;
  typedef Io::type T;
  constexpr int kLanes = sizeof(Vec16) / sizeof(T);
  constexpr i64 kVectors = kOutElements / kLanes;
  // NCHW planes that are a whole number of vectors keep one channel per vector.
  constexpr bool kChannelPerVector = !kNHWC && (H * W) % kLanes == 0;
  const Epilogue ep(p);
  const T* JF_RESTRICT x = static_cast<const T*>(p.x);
  T* JF_RESTRICT y = static_cast<T*>(p.y);
  for (i64 v = global_thread_index(); v < kVectors; v += global_thread_count()) {
    const Vec16 in = reinterpret_cast<const Vec16*>(x)[v];
    const T* lanes = reinterpret_cast<const T*>(&in);
    Vec16 out;
    T* out_lanes = reinterpret_cast<T*>(&out);
    const i64 first = v * kLanes;
    Epilogue::Channel shared_channel;
    if (kChannelPerVector) shared_channel = ep.channel(input_channel(first));
#pragma unroll
    for (int j = 0; j < kLanes; ++j) {
      const i64 i = first + j;
      const Epilogue::Channel ch = kChannelPerVector ? shared_channel : ep.channel(input_channel(i));
      out_lanes[j] = Io::store(ep.apply(Io::load(lanes[j]), ch, i % kPerSample, i));
    }
    reinterpret_cast<Vec16*>(y)[v] = out;
  }
  // The few elements past the last whole vector.
  for (i64 i = kVectors * kLanes + global_thread_index(); i < kOutElements;
       i += global_thread_count()) {
    pointwise_element(ep, x, y, i);
  }
}

extern "C" __global__ void __launch_bounds__(256) jaxfuse_pointwise_scalar(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  using namespace jaxfuse::kernels;
  const Epilogue ep(p);
  const Io::type* x = static_cast<const Io::type*>(p.x);
  Io::type* y = static_cast<Io::type*>(p.y);
  for (i64 i = global_thread_index(); i < kOutElements; i += global_thread_count()) {
    pointwise_element(ep, x, y, i);
  }
}
