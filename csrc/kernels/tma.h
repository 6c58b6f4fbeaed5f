// Hopper's asynchronous machinery for warp-specialized kernels (sm_90): shared-memory
// barriers (mbarrier) that count arrivals and bytes, the bulk tensor copy engine (TMA) loading
// tiles through tensor maps the host encodes, per-warpgroup register budgets (setmaxnreg), and
// named barriers over subsets of a block.
//
// A pipeline stage has two barriers: `full` completes when the producer's copies into the stage
// have landed (one arrival that announces the byte count, then the copies' bytes), `empty`
// completes when every consumer thread is done reading it. Phases alternate: a waiter passes
// once the barrier has completed the phase of the given parity.
#pragma once

#ifndef JF_HIP

namespace jaxfuse {
namespace tma {

JF_DEVICE void barrier_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes barrier initialization visible to the copy engine and to other threads.
JF_DEVICE void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` more to come from copies completing on the barrier.
JF_DEVICE void arrive_expect_bytes(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

JF_DEVICE void arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the barrier has completed the phase of parity `phase`. A wait that lasts
// seconds (2^26 suspended tries) can only be a deadlock: the kernel traps, failing the launch
// with an error, rather than holding the device forever.
JF_DEVICE void wait(u32 bar, u32 phase) {
  u32 done = 0;
  for (u32 tries = 0; !done; ++tries) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
    if (tries == (1u << 26)) __trap();
  }
}

// The tensor map's first cache line, fetched ahead of the first copy through it.
JF_DEVICE void prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// An im2col box of an NHWC tensor: `pixels` consecutive output positions (the map's
// pixelsPerColumn, walking W, then H, then N with the convolution's strides) x the map's
// channels, starting at channel c of the window whose tap (0, 0) sits at (w, h) of image n,
// shifted by the tap offset (dw, dh). Positions in the padding or past the last image are
// zero-filled.
JF_DEVICE void load_im2col(u32 dst, const void* map, int c, int w, int h, int n, u32 bar,
                           u16 dw, u16 dh) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], {%7, %8};\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c), "r"(w), "r"(h), "r"(n), "h"(dw), "h"(dh)
      : "memory");
}

// A tile of a 2-D tensor at coordinates (x innermost, y); outside the tensor, zeros.
JF_DEVICE void load_tile(u32 dst, const void* map, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(x), "r"(y)
      : "memory");
}

// A box of a 4-D tensor (dimension 0 innermost) at coordinates (c, w, h, n); outside the
// tensor, zeros.
JF_DEVICE void load_box(u32 dst, const void* map, int c, int w, int h, int n, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c), "r"(w), "r"(h), "r"(n)
      : "memory");
}

// Register budgets per warpgroup (the kernel must cap registers at entry with
// __launch_bounds__(threads, 1)): copy-issuing warps give registers to the multiplying ones.
template <int kRegisters>
JF_DEVICE void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
JF_DEVICE void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// A barrier over `threads` threads (whole warps) that use hardware barrier `id` (1..15; 0 is
// __syncthreads').
JF_DEVICE void sync_threads(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tma
}  // namespace jaxfuse

#endif  // JF_HIP
