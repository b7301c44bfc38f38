#include "runtime/control_thread.h"

#include <utility>

#include "eplb/core/error.h"

namespace eplb::runtime {

ControlThread::ControlThread(control::Communicator& communicator,
                             std::function<void()> before_each, std::function<void()> on_start)
    : communicator_(communicator), before_each_(std::move(before_each)) {
  thread_ = std::thread([this, on_start = std::move(on_start)] {
    if (on_start) on_start();
    run();
  });
}

ControlThread::~ControlThread() { stop(); }

std::future<CollectiveResult> ControlThread::all_reduce(std::vector<int64_t> values,
                                                       control::ReduceOp op,
                                                       std::chrono::milliseconds timeout,
                                                       std::function<void()> before) {
  Job job;
  job.values = std::move(values);
  job.op = op;
  job.timeout = timeout;
  job.before = std::move(before);
  std::future<CollectiveResult> future = job.result.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      job.result.set_value({.values = {},
                            .failure = Failure{FailureKind::kIoError,
                                               "control thread stopped: no collective runs "
                                               "after shutdown"}});
      return future;
    }
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return future;
}

void ControlThread::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void ControlThread::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      // Drain before leaving: the peers run the same queue, and a collective skipped here
      // would leave them waiting until their timeout.
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    CollectiveResult result;
    try {
      if (before_each_) before_each_();
      if (job.before) job.before();
      communicator_.all_reduce(job.values, job.op, job.timeout);
      result.values = std::move(job.values);
    } catch (...) {
      result.failure = Failure::current();  // the exception itself dies on this thread
    }
    job.result.set_value(std::move(result));
  }
}

}  // namespace eplb::runtime
