#pragma once
// LoadRecorder: tokens per logical expert over a sliding window of steps.
//
// Ownership and threads: one recorder per rank, owned by the forward thread. record(),
// record_counts() and step_end() are called by the forward thread only and never block or
// allocate. A rebalance takes a snapshot (snapshot_window) on the forward thread, at the step
// it triggers, and hands the copy to its worker; nothing else reads the recorder concurrently,
// so it needs no locks and no atomics.
//
// Cost: record() is one add per expert id; step_end() folds the step into a running window sum
// (O(layers x experts)), so a snapshot is a copy, not a sum over the window.

#include <cstdint>
#include <span>
#include <vector>

namespace eplb::stats {

class LoadRecorder {
 public:
  // InvalidArgument when the window would not fit in this process's memory (bytes_for, against
  // memory_available()), with both figures.
  LoadRecorder(int64_t layers, int64_t experts, int64_t window);

  // The bytes a recorder of this shape holds; InvalidArgument when that overflows.
  static int64_t bytes_for(int64_t layers, int64_t experts, int64_t window);

  // Adds 1 to each listed expert of `layer` in the current step. Ids outside [0, experts)
  // throw InvalidArgument (before anything is counted).
  void record(int64_t layer, std::span<const int32_t> expert_ids);
  // Adds a count vector [experts] to `layer` in the current step.
  void record_counts(int64_t layer, std::span<const int64_t> counts);
  // Closes the current step: it enters the window, the oldest step leaves it.
  void step_end();

  // Sum over the last min(steps, window) closed steps. [layers][experts]
  void snapshot_window(std::span<int64_t> out) const;
  // The closed steps in the window, oldest first. [steps][layers][experts]
  std::vector<int64_t> window_steps() const;

  int64_t layers() const { return layers_; }
  int64_t experts() const { return experts_; }
  int64_t window() const { return window_; }
  int64_t steps_in_window() const { return filled_; }
  int64_t steps_closed() const { return closed_; }
  std::span<const int64_t> current() const { return current_; }

 private:
  int64_t layers_;
  int64_t experts_;
  int64_t window_;
  int64_t filled_ = 0;   // closed steps held, <= window
  int64_t closed_ = 0;   // all steps closed since construction
  int64_t oldest_ = 0;   // ring index of the oldest step once full
  std::vector<int64_t> current_;  // [layers][experts]
  std::vector<int64_t> ring_;     // [window][layers][experts]
  std::vector<int64_t> sum_;      // [layers][experts], sum of the ring's filled steps
};

}  // namespace eplb::stats
