// The forward-like work of eplb_cuda_transport_measure: a plain tiled SGEMM (64x64 tiles of C per
// block, 4x4 per thread), so the program needs no cuBLAS. Row-major: A[m][k], B[k][n], C[m][n].

#include <cuda_runtime_api.h>

namespace eplb::bench {
namespace {

constexpr int kTileM = 64, kTileN = 64, kTileK = 16, kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    sgemm(int n, int k, const float* __restrict__ a, const float* __restrict__ b,
          float* __restrict__ c) {
  __shared__ float as[kTileK][kTileM + 4];  // A's tile transposed; padded against bank conflicts
  __shared__ float bs[kTileK][kTileN];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int row0 = blockIdx.y * kTileM, col0 = blockIdx.x * kTileN;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < k; k0 += kTileK) {
    for (int i = threadIdx.x; i < kTileM * kTileK; i += kThreads) {
      const int r = i / kTileK, col = i % kTileK;
      as[col][r] = a[static_cast<long long>(row0 + r) * k + k0 + col];
    }
    for (int i = threadIdx.x; i < kTileK * kTileN; i += kThreads) {
      const int r = i / kTileN, col = i % kTileN;
      bs[r][col] = b[static_cast<long long>(k0 + r) * n + col0 + col];
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[static_cast<long long>(row0 + ty * 4 + i) * n + col0 + tx * 4 + j] = acc[i][j];
    }
  }
}

}  // namespace

// m and n multiples of 64, k a multiple of 16 (the caller checks).
cudaError_t launch_sgemm(int m, int n, int k, const float* a, const float* b, float* c,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(n / kTileN), static_cast<unsigned>(m / kTileM));
  sgemm<<<grid, kThreads, 0, stream>>>(n, k, a, b, c);
  return cudaGetLastError();
}

}  // namespace eplb::bench
