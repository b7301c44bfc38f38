// Kernels of the cuda tests: a grid that occupies every SM until the host releases it, and a
// fill/check of a word pattern in device memory. See cuda/cuda_testing.h.

#include "cuda/cuda_testing.h"

namespace eplb::transport::cuda_testing {
namespace kernels {

__device__ __forceinline__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ std::uint32_t pattern_word(std::uint32_t seed, std::uint64_t i) {
  std::uint64_t x = i * 0x9e3779b97f4a7c15ull + (static_cast<std::uint64_t>(seed) << 32 | seed);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint32_t>((x ^ (x >> 31)) >> 16);
}

__global__ void spin(const volatile int* stop, volatile int* started, volatile int* gave_up,
                     std::uint64_t limit_ns) {
  if (threadIdx.x == 0) {
    started[blockIdx.x] = 1;
    __threadfence_system();
    const std::uint64_t begin = global_ns();
    while (*stop == 0) {
      if (global_ns() - begin > limit_ns) {
        *gave_up = 1;
        __threadfence_system();
        break;
      }
      __nanosleep(10000);  // each poll is a read across the bus: keep them rare
    }
  }
  __syncthreads();
}

__global__ void fill(std::uint32_t* words, std::size_t count, std::uint32_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    words[i] = pattern_word(seed, i);
  }
}

__global__ void count_mismatches(const std::uint32_t* words, std::size_t count, std::uint32_t seed,
                                 std::uint64_t first, unsigned long long* mismatches) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    if (words[i] != pattern_word(seed, first + i)) ++bad;
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

constexpr int kStreamBlocks = 1024;
constexpr int kStreamThreads = 256;

}  // namespace kernels

cudaError_t spin_blocks_per_sm(int threads, int* blocks) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernels::spin, threads, 0);
}

cudaError_t launch_spin(int blocks, int threads, const int* stop, int* started, int* gave_up,
                        std::uint64_t limit_ns, cudaStream_t stream) {
  kernels::spin<<<blocks, threads, 0, stream>>>(stop, started, gave_up, limit_ns);
  return cudaGetLastError();
}

cudaError_t launch_fill(std::uint32_t* words, std::size_t count, std::uint32_t seed,
                        cudaStream_t stream) {
  kernels::fill<<<kernels::kStreamBlocks, kernels::kStreamThreads, 0, stream>>>(words, count, seed);
  return cudaGetLastError();
}

cudaError_t launch_count_mismatches(const std::uint32_t* words, std::size_t count,
                                    std::uint32_t seed, std::uint64_t first,
                                    unsigned long long* mismatches, cudaStream_t stream) {
  kernels::count_mismatches<<<kernels::kStreamBlocks, kernels::kStreamThreads, 0, stream>>>(
      words, count, seed, first, mismatches);
  return cudaGetLastError();
}

}  // namespace eplb::transport::cuda_testing
