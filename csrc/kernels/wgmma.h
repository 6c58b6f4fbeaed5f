// Hopper warpgroup matrix multiply (wgmma, sm_90a): four warps multiply a 64 x N x 16 tile
// (64 x N x 8 for TF32) with both operands read straight from shared memory through matrix
// descriptors, asynchronously.
//
// Shared-memory tiles use the 128-byte swizzle: a tile is built from 1024-byte atoms of
// 8 rows x 128 bytes, and the 16-byte chunk c of row r is stored at chunk c ^ (r % 8). Atoms
// must start on 1024-byte boundaries.
//  - K-major operand (A always; B when the filters are [k][kk], and always for TF32, whose
//    wgmma cannot transpose): row = an M (or N) index, 128 bytes = 64 consecutive 16-bit K
//    values (32 fp32 ones). Consecutive 8-row groups are 1024 bytes apart (the descriptor's
//    stride byte offset); one k-step (k16, or k8 TF32) = 32 bytes further along the row.
//  - MN-major B (filters stored [kk][k], k contiguous): row = one K index, 128 bytes = 64
//    consecutive N values; 8-row K groups 1024 bytes apart (stride byte offset), 64-wide N
//    blocks `n_block_bytes` apart (leading byte offset); one k16 step = 2048 bytes.
#pragma once

#ifndef JF_HIP

namespace jaxfuse {
namespace wgmma {

// Byte offset of 16-bit element (row, col) in a 128-byte-swizzled tile of 64-element rows.
JF_DEVICE u32 swizzled_offset(u32 row, u32 col) {
  return row * 128u + ((((col >> 3) ^ row) & 7u) << 4) + (col & 7u) * 2u;
}
// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte-swizzled tile.
JF_DEVICE u32 swizzled_chunk(u32 row, u32 chunk) {
  return row * 128u + (((chunk ^ row) & 7u) << 4);
}

// The 64-bit shared-memory matrix descriptor (128-byte swizzle).
JF_DEVICE u64 descriptor(u32 smem_address, u32 leading_byte_offset, u32 stride_byte_offset) {
  u64 d = 0;
  d |= u64((smem_address & 0x3FFFFu) >> 4);
  d |= u64((leading_byte_offset >> 4) & 0x3FFFu) << 16;
  d |= u64((stride_byte_offset >> 4) & 0x3FFFu) << 32;
  d |= u64(1) << 62;  // swizzle mode 1: 128 bytes
  return d;
}

// Orders this thread's earlier shared-memory writes (plain or cp.async) before the tensor
// cores read them (async proxy); each writing thread issues it before the barrier.
JF_DEVICE void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
JF_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
JF_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
JF_DEVICE void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across an asynchronous multiply.
JF_DEVICE void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Thread-block clusters (split-K). The cluster barrier's arrive carries no release here: the
// data crossing CTAs travels by st.async, whose bytes complete a transaction on the reader's
// own barrier. (A release costs a GPU-scope MEMBAR: session 9 measured 0.5-0.9 us a layer.)
// The barrier's two halves, for a wait placed well after the arrival.
JF_DEVICE void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
JF_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
// The address `local` has in this CTA's shared memory, in CTA `rank`'s (a CTA's window of the
// cluster's shared memory is contiguous: offsets carry over).
JF_DEVICE u32 map_to_cluster_rank(u32 local, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
// Two floats into another CTA's shared memory at `remote` (map_to_cluster_rank); their bytes
// complete a transaction on that CTA's barrier at `remote_bar`, so the reader waits on its own
// barrier and no fence or cluster barrier orders the data.
JF_DEVICE void store_cluster_async(u32 remote, u32 remote_bar, float a, float b) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n"
      ::"r"(remote), "f"(a), "f"(b), "r"(remote_bar)
      : "memory");
}

// One k-tile (128 bytes of K: 64 16-bit values, or 32 fp32 ones) of a warpgroup's multiply, as
// four k-steps: 64 rows of A (K-major, 128-byte swizzled rows at `a`) times the N columns of B
// at `b`, stored K-major (rows of K values) or MN-major (16-bit only: 64-wide blocks of N,
// `n_block_bytes` apart). mma_64xN, one k-step, is generated for each kernel's N and dtype
// (codegen.cc: WgmmaFunction).
template <bool kBKMajor, int kRegs>
JF_DEVICE void multiply_k_tile(float (&acc)[kRegs], u32 a, u32 b, u32 n_block_bytes) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u64 da = descriptor(a + 32 * j, 16, 1024);
    const u64 db = kBKMajor ? descriptor(b + 32 * j, 16, 1024)
                            : descriptor(b + 2048 * j, n_block_bytes, 1024);
    mma_64xN(acc, da, db);
  }
}

}  // namespace wgmma
}  // namespace jaxfuse

#endif  // JF_HIP
