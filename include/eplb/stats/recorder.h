#pragma once
// LoadRecorder: tokens per logical expert over a sliding window of steps.
//
// Ownership and threads: one recorder per rank, owned by the forward thread. record(),
// record_counts() and step_end() are called by the forward thread only and never block or
// allocate. A rebalance takes a snapshot (snapshot_window) on the forward thread, at the step
// it triggers, and hands the copy to its worker; nothing else reads the recorder concurrently,
// so it needs no locks and no atomics. Every buffer below is the recorder's own, allocated once
// by the constructor.
//
// Cost: record() is one add per expert id; step_end() folds the step into a running window sum
// (O(layers x experts)), so a snapshot is a copy, not a sum over the window.
//
// Memory: the ring keeps each closed step as int32 (4 B a count), the open step and the running
// window sum stay int64, so the window costs half of an int64 ring and snapshot_window() and
// window_steps() return exactly what an int64 ring would. A count is limited to kMaxStepCount
// per expert, layer and step (a step sees far fewer tokens than that); record() and
// record_counts() refuse a call that would pass it, naming the value, before they count
// anything, so no count ever wraps. A narrower type (uint16 and a side table for the counts that
// do not fit) was not taken: the table cannot grow on the forward thread, so it would have to
// be sized for the worst case (no saving) or could run out after hours of serving, on a step
// that is itself valid. Bucketing steps would lose window_steps()' per-step history.

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace eplb::stats {

class LoadRecorder {
 public:
  // The most tokens one expert may receive in one layer in one step (the ring holds int32).
  static constexpr int64_t kMaxStepCount = std::numeric_limits<int32_t>::max();

  // InvalidArgument when the window would not fit in this process's memory (bytes_for, against
  // memory_available()), with both figures.
  LoadRecorder(int64_t layers, int64_t experts, int64_t window);

  // The bytes a recorder of this shape holds (its ring, open step, window sum and per-layer
  // step totals); InvalidArgument when that overflows.
  static int64_t bytes_for(int64_t layers, int64_t experts, int64_t window);

  // Adds 1 to each listed expert of `layer` in the current step. Ids outside [0, experts), or
  // a count that would pass kMaxStepCount, throw InvalidArgument (before anything is counted).
  void record(int64_t layer, std::span<const int32_t> expert_ids);
  // Adds a count vector [experts] to `layer` in the current step. Negative counts, or a step's
  // count that would pass kMaxStepCount, throw InvalidArgument (before anything is counted).
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
  // Throws InvalidArgument: `adding` more tokens on top of the `counted` of the open step.
  [[noreturn]] void refuse_step_count(const char* verb, int64_t layer, int64_t expert,
                                      int64_t counted, int64_t adding) const;

  int64_t layers_;
  int64_t experts_;
  int64_t window_;
  int64_t filled_ = 0;   // closed steps held, <= window
  int64_t closed_ = 0;   // all steps closed since construction
  int64_t oldest_ = 0;   // ring index of the oldest step once full
  std::vector<int64_t> current_;     // [layers][experts], each <= kMaxStepCount
  std::vector<int64_t> step_total_;  // [layers], sum of the layer's row of current_
  std::vector<int32_t> ring_;        // [window][layers][experts]
  std::vector<int64_t> sum_;         // [layers][experts], sum of the ring's filled steps
};

}  // namespace eplb::stats
