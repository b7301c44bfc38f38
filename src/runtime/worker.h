#pragma once
// The worker thread of a Rebalancer: the one thread that computes a rebalance's placement and
// plan and stages its layers (worker.cc's Rebalancer::Impl::run_job), off the forward thread.
//
// Ownership and threads: the forward thread owns the WorkerThread; it submits jobs (one per
// rebalance, at the trigger), waits for the worker to be idle (reconfigure) and stops it
// (shutdown). The queue is the only state the two threads share, under the mutex. A job is the
// rebalance in flight (in_flight.h), shared with the forward thread: its fields say which
// thread writes them and how they are handed over.

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "runtime/in_flight.h"

namespace eplb::runtime {

class WorkerThread {
 public:
  WorkerThread() = default;
  ~WorkerThread() { stop(); }
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  // Starts the thread, which runs `run` on each job submitted, in order (background priority:
  // it never preempts the forward thread when it wakes). Once, before any submit().
  void start(std::function<void(Active&)> run);
  void submit(std::shared_ptr<Active> job);
  // Returns once no job is queued or running (after the running one was cancelled).
  void wait_idle();
  // Lets the running job finish (cancel it first), joins; idempotent. Queued jobs are dropped.
  void stop();

 private:
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;       // a job or stop for the worker
  std::condition_variable idle_cv_;  // the worker went idle
  std::deque<std::shared_ptr<Active>> queue_;  // guarded by mu_
  bool stopping_ = false;                      // guarded by mu_
  bool busy_ = false;                          // guarded by mu_: a job runs
};

}  // namespace eplb::runtime
