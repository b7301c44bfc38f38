#pragma once
// sticky's Step 3 (sticky.cc): the incremental search on one layer. From the previous
// placement, repaired and filled, it lowers the most loaded rank one action at a time (swap,
// replicate, replace), each the cheapest in moved slots, until the rank is at most a cap.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "eplb/core/types.h"

namespace eplb::placement::sticky_search {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Step 3: the incremental search on one layer. Each expert may live only on the ranks of its
// node (`node_of_expert`, empty: anywhere).
class Incremental {
 public:
  // Step 3a happens here: the previous placement, repaired and filled.
  Incremental(std::span<const double> w, std::span<const int32_t> prev, const Layout& layout,
              std::span<const int32_t> node_of_expert);

  // Step 3b: lowers the top rank until it is at most `cap` (true) or no action helps, more than
  // `budget` slots have moved, or the round limit is spent (false). May be called again with a
  // larger budget; it goes on from where it stopped.
  bool run(double cap, int64_t budget);

  // Step 3a': before the search, each rank above `cap` (heaviest first) swaps slots with
  // ranks that stay at most the cap: the swap that brings it to the cap, the cheapest in moved
  // slots, then the smallest shift of load (for each of its slots, the partner is found by
  // share in a sorted list of all slots); where none does, the one that lowers it most; up to
  // one swap per slot of the rank. What is still above the cap is left to run(). Stops once
  // more than `budget` slots have moved. Far cheaper per swap than run()'s rounds, which weigh
  // every kind of action over every rank (at 7 slots per rank it leaves nothing to them).
  void settle(double cap, int64_t budget);

  std::span<const int32_t> slots() const { return cur_; }
  int64_t moved() const { return moved_; }

 private:
  int64_t rank_of(int64_t slot) const { return slot_rank_[slot]; }
  bool allowed(int32_t e, int64_t rank) const {
    return node_of_expert_.empty() || node_of_expert_[e] == rank / rpn_;
  }
  bool holds(int64_t rank, int32_t e) const { return holds_[rank * experts_ + e] != 0; }
  // Cost in moved slots of putting expert e into slot p in place of its current expert.
  int64_t cost(int64_t p, int32_t e) const {
    return static_cast<int64_t>(e != prev_[p]) - static_cast<int64_t>(cur_[p] != prev_[p]);
  }

  // Puts e (-1: nothing) into slot p, keeping holds_, count_, the holder lists and the moved
  // slots current.
  void set(int64_t p, int32_t e);

  // Load per replica of e now, with one more replica and with one fewer.
  void update_shares(int32_t e);

  // Keep every previous slot that follows the rules; give every expert without a slot one
  // (freeing redundant replicas when there are too few free slots); fill what is left with
  // extra replicas of the experts with the largest load per replica.
  void clear_and_fill();

  // A free slot for expert e: on an allowed rank without e, the rank whose filled slots carry
  // the least load (lowest slot on a tie); if none is free, the slot of the redundant replica
  // whose loss costs least.
  void place_missing(int32_t e);

  // The rank loads, and each slot's load with each rank's least and largest.
  void recompute_loads();

  void refresh_rank_shares(int64_t r);

  // Rank r's load summed again from its slots' shares (and its least and largest), after its
  // slots or their shares changed; its experts' give-up peaks go stale.
  void refresh_rank(int64_t r);

  // Lists e's give-up peaks for index_give_ups to refresh (once, however often it is marked).
  void mark_peaks_dirty(int32_t e);

  // After the counts of `experts` changed (their shares are current): their slots' shares and
  // the ranks holding them.
  void refresh_experts(std::initializer_list<int32_t> experts);

  // The most loaded rank (the lowest index on a tie), from the tree over the rank loads.
  int64_t top_rank() const { return rank_tree_[1].rank; }

  // The lightest rank load, for the bound on swaps.
  double min_load() const { return rank_tree_[1].least; }

  // Node i from its children.
  void join_rank_node(int64_t i);

  // The tree over the rank loads: all of it (recompute_loads), or rank r's path after its load
  // changed.
  void build_rank_tree();
  void update_rank_tree(int64_t r);

  // The largest load among the ranks holding e other than `rank` (-inf: none). e has at most
  // one replica per rank and few replicas, so walking its holders is cheap.
  double top_holder_except(int32_t e, int64_t rank) const;

  // On the first use in a round: for each slot b whose expert y has 2+ replicas, the largest
  // load of y's other holders once b gives y up (+inf when y has one replica); it does not
  // depend on the expert b takes instead. Kept between rounds: an action changes only the peaks
  // of the experts on the ranks whose loads it changed, and of the experts whose counts it
  // changed (refresh_rank, refresh_experts).
  // Also the moved slots where it stays below `limit`, ascending.
  void index_give_ups(double limit);

  // give_up_peak_ of the slots holding y.
  void refresh_give_up_peaks(int32_t y);

  // The slots of index_give_ups below its limit (in no particular order), listed on the first
  // use in a round.
  void list_give_ups();

