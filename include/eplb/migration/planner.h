#pragma once
// The migration planner: for one layer, how every destination slot gets its new expert.
//
// Given the old and new phy2log of a layer, the rank/node layout and the bytes of one expert,
// plan_layer gives every slot exactly one action, tried in this order:
//   1. kUnchanged     the slot already holds its new expert;
//   2. kLocalCopy     another slot of the same rank holds the expert in the OLD placement
//                     (the lowest such slot is the source);
//   3. kFreeRide      an earlier slot of the same rank receives the expert by a read in this
//                     layer: copy from that slot once it is installed, instead of reading twice;
//   4. kReadSameNode  read from a holder (in the old placement) on the same node;
//   5. kReadOtherNode read from a holder on another node.
// For 4 and 5 the holder rank is chosen to spread the bytes served as evenly as possible over
// the holders: demands with the fewest candidate holder ranks are assigned first, each to the
// candidate that has served the least so far, ties to the lowest rank (then its lowest slot).
// Everything is integer arithmetic with ties broken by index: the plan is identical on every
// rank that computes it from the same input.
//
// Executing a layer plan (what the runtime does, and what the unit tests simulate):
//   1. stage  - on every rank, for each of its slots whose action is kLocalCopy, kReadSameNode
//               or kReadOtherNode, copy the OLD content of (src_rank, src_slot) into that
//               rank's staging entry for the slot. No live slot changes in this phase, on any
//               rank, so every source still holds its old expert: this is why a local copy may
//               read a slot that the same layer overwrites. Staging entries are numbered by
//               destination slot order within the rank; LayerPlan::staging_slots is the most
//               one rank needs.
//   2. install - once every rank has finished phase 1 (the agreement of the runtime protocol),
//               each rank copies every staging entry into its destination slot (any order: the
//               destinations are distinct and the staging buffer is separate memory);
//   3. free rides - then, in slot order, each kFreeRide slot copies from its src_slot, an
//               earlier slot of the same rank whose read was installed in phase 2.
// kUnchanged slots are never touched.

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "eplb/core/types.h"

namespace eplb::migration {

enum class Action : uint8_t {
  kUnchanged = 0,
  kLocalCopy = 1,
  kFreeRide = 2,
  kReadSameNode = 3,
  kReadOtherNode = 4,
};
inline constexpr int kNumActions = 5;

// "unchanged", "local_copy", "free_ride", "read_same_node", "read_other_node".
std::string_view action_name(Action action);

// Whether an action's content passes through staging (phase 1 of the execution order).
inline bool is_staged(Action action) {
  return action == Action::kLocalCopy || action == Action::kReadSameNode ||
         action == Action::kReadOtherNode;
}
inline bool is_remote(Action action) {
  return action == Action::kReadSameNode || action == Action::kReadOtherNode;
}

// How one destination slot gets its expert. src_slot is a physical slot of the layer:
//   kUnchanged: the slot itself; kLocalCopy: a slot of the same rank holding `expert` in the
//   old placement; kFreeRide: an earlier slot of the same rank read in this layer; reads: a
//   slot of src_rank holding `expert` in the old placement.
struct SlotAction {
  Action action = Action::kUnchanged;
  int32_t expert = -1;    // the slot's logical expert in the new placement
  int32_t src_rank = -1;  // the rank of src_slot
  int32_t src_slot = -1;
};

// One one-sided read: dst_rank reads src_slot of src_rank into (its staging entry for) dst_slot.
struct RemoteRead {
  int32_t src_rank = -1;
  int32_t src_slot = -1;
  int32_t dst_rank = -1;
  int32_t dst_slot = -1;
  int32_t expert = -1;
};

struct LayerPlan {
  std::vector<SlotAction> actions;           // [physical], by destination slot; rank g owns
                                             // [g * slots_per_rank, (g + 1) * slots_per_rank)
  std::vector<RemoteRead> reads;             // by destination slot
  std::array<int64_t, kNumActions> slots{};  // slots per Action

  std::vector<int64_t> rank_bytes_in;   // [ranks] bytes each rank reads from peers
  std::vector<int64_t> rank_bytes_out;  // [ranks] bytes each rank serves to peers
  int64_t bytes_total = 0;              // all remote reads = intra + inter node
  int64_t bytes_intra_node = 0;
  int64_t bytes_inter_node = 0;
  int64_t bytes_local_copy = 0;  // same-rank copies (local copies and free rides)
  int64_t max_rank_bytes_in = 0;
  int64_t max_rank_bytes_out = 0;
  int64_t staging_slots = 0;  // the most staged slots (local copies + reads) of one rank

  int64_t count(Action action) const { return slots[static_cast<size_t>(action)]; }
  std::span<const SlotAction> rank_actions(int64_t rank, const Layout& layout) const {
    return {actions.data() + rank * layout.slots_per_rank(),
            static_cast<size_t>(layout.slots_per_rank())};
  }
};

// Plans one layer. old_phy2log and new_phy2log: [physical], expert ids >= 0. Uses layout's
// physical, ranks and nodes (experts and groups are not needed). Throws InvalidArgument on a
// shape mismatch, a bad layout, expert_bytes <= 0, or an expert of the new placement that no
// slot of the old one holds (there is nothing to read it from).
LayerPlan plan_layer(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                     const Layout& layout, int64_t expert_bytes);

}  // namespace eplb::migration
