#pragma once
// The migration planner: for one layer, how every destination slot gets its new expert.
//
// Given the old and new phy2log of a layer, the rank/node layout and the bytes of one expert,
// plan_layer gives every slot exactly one action, tried in this order:
//   1. kUnchanged     the slot already holds its new expert;
//   2. kLocalCopy     another slot of the same rank holds the expert in the OLD placement
//                     (the lowest such slot is the source);
//   3. kFreeRide      an earlier slot of the same rank receives the expert by a read or a
//                     restore in this layer: copy from that slot instead of fetching it twice;
//   4. kReadSameNode  read from a holder (in the old placement) on the same node;
//   5. kReadOtherNode read from a holder on another node;
//   6. kRestore       no slot of the old placement holds the expert with valid weights: copy it
//                     from a backup (below).
// For 4 and 5 the holder rank is chosen by one of two rules (SourceChoice):
//   kSpreadServed (the default; duplex links) - the holders on the reader's node if there are
//     any, else all of them; the bytes served spread as evenly as possible over them: demands
//     with the fewest candidate holder ranks are assigned first, each to the candidate that
//     has served the least so far, ties to the lowest rank (then its lowest slot).
//   kLowestPeakDegree (half-duplex links, where a rank's reads in and out share its link) -
//     any holder; the largest number of reads one rank takes part in (in plus out) as low as
//     it can be. Demands with the fewest candidates first, each to the candidate with the
//     fewest reads in and out so far (ties: on the reader's node, then the lowest rank); then
//     reads move along chains of holders (a read of the busiest rank to another holder, whose
//     read to another, ...) while a chain ends at a rank with at least two reads fewer than
//     the busiest, one busiest rank at a time. When no chain is left from a busiest rank, the
//     peak is the least any choice of holders reaches: the ranks its chains reach hold every
//     candidate of the reads they serve and none is two below the peak, so those reads cannot
//     be spread thinner.
// Everything is integer arithmetic with ties broken by index: the plan is identical on every
// rank that computes it from the same input.
//
// Elastic serving (PlanSources): after a rank is lost, or when one joins with empty weights, the
// layout stays the same but some slots hold no valid weights ("unusable": every slot of a lost
// or a just-joined rank), and the lost ranks take no part ("members"). Only a valid slot of a
// member rank is a source or stays kUnchanged; an unusable slot of a member is filled like any
// changed slot even when its expert stays the same; a non-member rank gets no action at all
// (its slots are kUnchanged whatever the new placement says). An expert that no valid slot
// holds is restored (kRestore) from, in this order:
//   a. the destination rank's own host copy of it;
//   b. the host copy of a member rank on the same node, then on another node: chosen like the
//      holders of reads (fewest candidates first, least served, ties to the lowest rank), with
//      a count of served restores of its own, since host copies are not the GPU's links;
//   c. the loader (src_rank -1): the rank reads the expert from the checkpoint itself.
// One exception to the order above (the "own cost"): when the only valid holders are on other
// nodes and the destination rank holds a host copy itself, it restores from that copy instead
// of reading across nodes. Two slots of one rank that need the same restored expert: the first
// restores, the others ride on it (kFreeRide).
//
// Executing a layer plan (what the runtime does, and what the unit tests simulate):
//   1. stage  - on every rank, for each of its slots whose action is staged (is_staged), fill
//               that rank's staging entry for the slot. Restores go first, in one batch before
//               the scheduled reads (lost experts first): copy the expert from src_rank's host
//               backup (a local host-to-device copy when src_rank is the rank itself, a
//               one-sided read of the peer's registered host copy otherwise, the loader when
//               src_rank is -1). Then local copies and the reads, round by round: copy the OLD
//               content of (src_rank, src_slot). No live slot changes in this phase, on any
//               rank, so every source still holds its old expert: this is why a local copy may
//               read a slot that the same layer overwrites (and why the order within the phase
//               does not matter for correctness). Staging entries are numbered by destination
//               slot order within the rank; LayerPlan::staging_slots is the most one rank needs.
//   2. install - once every rank has finished phase 1 (the agreement of the runtime protocol),
//               each rank copies every staging entry into its destination slot (any order: the
//               destinations are distinct and the staging buffer is separate memory);
//   3. free rides - last, in slot order, each kFreeRide slot copies from its src_slot, an
//               earlier slot of the same rank whose read or restore was staged in phase 1 (from
//               its staging entry, or from the slot once installed: the same bytes).
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
  kRestore = 5,
};
inline constexpr int kNumActions = 6;

// "unchanged", "local_copy", "free_ride", "read_same_node", "read_other_node", "restore".
std::string_view action_name(Action action);

// Whether an action's content passes through staging (phase 1 of the execution order).
inline bool is_staged(Action action) {
  return action == Action::kLocalCopy || action == Action::kReadSameNode ||
         action == Action::kReadOtherNode || action == Action::kRestore;
}
// Whether an action reads a peer's live slot (a scheduled read). A restore is not one.
inline bool is_remote(Action action) {
  return action == Action::kReadSameNode || action == Action::kReadOtherNode;
}

