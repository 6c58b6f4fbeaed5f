// Plans without a convolution (N, A, NA, BA, BNSA, ...): one pass over the tensor, the
// epilogue applied to each element between its single load and single store.
//
// jaxfuse_pointwise moves kVecBytes (16, or 8: a code-generator variant) per thread per step,
// several steps in flight (needs kVecBytes-aligned buffers); jaxfuse_pointwise_scalar handles
// any alignment. The host picks one per call.
// Per-channel terms (bias, batch norm as epilogue.h's bn_fold) are computed once per block into
// a shared-memory table when they fit: reading them per element from global memory costs more
// L1 traffic than the tensor itself when channels vary fastest (NHWC).
#pragma once

namespace jaxfuse {
namespace kernels {

using namespace plan;

constexpr int kUnroll = 4;  // vectors in flight per thread
// A thread's vector: kVecBytes of the tensor, one load or store.
struct alignas(kVecBytes) Vec {
  u32 v[kVecBytes / 4];
};
constexpr int kLanes = kVecBytes / sizeof(Io::type);
// NHWC with whole channel vectors: each thread keeps one group of kLanes channels for the whole
// kernel (its stride is a multiple of C / kLanes), so their terms live in registers.
constexpr bool kFixedChannels = kNHWC && C % kLanes == 0;
constexpr i64 kVectorsPerPixel = C / kLanes;
// The block's table of per-channel terms: where channels vary within a thread's vectors, and
// where a thread has a single vector (kSingleVector), whose kLanes channels it would otherwise
// fold alone from 4 kLanes global loads: the block folds each channel once (one per thread),
// and its threads read their channels' terms from shared memory (batch 1 is latency bound).
//
// kVectorTerms (a code-generator variant, autotuned against the table): a thread with a single
// vector reads its channels' parameters itself, issued with its vector's load: no block-wide
// table, no barrier before the first store. NHWC (fixed channels): its kLanes channels, 16
// bytes at a time (kLanes / 4 loads per parameter array; kLanes is a multiple of 4 there).
// NCHW (one channel a vector): that channel's, where a table would fold all C channels for a
// block that reads a few (1024 channels of 14x14 at batch 1: 5 a block).
constexpr bool kChannelTable =
    (!kFixedChannels || kSingleVector) && C <= kMaxTableChannels && !kVectorTerms;

// Channel of the element at flat index i.
JF_DEVICE i64 input_channel(i64 i) { return kNHWC ? i % C : (i / (H * W)) % C; }

// The per-channel terms, from the block's table or computed on the spot.
struct ChannelTerms {
  const float* table;  // [bias | bn.center | bn.mul | bn.add], C floats each
  const Epilogue* ep;
  JF_DEVICE Epilogue::Channel operator()(i64 c) const {
    if (kChannelTable) {
      return Epilogue::Channel{table[c], BnFold{table[C + c], table[2 * C + c], table[3 * C + c]}};
    }
    return ep->channel(c);
  }
};

JF_DEVICE ChannelTerms fill_channel_table(const Epilogue& ep, float* table) {
  if (kChannelTable) {
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
      const Epilogue::Channel t = ep.channel(c);
      table[c] = t.bias;
      table[C + c] = t.bn.center;
      table[2 * C + c] = t.bn.mul;
      table[3 * C + c] = t.bn.add;
    }
    __syncthreads();
  }
  return ChannelTerms{table, &ep};
}

}  // namespace kernels
}  // namespace jaxfuse

extern "C" __global__ void __launch_bounds__(256) jaxfuse_pointwise(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::kernels;
  typedef Io::type T;
  extern __shared__ float table[];
  constexpr i64 kVectors = kOutElements / kLanes;
  // NCHW planes that are a whole number of vectors keep one channel per vector.
  constexpr bool kChannelPerVector = !kNHWC && (H * W) % kLanes == 0;
  const Vec* x = static_cast<const Vec*>(p.x);
  Vec* y = static_cast<Vec*>(p.y);
  // Small tensors (kSingleVector, from the code generator: at most one vector a thread): the
  // vector is loaded before anything else, so its latency overlaps the scalars' and the
  // per-channel terms' loads instead of following them (batch 1 is latency bound).
  Vec early{};
  if (kSingleVector && global_thread_index() < kVectors) early = x[global_thread_index()];
  const Epilogue ep(p);
  const ChannelTerms terms = fill_channel_table(ep, table);
  i64 stride = global_thread_count();
  Epilogue::Channel fixed[kFixedChannels ? kLanes : 1];
  if (kFixedChannels) {
    stride -= stride % kVectorsPerPixel;
    if (global_thread_index() >= stride) return;  // the few threads past a whole multiple
    const i64 c0 = global_thread_index() % kVectorsPerPixel * kLanes;
    if constexpr (kVectorTerms) {
      ep.channels<kFixedChannels ? kLanes : 1>(c0, fixed);
    } else {
#pragma unroll
      for (int j = 0; j < (kFixedChannels ? kLanes : 1); ++j) fixed[j] = terms(c0 + j);
    }
  }
  // The chain on vector v, whose values `in` holds, stored to y.
  auto run = [&](const Vec& in, i64 v) {
    const T* lanes = reinterpret_cast<const T*>(&in);
    Vec out;
    T* out_lanes = reinterpret_cast<T*>(&out);
    const i64 first = v * kLanes;
    Epilogue::Channel shared_channel;
    if (kChannelPerVector) shared_channel = terms(input_channel(first));
#pragma unroll
    for (int j = 0; j < kLanes; ++j) {
      const i64 i = first + j;
      const Epilogue::Channel ch = kFixedChannels     ? fixed[kFixedChannels ? j : 0]
                                   : kChannelPerVector ? shared_channel
                                                       : terms(input_channel(i));
      out_lanes[j] = Io::store(ep.apply(Io::load(lanes[j]), ch, i % kPerSample, i));
    }
    y[v] = out;
  };
  if (kSingleVector) {
    if (global_thread_index() < kVectors) run(early, global_thread_index());
  } else {
    for (i64 v0 = global_thread_index(); v0 < kVectors; v0 += kUnroll * stride) {
      Vec in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll vectors in flight
        if (v0 + u * stride < kVectors) in[u] = x[v0 + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * stride >= kVectors) break;
        run(in[u], v0 + u * stride);
      }
    }
  }
  // The few elements past the last whole vector (none when channels fill whole vectors).
  const T* xs = static_cast<const T*>(p.x);
  T* ys = static_cast<T*>(p.y);
  for (i64 i = kVectors * kLanes + global_thread_index(); i < kOutElements; i += stride) {
    ys[i] = Io::store(ep.apply(Io::load(xs[i]), terms(input_channel(i)), i % kPerSample, i));
  }
}

extern "C" __global__ void __launch_bounds__(256) jaxfuse_pointwise_scalar(jaxfuse::FusedParams p) {
  using namespace jaxfuse;
  await_previous_kernel();  // (first: portable.h says why)
  using namespace jaxfuse::kernels;
  extern __shared__ float table[];
  const Epilogue ep(p);
  const ChannelTerms terms = fill_channel_table(ep, table);
  const Io::type* x = static_cast<const Io::type*>(p.x);
  Io::type* y = static_cast<Io::type*>(p.y);
  for (i64 i = global_thread_index(); i < kOutElements; i += global_thread_count()) {
    y[i] = Io::store(ep.apply(Io::load(x[i]), terms(input_channel(i)), i % kPerSample, i));
  }
}
