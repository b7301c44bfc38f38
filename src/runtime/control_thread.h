#pragma once
// The control thread: the only thread that calls the communicator once the runtime runs.
// Others hand it collectives, which it runs one at a time in the order they were submitted,
// and wait on futures. The forward thread is the only submitter during serving, at steps every
// rank counts the same, so every rank runs the same collectives in the same order.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "eplb/control/communicator.h"
#include "runtime/failure.h"

namespace eplb::runtime {

// What a collective of the control thread yields: the reduced values, or its failure as plain
// values (failure.h says why no exception object crosses threads).
struct CollectiveResult {
  std::vector<int64_t> values;
  std::optional<Failure> failure;

  // The values, or a fresh exception of the failure's kind thrown on the calling thread.
  std::vector<int64_t> take() && {
    if (failure) failure->raise();
    return std::move(values);
  }
};

class ControlThread {
 public:
  // `before_each` (may be empty) runs on the control thread before every collective;
  // `on_start` (may be empty) once, first thing on the thread.
  ControlThread(control::Communicator& communicator, std::function<void()> before_each,
                std::function<void()> on_start = {});
  ~ControlThread();
  ControlThread(const ControlThread&) = delete;
  ControlThread& operator=(const ControlThread&) = delete;

  // Queues an in-place all_reduce of `values`; the future yields the result or the
  // collective's failure (IoError, Timeout, ...). `before` (may be empty) runs on the control
  // thread just before this collective; if it throws, the collective is not run and the future
  // yields that failure. The future never holds an exception.
  std::future<CollectiveResult> all_reduce(std::vector<int64_t> values, control::ReduceOp op,
                                               std::chrono::milliseconds timeout,
                                               std::function<void()> before = {});

  // Runs every queued collective, then joins. Idempotent.
  void stop();

 private:
  struct Job {
    std::vector<int64_t> values;
    control::ReduceOp op = control::ReduceOp::kMin;
    std::chrono::milliseconds timeout{0};
    std::function<void()> before;
    std::promise<CollectiveResult> result;
  };
  void run();

  control::Communicator& communicator_;
  std::function<void()> before_each_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;  // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace eplb::runtime
