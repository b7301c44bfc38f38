#pragma once
// The slots of a group's members as an engine numbers them after losing ranks, beside the
// layout's own numbering (engine maps, per-pass counts and proposals at the members' width).
// A value type: built on the forward thread from the members in force, read there.

#include <cstdint>
#include <span>
#include <vector>

namespace eplb::runtime {

// The seats' slots as an engine may number them after losing ranks (vLLM's elastic EP re-slices
// its maps to the members' slots): member g (in ascending seat order) holds the engine's slots
// [g * slots_per_rank, (g + 1) * slots_per_rank). With every seat a member the two numberings
// are one.
class CompactSlots {
 public:
  CompactSlots() = default;
  CompactSlots(std::span<const int32_t> members, int64_t slots_per_rank, int64_t ranks);

  int64_t width() const { return static_cast<int64_t>(members_.size()) * spr_; }
  bool operator==(const CompactSlots& other) const {
    return members_ == other.members_ && spr_ == other.spr_;
  }
  // The layout's slot of the engine's slot `compact`, in [0, width()).
  int64_t seat_slot(int64_t compact) const {
    return members_[static_cast<size_t>(compact / spr_)] * spr_ + compact % spr_;
  }
  // The engine's slot of the layout's slot `slot`, or -1 on a seat that is no member.
  int64_t compact_slot(int64_t slot) const {
    const int32_t g = index_of_seat_[static_cast<size_t>(slot / spr_)];
    return g < 0 ? -1 : g * spr_ + slot % spr_;
  }

 private:
  std::vector<int32_t> members_;        // seats, ascending
  std::vector<int32_t> index_of_seat_;  // [ranks] the member index of each seat, -1: none
  int64_t spr_ = 1;
};

}  // namespace eplb::runtime
