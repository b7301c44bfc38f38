#include "eplb/stats/recorder.h"

#include <algorithm>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"

namespace eplb::stats {

LoadRecorder::LoadRecorder(int64_t layers, int64_t experts, int64_t window)
    : layers_(layers), experts_(experts), window_(window) {
  if (layers < 1 || experts < 1) {
    fail("load recorder needs layers ", layers, " >= 1 and experts ", experts, " >= 1");
  }
  if (window < 1) fail("window ", window, " must be at least 1 step");
  if (layers > kMaxLayers || experts > kMaxExperts) {
    fail("load recorder: layers ", layers, " and experts ", experts, " must be at most ",
         kMaxLayers, " and ", kMaxExperts);
  }
  const int64_t bytes = bytes_for(layers, experts, window);
  check_fits_in_memory(bytes, detail::concat("the load window of ", window, " steps x ", layers,
                                             " layers x ", experts, " experts"),
                       "lower the window");
  const size_t cells = static_cast<size_t>(layers * experts);
  current_.assign(cells, 0);
  step_total_.assign(static_cast<size_t>(layers), 0);
  sum_.assign(cells, 0);
  ring_.assign(cells * static_cast<size_t>(window), 0);
}

int64_t LoadRecorder::bytes_for(int64_t layers, int64_t experts, int64_t window) {
  // The ring of `window` steps at 4 B a count; the open step and the running sum at 8 B; one
  // 8 B step total per layer.
  const int64_t cells = checked_mul(layers, experts, "load recorder cells");
  const int64_t ring = checked_mul(checked_mul(cells, window, "load window cells"),
                                   int64_t{sizeof(int32_t)}, "load window bytes");
  const int64_t step_and_sum =
      checked_mul(cells, 2 * int64_t{sizeof(int64_t)}, "load window bytes");
  const int64_t totals = checked_mul(layers, int64_t{sizeof(int64_t)}, "load window bytes");
  return checked_add(checked_add(ring, step_and_sum, "load window bytes"), totals,
                     "load window bytes");
}

void LoadRecorder::refuse_step_count(const char* verb, int64_t layer, int64_t expert,
                                     int64_t counted, int64_t adding) const {
  fail(verb, ": layer ", layer, " expert ", expert, " would count ", counted, " + ", adding,
       " tokens in step ", closed_, ", more than the ", kMaxStepCount,
       " the recorder keeps per expert, layer and step (int32); is step_end() called after "
       "every forward pass?");
}

void LoadRecorder::record(int64_t layer, std::span<const int32_t> expert_ids) {
  if (layer < 0 || layer >= layers_) {
    fail("record: layer ", layer, " is outside [0, ", layers_, ")");
  }
  for (size_t i = 0; i < expert_ids.size(); ++i) {
    if (expert_ids[i] < 0 || expert_ids[i] >= experts_) {
      fail("record: layer ", layer, " expert id ", expert_ids[i], " at position ", i,
           " is outside [0, ", experts_, ")");
    }
  }
  int64_t* row = current_.data() + layer * experts_;
  for (int32_t e : expert_ids) ++row[e];
  int64_t& total = step_total_[static_cast<size_t>(layer)];
  total += static_cast<int64_t>(expert_ids.size());
  // No count of the layer can pass the layer's total: only past the limit is a look needed.
  if (total <= kMaxStepCount) return;
  for (int32_t e : expert_ids) {
    if (row[e] <= kMaxStepCount) continue;
    for (int32_t undo : expert_ids) --row[undo];
    total -= static_cast<int64_t>(expert_ids.size());
    const auto adding = std::count(expert_ids.begin(), expert_ids.end(), e);
    refuse_step_count("record", layer, e, row[e], static_cast<int64_t>(adding));
  }
}

void LoadRecorder::record_counts(int64_t layer, std::span<const int64_t> counts) {
  if (layer < 0 || layer >= layers_) {
    fail("record_counts: layer ", layer, " is outside [0, ", layers_, ")");
  }
  if (static_cast<int64_t>(counts.size()) != experts_) {
    fail("record_counts: ", counts.size(), " counts for layer ", layer, ", expected one per expert (",
         experts_, ")");
  }
  int64_t* row = current_.data() + layer * experts_;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] < 0) fail("record_counts: layer ", layer, " expert ", e, " count ", counts[e],
                            " is negative");
    // row[e] <= kMaxStepCount, so the difference cannot overflow, nor can the sum below.
    if (counts[e] > kMaxStepCount - row[e]) {
      refuse_step_count("record_counts", layer, static_cast<int64_t>(e), row[e], counts[e]);
    }
  }
  int64_t added = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    row[e] += counts[e];
    added += counts[e];
  }
  step_total_[static_cast<size_t>(layer)] += added;
}

void LoadRecorder::step_end() {
  const size_t cells = current_.size();
  int64_t slot;
  if (filled_ < window_) {
    slot = filled_++;
  } else {
    slot = oldest_;
    oldest_ = (oldest_ + 1) % window_;
  }
  int32_t* ring = ring_.data() + static_cast<size_t>(slot) * cells;
  for (size_t i = 0; i < cells; ++i) {
    // current_[i] <= kMaxStepCount (record and record_counts refuse more): the cast is exact.
    sum_[i] += current_[i] - ring[i];
    ring[i] = static_cast<int32_t>(current_[i]);
    current_[i] = 0;
  }
  std::fill(step_total_.begin(), step_total_.end(), 0);
  ++closed_;
}

void LoadRecorder::snapshot_window(std::span<int64_t> out) const {
  EPLB_CHECK_EQ(out.size(), sum_.size(), "snapshot_window: output must hold layers x experts");
  std::copy(sum_.begin(), sum_.end(), out.begin());
}

std::vector<int64_t> LoadRecorder::window_steps() const {
  const size_t cells = current_.size();
  std::vector<int64_t> out;
  out.reserve(cells * static_cast<size_t>(filled_));
  const int64_t first = filled_ < window_ ? 0 : oldest_;
  for (int64_t i = 0; i < filled_; ++i) {
    const int64_t slot = (first + i) % window_;
    const int32_t* ring = ring_.data() + static_cast<size_t>(slot) * cells;
    out.insert(out.end(), ring, ring + cells);
  }
  return out;
}

}  // namespace eplb::stats
