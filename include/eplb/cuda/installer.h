#pragma once
// Installs on the engine's CUDA stream (runtime::Installer for device weights).
//
// The runtime calls copy() and mark() on the forward thread inside step_end(), between two
// forward passes: with Install::kCopy the staged layer is copied into the live weights by a
// cudaMemcpyAsync enqueued on the engine's stream, after the forward pass already queued there
// and before the next one; mark() records an event there. Before the staging buffer is written
// again, the thread that stages (the runtime's worker) waits for that event, by polling it:
// the engine's stream and the device are never synchronized, and the forward thread never
// waits.
//
// Ownership: the installer owns one event; the stream is the engine's and must outlive it.
// Use:
//   auto installer = std::make_shared<eplb::cuda::StreamInstaller>(engine_stream);
//   config.install = eplb::runtime::Install::kCopy;   // fixed addresses for CUDA graphs
//   config.installer = installer;

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>

#include "eplb/runtime/rebalancer.h"

namespace eplb::cuda {

class StreamInstaller final : public runtime::Installer {
 public:
  // IoError when CUDA cannot create the event (no device, no driver), with CUDA's message. The
  // event is made on the stream's device.
  explicit StreamInstaller(cudaStream_t engine_stream);
  ~StreamInstaller() override;
  StreamInstaller(const StreamInstaller&) = delete;
  StreamInstaller& operator=(const StreamInstaller&) = delete;

  void copy(void* dst, const void* src, std::size_t bytes) override;
  void mark() override;
  void wait_marked(std::chrono::milliseconds timeout) override;

  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
  int device_ = 0;  // the stream's
  cudaEvent_t event_ = nullptr;
};

}  // namespace eplb::cuda
