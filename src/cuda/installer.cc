#include "eplb/cuda/installer.h"

#include <thread>

#include "eplb/core/error.h"

namespace eplb::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not left behind for the engine's next launch check
    fail<IoError>("CUDA ", what, " failed: ", cudaGetErrorName(status), " (",
                  cudaGetErrorString(status), ")");
  }
}

// Makes the stream's device current for one call and restores the caller's.
class DeviceOf {
 public:
  explicit DeviceOf(int device) : device_(device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) check(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceOf() {
    if (previous_ != device_) (void)cudaSetDevice(previous_);
  }
  DeviceOf(const DeviceOf&) = delete;
  DeviceOf& operator=(const DeviceOf&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

}  // namespace

StreamInstaller::StreamInstaller(cudaStream_t engine_stream) : stream_(engine_stream) {
  check(cudaStreamGetDevice(stream_, &device_), "cudaStreamGetDevice of the engine's stream");
  const DeviceOf on(device_);
  check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

StreamInstaller::~StreamInstaller() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

void StreamInstaller::copy(void* dst, const void* src, std::size_t bytes) {
  // cudaMemcpyDefault: the arena is device memory with the cuda transport, but any memory
  // with a unified address works.
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
        "cudaMemcpyAsync of an install");
}

void StreamInstaller::mark() {
  const DeviceOf on(device_);
  check(cudaEventRecord(event_, stream_), "cudaEventRecord");
}

void StreamInstaller::wait_marked(std::chrono::milliseconds timeout) {
  // The caller is a runtime thread while the engine may capture a graph in global mode on
  // another: this query takes no part in it (thread-local capture mode for its duration).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  struct Restore {
    cudaStreamCaptureMode* mode;
    ~Restore() { (void)cudaThreadExchangeStreamCaptureMode(mode); }
  } restore{&mode};
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