  // On the first use in a round: the loads of the moved slots and of their ranks, side by side
  // for the scans that swap with every moved slot.
  void index_moved();

  // Whether slot a of rank g may swap with slot b: another rank, kept at most `cap`, and the
  // rules.
  bool swap_fits(int64_t g, int64_t a, int64_t b, double cap) const;

  // Swaps the experts of slots a and b (on different ranks), keeping the loads current.
  void apply_swap(int64_t a, int64_t b);

  // The best action found so far: least cost in moved slots, then lowest new peak (the
  // largest load among the ranks it changes), then first found.
  struct Action {
    double floor = 0;  // peaks at or below the cap are all as good
    int64_t cost = std::numeric_limits<int64_t>::max();
    double peak = kInf;
    int64_t a = -1, b = -1;  // swap: slots a <-> b; otherwise slot b takes `expert`
    int32_t expert = -1;
    bool beaten_by(int64_t c, double pk) const {
      return c < cost || (c == cost && std::max(pk, floor) < peak);
    }
    void take(int64_t c, double pk, int64_t slot_a, int64_t slot_b, int32_t e) {
      cost = c;
      peak = std::max(pk, floor);
      a = slot_a;
      b = slot_b;
      expert = e;
    }
  };

  // Swap slot a (on the top rank g) with slot b of another rank.
  // Most candidates fail on the loads alone, so those come first.
  void try_swap(int64_t g, double top, double limit, int64_t a, int64_t b, Action& best) const;
  void consider_swap(int64_t g, double peak, int64_t a, int64_t b, Action& best) const;

  // try_swap of slot a with every moved slot, in ascending order.
  void swap_with_moved(int64_t g, double top, double limit, int64_t a, Action& best);

  // Slot b of another rank gives up its expert y (count >= 2) for a replica of x = cur_[a].
  // Every holder of x gets lighter; the other holders of y get heavier.
  // Needs index_give_ups of this round.
  void try_replicate(int64_t g, double top, double limit, int64_t a, int64_t b, Action& best) const;

  // Pass 2's replicate of x = cur_[a] into any slot of list_give_ups: the least cost, then the
  // lowest peak, then the first in the order of (their rank's load, slot), lightest first.
  // That order was a walk over the ranks kept sorted by load, trying each slot and stopping
  // once no action of cost 1 could win; the walk went about 92 ranks deep per round at 256
  // ranks for about 14 candidates, and keeping the ranks sorted was a twelfth of the policy's
  // time. Weighing all of them takes the walk's action: where pass 2 runs, pass 1 has tried
  // every replicate of cost at most 0 (into x's previous slots and the moved give-up slots)
  // and none could win, so the walk stopped only at the first of cost 1 at the least peak,
  // which is the action weighed here.
  void replicate_anywhere(int64_t g, double top, double limit, int64_t a, Action& best);

  // Slot a of the top rank gives up x (count >= 2) for y.
  void try_replace(int64_t g, double top, double limit, int64_t a, int32_t y, Action& best) const;

  // Whether a adds less than b to a rank: a smaller load per replica after one more, or the
  // same and a lower index.
  bool lighter_addition(int32_t a, int32_t b) const {
    return share_up_[a] < share_up_[b] || (share_up_[a] == share_up_[b] && a < b);
  }

  // The expert that adds least to rank g: the smallest load per replica after one more.
  // Looked up first among the slots_per_rank + 1 lightest experts (kept until a change of
  // shares reaches them): a rank cannot hold them all, so only a node rule sends it to the full
  // scan.
  int32_t lightest_addition(int64_t g);

  // Swap slot a with every slot of the ranks that can take its expert, skipping the ranks where
  // even the least cost `min_cost` and the best split of the two loads cannot beat `best`.
  // Slots are visited in ascending order (ranks are runs of slots). When a is moved and
  // only a swap of cost <= 0 can still win, b must be moved too or hold a's previous expert
  // (a swap of moved a with unmoved b costs 1 otherwise), so only those are visited.
  void swap_with_all(int64_t g, double top, double limit, int64_t a, int64_t min_cost,
                     Action& best);

  // One action that lowers rank g below its load without lifting any other rank to it; see
  // Action for which. Candidates are visited by the least cost they can have, and a set is
  // skipped when even its least cost and lowest possible peak cannot beat the best so far:
  //   replicate x = cur_[a]: peak >= top - w_x/c_x + w_x/(c_x+1); cost -1 into a slot that held
  //     x before, 0 into a moved slot, 1 into any other redundant slot;
  //   swap: peak >= (top + lightest load) / 2; cost >= -1 + (a unmoved), and a swap of an
  //     unmoved a costs 2 unless b is moved or held x before.
  // With `ceiling`, the action must also keep every rank it changes below it (escape()).
  bool lower_top(int64_t g, double cap, double ceiling = kInf);

