// CPU fused chain: the convolution (conv_cpu.cc) or, without one, a pass over the input in
// blocks, each given to the shared epilogue for its single store.
#include "cpu/fused_cpu.h"

#include <algorithm>
#include <cstring>

#include "common/debug.h"
#include "cpu/conv_cpu.h"
#include "cpu/convert.h"
#include "cpu/epilogue_cpu.h"
#include "cpu/multiversion.h"
#include "cpu/thread_pool.h"

namespace jaxfuse::cpu {
namespace {

constexpr int64_t kStagedFloats = 4096;  // 16 KiB: a staged block stays in L1 through every pass
constexpr int64_t kDirectFloats = 16384;  // single-pass blocks: just large enough tasks

// Loads the input elements at the block's output offsets (the output has the input's shape)
// as float32 and hands them to the epilogue.
JF_MULTIVERSION void StagedBlock(const PlanSpec& spec, const FusedParams& buf,
                                 const Epilogue& ep, const Block& where) {
  alignas(64) float vals[kStagedFloats];
  for (int64_t r = 0; r < where.rows; ++r) {
    LoadRow(buf.x, where.offset + r * where.out_row, spec.dtype, where.cols,
            vals + r * where.cols);
  }
  Block block = where;
  block.values = vals;
  block.ld = where.cols;
  ep.Apply(block);
}

// No convolution: single-pass chains go straight from input to output, others are staged.
void RunPointwise(const PlanSpec& spec, const FusedParams& buf, const Epilogue& ep) {
  const int64_t plane = spec.h * spec.w, c = spec.c;
  const bool direct = ep.reads_input();
  const int64_t most = direct ? kDirectFloats : kStagedFloats;
  auto run = [&](const Block& where) {
    if (direct) {
      ep.ApplyToInput(where);
    } else {
      StagedBlock(spec, buf, ep, where);
    }
  };
  if (spec.layout == Layout::kNHWC) {
    // Rows are pixels (channels along the row); a wide pixel is split into channel pieces.
    const int64_t cols = std::min(c, most);
    const int64_t pieces = (c + cols - 1) / cols;
    const int64_t per_block = std::max<int64_t>(1, most / (cols * pieces));
    const int64_t blocks = (plane + per_block - 1) / per_block;
    ParallelFor(spec.n * blocks * pieces, [&](int64_t t) {
      const int64_t piece = t % pieces, b = t / pieces / blocks, blk = t / pieces % blocks;
      const int64_t p0 = blk * per_block, rows = std::min(per_block, plane - p0);
      const int64_t c0 = piece * cols, width = std::min(cols, c - c0);
      run({nullptr, rows, width, width, (b * plane + p0) * c + c0, c, c0, false, p0 * c + c0, c});
    });
    return;
  }
  // NCHW: rows are channel planes (or pieces of one).
  const int64_t cols = std::min(plane, most);
  const int64_t pieces = (plane + cols - 1) / cols;
  const int64_t per_block = std::max<int64_t>(1, most / cols);
  const int64_t blocks = (c + per_block - 1) / per_block;
  ParallelFor(spec.n * blocks * pieces, [&](int64_t t) {
    const int64_t piece = t % pieces, b = t / pieces / blocks, blk = t / pieces % blocks;
    const int64_t c0 = blk * per_block, rows = pieces > 1 ? 1 : std::min(per_block, c - c0);
    const int64_t x0 = piece * cols, width = std::min(cols, plane - x0);
    run({nullptr, rows, width, width, (b * c + c0) * plane + x0, plane, c0, true,
         c0 * plane + x0, plane});
  });
}

}  // namespace

const char* Refuses(const PlanSpec& spec) {
  return spec.mixed_layouts()
             ? "the CPU kernels write the input's layout: an output layout of its own is a "
               "GPU kernel form"
             : nullptr;
}

const char* SolverName(const PlanSpec& spec) {
  return spec.has_conv && !UsesPaddedCopy(spec) ? "cpu_direct" : "cpu";
}

void RunFused(const PlanSpec& spec, const FusedParams& buffers) {
  if (spec.output_elements() == 0) return;
  if (PoisonOutputs()) {
    std::memset(buffers.y, 0xff, spec.output_elements() * dtype_size(spec.dtype));
  }
  const Epilogue ep(spec, buffers);
  if (spec.has_conv) {
    RunConvolution(spec, buffers, ep);
  } else {
    RunPointwise(spec, buffers, ep);
  }
}

}  // namespace jaxfuse::cpu
