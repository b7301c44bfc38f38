#pragma once
// The records of a Rebalancer's rebalances: the one in flight, which the forward thread fills as
// the rebalance goes (its plan's figures, its installs, its stall) and ends at the step it ends,
// and the history of the ended ones, which any thread may read.
//
// Threads: everything but history() is the forward thread's; history() takes the mutex, which
// publish() holds only to append.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "eplb/core/clock.h"
#include "eplb/runtime/record.h"
#include "runtime/failure.h"

namespace eplb::runtime {

class RecordBook {
 public:
  // The rebalance in flight, or none (forward thread).
  std::optional<RebalanceRecord> open;

  // Opens the record of a rebalance triggered at `step`, with the next index.
  void start(int64_t step, bool repair) {
    open.emplace();
    open->index = next_index_++;
    open->trigger_step = step;
    open->repair = repair;
    ended_ = false;
    started_ = SteadyClock::now();
  }

  // Ends the open record at `step`; `raise` is what step_end throws under on_error=raise. It is
  // published at the end of that step (ended()).
  void end(int64_t step, std::optional<Failure> raise) {
    open->end_step = step;
    open->steps = step - open->trigger_step;
    open->seconds = ms_since(started_) / 1000.0;
    ended_ = true;
    raise_ = std::move(raise);
  }
  bool ended() const { return ended_; }

  // Moves the ended record into the history and returns it, with what to raise.
  RebalanceRecord publish(std::optional<Failure>& raise) {
    RebalanceRecord record = std::move(*open);
    open.reset();
    ended_ = false;
    raise = std::exchange(raise_, std::nullopt);
    std::lock_guard<std::mutex> lock(mu_);
    history_.push_back(record);
    return record;
  }

  // The index the next rebalance takes (the same on every member: reconfigure() adopts it).
  int64_t next_index() const { return next_index_; }
  void set_next_index(int64_t index) { next_index_ = index; }

  // Any thread.
  std::vector<RebalanceRecord> history() const {
    std::lock_guard<std::mutex> lock(mu_);
    return history_;
  }

 private:
  bool ended_ = false;
  SteadyClock::time_point started_;
  std::optional<Failure> raise_;
  int64_t next_index_ = 0;
  mutable std::mutex mu_;
  std::vector<RebalanceRecord> history_;  // guarded by mu_
};

}  // namespace eplb::runtime