  // Where no one action lowers the top rank g: a replicate of one of g's experts x into a
  // redundant slot b that lowers g but lifts b's rank h to g's load or past it (the replicate
  // lowers every holder of x, so it is what a rank of heavy replicas needs), then one action
  // that brings h below g's old load (lower_top with that ceiling). Tried cheapest first, then
  // by the load h reaches, at most kEscapeTries of them, each undone when h cannot follow. On
  // the 256-rank preset the search got stuck on 2 of 58 layers, and the fallbacks there moved
  // twice the slots.
  bool escape(int64_t g, double cap);

  // Once the top rank is at most `cap`: moves that later actions made unneeded are undone while
  // every rank stays at most the cap. A moved slot takes its previous expert back (its current
  // expert keeping another replica), or trades experts with a slot of that previous expert
  // that moved too or held the current one before. Repeated until none applies.
  void trim(double cap);

  // The slots that held expert e in the previous placement.
  std::span<const int64_t> prev_slots_of(int32_t e) const {
    return {prev_slots_.data() + prev_start_[e],
            static_cast<size_t>(prev_start_[e + 1] - prev_start_[e])};
  }

  std::span<const double> w_;
  std::span<const int32_t> prev_;
  std::span<const int32_t> node_of_expert_;
  int32_t experts_;
  int64_t ranks_, spr_, rpn_;
  std::vector<int32_t> cur_;         // [physical]
  std::vector<int32_t> count_;       // [experts]
  std::vector<uint8_t> holds_;       // [ranks][experts]
  std::vector<double> load_;         // [ranks]
  // Over load_: node i of [1, ranks) joins nodes 2i and 2i + 1, rank r is node ranks + r, so
  // node 1 covers every rank. Each node holds the largest load of its ranks with its rank
  // (ties: the lowest index) and the least load, side by side: a node's two children are read
  // together, with no lookup of the ranks' loads.
  struct RankNode {
    double top = 0;
    double least = 0;
    int64_t rank = 0;
  };
  std::vector<RankNode> rank_tree_;  // [2 ranks]
  std::vector<int64_t> prev_start_;  // [experts + 1]: prev_slots_of(e) is
  std::vector<int64_t> prev_slots_;  // prev_slots_[prev_start_[e] .. prev_start_[e + 1])
  std::vector<double> share_, share_up_, share_down_;  // [experts]
  std::vector<int32_t> slot_rank_;                     // [physical]
  // [experts][ranks]: the slots holding e are holder_[e * ranks_ .. e * ranks_ + count_[e]).
  // Left uninitialised: only those first count_[e] entries are ever read, and clearing all of
  // it (256 KiB at 256 ranks) cost as much as a layer's search.
  std::unique_ptr<int32_t[]> holder_;
  std::vector<double> slot_share_;                       // [physical]: share_ of the slot's expert
  std::vector<double> rank_min_share_, rank_max_share_;  // [ranks]: least, largest slot_share_
  std::vector<int32_t> redundant_;                       // experts with 2+ replicas, ascending
  std::vector<int32_t> lightest_;  // the experts with the least share_up_, ascending
  bool lightest_stale_ = true;
  // Ascending; kept current by set() once the constructor has filled the slots.
  std::vector<int64_t> moved_slots_;  // slots whose expert differs from the previous one
  bool track_moved_ = false;
  // Per round (index_moved): [moved slots] side by side with moved_slots_.
  bool moved_indexed_ = false;
  std::vector<double> moved_share_, moved_rank_load_;
  // Scratch of the swap scans: moved slots (swap_with_moved) and ranks (swap_with_all) that
  // pass the loads and the rules.
  std::vector<int32_t> listed_, ranks_listed_;
  std::vector<int32_t> touched_ranks_;  // scratch of refresh_experts
  std::vector<uint8_t> rank_touched_;   // [ranks]: listed in touched_ranks_ (all 0 between uses)
  struct EscapeTry {
    int64_t cost;
    double load;  // of the one rank it lifts to the old top or past it
    int64_t b;    // slot b takes a replicate of x
    int32_t x;
  };
  std::vector<EscapeTry> escape_tries_;  // scratch of escape
  std::vector<int64_t> trim_slots_;      // scratch of trim
  std::vector<int32_t> trim_holders_;    // scratch of trim
  // index_give_ups: the peaks, current unless stale (every one) or their expert is listed in
  // peaks_dirty_ (each expert once: peaks_marked_ [experts]); the lists per round.
  bool peaks_stale_ = true;
  std::vector<int32_t> peaks_dirty_;
  std::vector<uint8_t> peaks_marked_;
  std::vector<double> give_up_peak_;     // [physical]
  bool give_ups_indexed_ = false;
  double give_up_limit_ = 0;
  std::vector<int64_t> moved_give_ups_;  // moved slots with give_up_peak_ below the limit
  std::vector<int64_t> give_ups_;        // list_give_ups's slots, this round's
  bool give_ups_listed_ = false;
  int64_t moved_ = 0;
  int64_t rounds_ = 0;
  int64_t escapes_ = 0;
  double stuck_cap_ = -1;  // the cap run() last found no action for (state unchanged since)
};

}  // namespace eplb::placement::sticky_search
