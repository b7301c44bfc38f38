#pragma once
// The elastic group state (docs/elastic.md): which seats serve now (the members), which slots
// hold their expert's weights (usable), whether a repair rebalance is owed and whether the last
// one failed, how many reconfigure() calls made a new group and which group's window failed,
// and the install bookkeeping (a layer installed fills every member slot of it). The weights
// themselves are the weight store's (weight_store.h); the tables built from this state are
// Rebalancer::Impl's.
//
// Threads. The forward thread owns it: reconfigure() adopts a new group, install marks layers,
// the records end repairs, the trigger reads the repair flags, and it is copied into each
// rebalance (ElasticInputs) at the trigger, so the worker never reads it. The group counters
// are atomic: group() is read by any thread, window_failed() is called by the monitor thread.

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/runtime/record.h"
#include "runtime/compact_slots.h"
#include "runtime/compute.h"

namespace eplb::runtime {

class WeightStore;

class GroupState {
 public:
  // Every seat of `layout` a member; every slot of `layers` usable, or (`joining`) none until
  // the first reconfigure().
  GroupState(const Layout& layout, int64_t layers, bool joining);

  // ---- Members and usable slots (forward thread).
  const std::vector<int32_t>& members() const { return members_; }  // seats, ascending
  // The engine's numbering of the members' slots (compact_slots.h), rebuilt with the members:
  // record_pass() reads it every pass.
  const CompactSlots& compact() const { return compact_; }
  bool all_members() const { return static_cast<int64_t>(members_.size()) == ranks_; }
  const std::vector<uint8_t>& usable() const { return usable_; }  // [layers][physical]
  std::span<const uint8_t> usable_row(int64_t layer) const;        // [physical]
  bool all_usable() const;
  int64_t lost_slots() const;  // slots (all layers) that hold nothing usable
  // A new group (reconfigure()): its seats, what every slot holds, and whether a repair is
  // owed (which clears a failed repair's mark). `members` ascending; `usable` [layers][physical].
  void adopt(std::vector<int32_t> members, std::vector<uint8_t> usable, bool repair);
  // After installing `layer` (member(seat) says which seats serve): every member slot of it
  // holds its expert now; one more layer install in the count.
  template <typename Member>
  void mark_installed(int64_t layer, Member&& member) {
    const int64_t spr = physical_ / ranks_;
    for (int64_t p = 0; p < physical_; ++p) {
      usable_[static_cast<size_t>(layer * physical_ + p)] = member(static_cast<int>(p / spr));
    }
    ++installed_total_;
  }
  int64_t installed_total() const { return installed_total_; }

  // ---- Repairs (forward thread).
  bool repair_pending() const { return repair_pending_; }
  // A repair starts at the next step, unless one failed since the last reconfigure() (then it
  // waits for the next interval).
  bool repair_due() const { return repair_pending_ && !repair_failed_; }
  // A repair rebalance ended with `outcome`: completed or skipped, nothing is owed any more;
  // failed, it is retried at intervals only.
  void repair_ended(Outcome outcome);

  // What a plan needs beyond the window (compute.h): members, usable slots and the repair flag,
  // and the backup holders of `weights` and whether a loader is set, where any slot is lost.
  ElasticInputs inputs(const WeightStore& weights, bool loader) const;

  // ---- Group counters (any thread).
  int64_t group() const { return group_.load(std::memory_order_acquire); }
  // reconfigure(): the collectives from here on are the next group's.
  void next_group() { group_.fetch_add(1, std::memory_order_acq_rel); }
  // The monitor thread: a window of `group` failed.
  void window_failed(int64_t group) { broken_group_.store(group, std::memory_order_release); }
  // A window of the current group failed (an old group's may arrive after reconfigure()).
  bool window_broken() const {
    return broken_group_.load(std::memory_order_acquire) == group();
  }

 private:
  int64_t ranks_;
  int64_t physical_;
  int64_t slots_per_rank_;
  std::vector<int32_t> members_;  // seats of the group, ascending
  CompactSlots compact_;          // of members_
  std::vector<uint8_t> usable_;   // [layers][physical]: the slot holds its expert's weights
  bool repair_pending_ = false;   // reconfigure() asks for a repair rebalance
  bool repair_failed_ = false;    // one failed since: retried at intervals only
  int64_t installed_total_ = 0;   // layer installs, all rebalances
  std::atomic<int64_t> group_{0};          // reconfigure() calls so far: whose collectives
  std::atomic<int64_t> broken_group_{-1};  // the group whose window failed
};

}  // namespace eplb::runtime
