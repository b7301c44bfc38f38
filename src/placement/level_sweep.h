#pragma once
// Two slots per rank, the thorough counts (two_slots::place with `sweep`): replica counts whose
// sorted pairing has no pair above a given T, built level by level from the pairing condition.
//
// A replica heavier than T / 2 by h needs a partner lighter than T / 2 by at least h, so, from
// the heaviest replica down, the replicas at least h above T / 2 may not outnumber those at
// least h below it (the bound's condition, two_slots.h; here made to hold). Each expert starts
// with the fewest replicas none above T. Where the condition fails at a level, the fix that
// buys most replicas there per slot is taken: one more replica for the expert of the level (it
// sinks below the level, and joins the other side where it sinks deep enough), or, for an
// expert not yet deep enough, the fewest more that bring all its replicas deep enough (an
// expert with r replicas just short of the depth gains r + 1 for one slot). Spare slots go to
// the heaviest replicas below T / 2 (deeper replicas only help). Greedy, so it can miss counts
// that exist: false means only that this construction needs more than 2 * ranks slots.
//
// Cost: the experts sorted twice (by load per replica, by the load per replica one more would
// give), then each level and fix in O(1) apart from the few experts whose count a fix changed,
// which wait in small heaps; fixes that need more than one slot are found by a scan, which on
// lognormal loads at 256 ranks never ran.

#include <cstdint>
#include <span>
#include <vector>

#include "placement/sort_keys.h"

namespace eplb::placement::two_slots {

class LevelSweep {
 public:
  // Counts r [experts] (each in [1, ranks], sum 2 * ranks) whose sorted pairing has no pair
  // above T, or false.
  bool run(std::span<const double> w, int64_t ranks, double T, std::vector<int32_t>& r);

 private:
  enum State : uint8_t { kFree, kAbove, kBelow };
  struct Entry {
    double key;
    int32_t expert, count;
    // Max-heap on key; on a tie the lower index first.
    bool operator<(const Entry& o) const {
      return key < o.key || (key == o.key && expert > o.expert);
    }
  };

  // The next expert above T / 2 (the tallest), or -1; its height in `height`.
  int32_t next_above(std::span<const double> w, std::span<const int32_t> r, double half,
                     double& height);
  // Moves the experts at least `depth` below T / 2 to the other side; returns their replicas.
  int64_t take_below(std::span<const double> w, std::span<const int32_t> r, double half,
                     double depth);
  // Sorts a changed expert into the side heaps and the one-slot queue.
  void requeue(std::span<const double> w, std::span<const int32_t> r, int64_t ranks, double half,
               int32_t e);
  // The one-slot fix that gains most with replicas at most `depth_load`, or expert -1; the
  // gain in `gain`.
  int32_t best_one_slot(std::span<const double> w, std::span<const int32_t> r, double depth_load,
                        int64_t& gain);
  void make_ready(std::span<const int32_t> r, int32_t e);
  int64_t gain_of(std::span<const int32_t> r, int32_t e) const {
    return r[e] + 1 + (state_[e] == kAbove ? r[e] : 0);
  }

  std::vector<State> state_;
  std::vector<int32_t> first_;  // each expert's starting count: sorted entries hold for it
  std::vector<int32_t> ready_at_;  // the count at which it became a ready one-slot fix, or -1
  // The experts by load per replica, heaviest first: those above T / 2 are taken from the
  // front, those below from the back (deepest first).
  std::vector<int32_t> order_;
  size_t front_ = 0, back_ = 0;  // back_: one past the next from the back
  // The experts by the load per replica one more replica gives, lightest first.
  std::vector<int32_t> next_order_;
  size_t next_ = 0;
  // Experts whose count changed: above T / 2 (by height), below it (by depth), waiting for a
  // one-slot fix (by that load, negated).
  std::vector<Entry> above_heap_, below_heap_, next_heap_;
  // One-slot fixes deep enough for the level, by gain (at most 2 * ranks + 1).
  std::vector<std::vector<int32_t>> ready_;
  int64_t ready_top_ = 0;
  std::vector<SortKey> keys_, scratch_;
};

}  // namespace eplb::placement::two_slots
