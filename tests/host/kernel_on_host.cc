// Runs one generated GPU kernel on the host: the translation unit the code generator wrote for
// a plan (KERNEL_SOURCE, including csrc/kernels/), compiled by the host C++ compiler with
// CUDA's built-ins stubbed and the portable (HIP) 16-bit conversions, launched as one thread
// of the host per GPU thread, a block at a time, __syncthreads() a barrier of the block's
// threads. For kernels without warp-level operations or asynchronous copies (the planar
// depthwise kernel): their indexing, tiling, halo and epilogue, without a GPU.
//
//   kernel_on_host DIR ENTRY GRID BLOCK
//
// reads the operands DIR/{x,w,bias,scale,shift,mean,var,side,scalars}.bin (those the plan has),
// writes DIR/y.bin (poisoned with 0xff bytes before the launch). Built and run by
// tests/test_kernels_on_host.py, which checks y against the float64 reference.
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "device_stubs.h"

static Dim3 blockIdx, gridDim, blockDim;
static thread_local Dim3 threadIdx;
static std::barrier<>* block_barrier = nullptr;
#define __shared__ static  // one block runs at a time: function statics are its shared memory
#define __syncthreads() block_barrier->arrive_and_wait()

#include KERNEL_SOURCE

namespace {

std::vector<char> Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return in ? std::vector<char>(std::istreambuf_iterator<char>(in), {}) : std::vector<char>();
}

const void* Data(const std::vector<char>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s DIR ENTRY GRID BLOCK\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], entry = argv[2];
  const unsigned grid = std::strtoul(argv[3], nullptr, 10);
  const unsigned block = std::strtoul(argv[4], nullptr, 10);
  void (*kernel)(jaxfuse::FusedParams) = nullptr;
  if (entry == "jaxfuse_conv_planes") kernel = jaxfuse_conv_planes;
  if (kernel == nullptr || grid == 0 || block == 0) {
    std::fprintf(stderr, "unknown entry %s or empty launch\n", entry.c_str());
    return 2;
  }
  const auto file = [&](const char* name) { return Read(dir + "/" + name + ".bin"); };
  const std::vector<char> x = file("x"), w = file("w"), bias = file("bias"),
                          scale = file("scale"), shift = file("shift"), mean = file("mean"),
                          var = file("var"), side = file("side"), scalars = file("scalars");
  std::vector<char> y(jaxfuse::plan::kOutElements * sizeof(jaxfuse::plan::Io::type),
                      static_cast<char>(0xff));
  jaxfuse::FusedParams p{};
  p.x = Data(x);
  p.w = Data(w);
  p.bias = static_cast<const float*>(Data(bias));
  p.bn_scale = static_cast<const float*>(Data(scale));
  p.bn_shift = static_cast<const float*>(Data(shift));
  p.bn_mean = static_cast<const float*>(Data(mean));
  p.bn_var = static_cast<const float*>(Data(var));
  p.side = Data(side);
  p.scalars = static_cast<const float*>(Data(scalars));
  p.y = y.data();
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    std::barrier<> barrier(block);
    block_barrier = &barrier;
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([t, kernel, &p] {
        threadIdx.x = t;
        kernel(p);
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  std::ofstream out(dir + "/y.bin", std::ios::binary);
  out.write(y.data(), static_cast<std::streamsize>(y.size()));
  return out ? 0 : 1;
}
