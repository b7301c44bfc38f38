// The members' slots in an engine's numbering (compact_slots.h).

#include "runtime/compact_slots.h"

namespace eplb::runtime {

CompactSlots::CompactSlots(std::span<const int32_t> members, int64_t slots_per_rank,
                           int64_t ranks)
    : members_(members.begin(), members.end()),
      index_of_seat_(static_cast<size_t>(ranks), -1),
      spr_(slots_per_rank) {
  for (size_t g = 0; g < members_.size(); ++g) {
    index_of_seat_[static_cast<size_t>(members_[g])] = static_cast<int32_t>(g);
  }
}

}  // namespace eplb::runtime
