#include "eplb/cuda/installer.h"

#include <thread>

#include "eplb/core/error.h"

namespace eplb::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    fail<IoError>("CUDA ", what, " failed: ", cudaGetErrorName(status), " (",
                  cudaGetErrorString(status), ")");
  }
}

}  // namespace

StreamInstaller::StreamInstaller(cudaStream_t engine_stream) : stream_(engine_stream) {
  check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

StreamInstaller::~StreamInstaller() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void StreamInstaller::copy(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync of an install");
}

void StreamInstaller::mark() { check(cudaEventRecord(event_, stream_), "cudaEventRecord"); }

void StreamInstaller::wait_marked(std::chrono::milliseconds timeout) {
  // Polled, not cudaEventSynchronize: a bounded wait, and no blocking-sync flag on the device.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) check(status, "cudaEventQuery of the last install");
    if (std::chrono::steady_clock::now() >= deadline) {
      fail<Timeout>("the engine's stream did not reach the last install within ",
                    timeout.count(), " ms (the staging buffer is still in use)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace eplb::cuda
