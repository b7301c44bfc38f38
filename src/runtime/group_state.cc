// The elastic group state (group_state.h).

#include "runtime/group_state.h"

#include <algorithm>
#include <utility>

#include "eplb/core/error.h"
#include "runtime/weight_store.h"

namespace eplb::runtime {

GroupState::GroupState(const Layout& layout, int64_t layers, bool joining)
    : ranks_(layout.ranks),
      physical_(layout.physical),
      slots_per_rank_(layout.slots_per_rank()),
      members_(static_cast<size_t>(layout.ranks)),
      usable_(static_cast<size_t>(layers * layout.physical), joining ? 0 : 1) {
  for (int32_t g = 0; g < layout.ranks; ++g) members_[static_cast<size_t>(g)] = g;
  compact_ = CompactSlots(members_, slots_per_rank_, ranks_);
}

std::span<const uint8_t> GroupState::usable_row(int64_t layer) const {
  return std::span<const uint8_t>(usable_).subspan(static_cast<size_t>(layer * physical_),
                                                   static_cast<size_t>(physical_));
}

bool GroupState::all_usable() const {
  return std::all_of(usable_.begin(), usable_.end(), [](uint8_t u) { return u != 0; });
}

int64_t GroupState::lost_slots() const {
  return static_cast<int64_t>(std::count(usable_.begin(), usable_.end(), uint8_t{0}));
}

void GroupState::adopt(std::vector<int32_t> members, std::vector<uint8_t> usable, bool repair) {
  EPLB_CHECK(std::is_sorted(members.begin(), members.end()), "members must be ascending");
  EPLB_CHECK_EQ(usable.size(), usable_.size(), "usable slots must be [layers][physical]");
  members_ = std::move(members);
  compact_ = CompactSlots(members_, slots_per_rank_, ranks_);
  usable_ = std::move(usable);
  repair_pending_ = repair;
  repair_failed_ = false;
}

void GroupState::repair_ended(Outcome outcome) {
  if (outcome == Outcome::kFailed) {
    repair_failed_ = true;
  } else if (outcome != Outcome::kCancelled) {
    repair_pending_ = false;  // a repair that completed (or found nothing to do)
  }
}

ElasticInputs GroupState::inputs(const WeightStore& weights, bool loader) const {
  ElasticInputs in;
  in.repair = repair_pending_;
  if (all_members() && all_usable()) return in;
  in.members = members_;
  in.usable = usable_;
  in.loader = loader;
  in.backup_holders = weights.backup_holders();
  return in;
}

}  // namespace eplb::runtime
