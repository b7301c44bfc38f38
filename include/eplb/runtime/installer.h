#pragma once
// The Installer: orders the runtime's installs with the engine's queued device work.

#include <chrono>
#include <cstddef>

namespace eplb::runtime {

// Puts installs in order with work the engine has queued but not yet run (a CUDA stream), so
// that no byte the engine may still read is overwritten. Without one (Config::installer null)
// the engine is assumed to have finished with the weights when it calls step_end(), as a CPU
// forward pass has, and kCopy copies with memcpy.
//
// Threads: copy() and mark() are called on the forward thread inside step_end(); wait_marked()
// on the thread that stages the next layer (the worker; the forward thread in sync mode), and
// on the control thread before it contributes this rank's window at a trigger (peers then
// read the live buffers), never concurrently with mark(). copy() and mark() must not fail in
// practice: one that throws stops the process (the rank's weights could no longer be trusted).
class Installer {
 public:
  virtual ~Installer() = default;
  // Install::kCopy: copies `bytes` from the staging buffer `src` to the live buffer `dst`,
  // after the engine's work queued so far (may only enqueue the copy).
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  // After each install: marks the point of the engine's work after which the bytes an install
  // replaced (kSwap: the old live buffer, now staging; kCopy: the staging buffer it copied)
  // are no longer read.
  virtual void mark() = 0;
  // Returns once the engine's work has passed the last mark(); Timeout after `timeout`.
  virtual void wait_marked(std::chrono::milliseconds timeout) = 0;
};

}  // namespace eplb::runtime