// How one destination slot gets its expert. src_slot is a physical slot of the layer:
//   kUnchanged: the slot itself; kLocalCopy: a slot of the same rank holding `expert` in the
//   old placement; kFreeRide: an earlier slot of the same rank read or restored in this layer;
//   reads: a slot of src_rank holding `expert` in the old placement; kRestore: -1 (src_rank is
//   the rank whose host copy is used, -1 for the loader).
struct SlotAction {
  Action action = Action::kUnchanged;
  int32_t expert = -1;    // the slot's logical expert in the new placement
  int32_t src_rank = -1;  // the rank of src_slot (kRestore: of the backup, -1: the loader)
  int32_t src_slot = -1;

  bool operator==(const SlotAction&) const = default;
};

// One one-sided read: dst_rank reads src_slot of src_rank into (its staging entry for) dst_slot.
struct RemoteRead {
  int32_t src_rank = -1;
  int32_t src_slot = -1;
  int32_t dst_rank = -1;
  int32_t dst_slot = -1;
  int32_t expert = -1;

  bool operator==(const RemoteRead&) const = default;
};

// One restore of an expert no valid slot holds: dst_rank copies `expert` from the host backup
// of src_rank into (its staging entry for) dst_slot. src_rank == dst_rank: its own copy;
// src_rank -1: the loader. Not a scheduled read: the runtime does all of a layer's restores in
// one batch before its reads.
struct Restore {
  int32_t src_rank = -1;
  int32_t dst_rank = -1;
  int32_t dst_slot = -1;
  int32_t expert = -1;

  bool operator==(const Restore&) const = default;
};

// Where a layer's weights can come from besides the slots of the old placement (elastic
// serving; see the top of this file). The default, all empty: every slot valid, every rank a
// member, no backup, which is the plan of a plain rebalance. The spans must outlive the call.
struct PlanSources {
  std::span<const uint8_t> usable{};   // [physical] nonzero: valid weights; empty: all valid
  std::span<const uint8_t> members{};  // [ranks] nonzero: the rank takes part; empty: all
  // [experts] the ranks that hold a host copy of each expert; a rank that is not a member is
  // never used. Empty: no copies; an expert past the end has none.
  std::span<const std::vector<int32_t>> backup_holders{};
  bool loader = false;  // every member can load any expert itself (the slowest source)
};

// How plan_layer picks the holder that a read comes from (see the top of this file).
enum class SourceChoice : uint8_t {
  kSpreadServed = 0,
  kLowestPeakDegree = 1,
};

struct LayerPlan {
  std::vector<SlotAction> actions;           // [physical], by destination slot; rank g owns
                                             // [g * slots_per_rank, (g + 1) * slots_per_rank)
  std::vector<RemoteRead> reads;             // by destination slot
  std::vector<Restore> restores;             // by destination slot
  std::array<int64_t, kNumActions> slots{};  // slots per Action

  // Reads only: restores are counted apart (bytes_restored*), not in these nor in bytes_total.
  std::vector<int64_t> rank_bytes_in;   // [ranks] bytes each rank reads from peers
  std::vector<int64_t> rank_bytes_out;  // [ranks] bytes each rank serves to peers
  int64_t bytes_total = 0;              // all remote reads = intra + inter node
  int64_t bytes_intra_node = 0;
  int64_t bytes_inter_node = 0;
  int64_t bytes_local_copy = 0;  // same-rank copies (local copies and free rides)
  int64_t max_rank_bytes_in = 0;
  int64_t max_rank_bytes_out = 0;
  int64_t bytes_restored = 0;         // all restores (own copy, a peer's copy, the loader)
  int64_t bytes_restored_remote = 0;  // restores from another rank's host copy
  int64_t staging_slots = 0;  // the most staged slots (local copies + reads + restores) of one rank

  int64_t count(Action action) const { return slots[static_cast<size_t>(action)]; }
  std::span<const SlotAction> rank_actions(int64_t rank, const Layout& layout) const {
    return {actions.data() + rank * layout.slots_per_rank(),
            static_cast<size_t>(layout.slots_per_rank())};
  }

  bool operator==(const LayerPlan&) const = default;
};

// Plans one layer. old_phy2log and new_phy2log: [physical], expert ids >= 0. Uses layout's
// physical, ranks and nodes (experts and groups are not needed). Throws InvalidArgument on a
// shape mismatch, a bad layout, expert_bytes <= 0, sources of the wrong size or naming a rank
// outside the layout, or an expert that a member slot needs and that nothing can provide: no
// valid slot of a member holds it, no member holds a host copy and there is no loader ("expert
// E has no replica on a live rank and no backup (...)"; with usable and members both empty,
// nothing is lost and the message says the old placement has no slot of E).
LayerPlan plan_layer(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                     const Layout& layout, int64_t expert_bytes, const PlanSources& sources = {},
                     SourceChoice choice = SourceChoice::kSpreadServed);

}  // namespace eplb::migration
