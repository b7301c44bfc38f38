// Placement: sticky. Per layer:
//   Step 1: the target. balanced's placement of the same load has balancedness b; any
//           placement whose largest rank load is at most cap = mean rank load / (b - tolerance)
//           is good enough (the mean does not depend on the placement).
//   Step 2: the fallback: balanced's placement relabelled onto the previous one: its ranks
//           matched to the previous ranks so that most experts stay on their rank (Hungarian
//           assignment up to 32 ranks, greedy by overlap past that; nodes first when
//           hierarchical), and each expert that stays keeps its old slot (relabel.h).
//   Step 3: incremental (sticky_search.h): start from the previous placement, clear the slots
//           that break the rules (a second replica on a rank; in hierarchical mode an expert on
//           another node than its group's), fill them, then lower the most loaded rank with
//           the cheapest action (in moved slots) until it is at most the cap:
//             swap        two slots of different ranks trade experts
//             replicate   a slot elsewhere takes a second replica of an expert of the top rank
//             replace     a slot of the top rank gives up a redundant replica for another
//                         expert
//           Where no single action lowers the top, one escape per search: a redundant slot
//           takes a replica of an expert of the top rank, and the search goes on from there
//           (undone when the top cannot follow). Once the top is at most the cap, moved slots
//           given their old expert back (or traded with its holder) are undone while the cap
//           still holds (Incremental::trim).
//           In hierarchical mode, groups keep the node that holds most of their slots (or
//           balanced's nodes, relabelled, when that assignment cannot reach the cap).
//   Step 4: keep the candidate that reaches the target with the fewest moved slots. Step 3 runs
//           first with a small budget (1/8 of the slots). When that fails and the layout is
//           not hierarchical, Step 3 goes on to 1/4 of the slots (kept as it is if it reaches
//           the target there: at two slots per rank it then moved fewer than Step 2b on every
//           layer of the presets' loads), then Step 2b, and the best of them within 1/4 is kept
//           as it is. Only then are Step 2 and the rest of Step 3 (budget: the best candidate's
//           moves) run.
//   Step 2b, with two slots per rank: the previous pairs moved to balanced's counts
//           (two_slots::repair), a second fallback that usually keeps far more.
//   Step 0, with 3+ slots per rank: Step 3 first against the lower bound's target (at least
//           balanced's), starting with one swap per rank above the cap (Incremental::settle);
//           when that is reached within 1/6 of the slots, balanced is not computed.
// The tolerance is per layer: every layer's balancedness is at least balanced's minus it, so
// the mean over layers and the step-weighted figure are too.

#include "placement/sticky.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "placement/balanced.h"
#include "eplb/placement/metrics.h"
#include "placement/relabel.h"
#include "placement/sticky_search.h"
#include "placement/two_slots.h"

namespace eplb::placement {
namespace {

using sticky_search::Incremental;
using sticky_search::kInf;

// An incremental result moving at most 1/kFewMoved of the slots is kept without computing the
// relabelled fallback: a fresh packing relabelled keeps far fewer slots than that.
constexpr int64_t kFewMoved = 8;
// Step 0's budget: its target is at least balanced's, so what it reaches within 1/kFewMovedBound
// of the slots is kept as it is (lognormal(0, 0.2) drift needs 7-13% at 7-13 slots per rank).
constexpr int64_t kFewMovedBound = 6;
// Once balanced's target is known, a candidate moving at most 1/kFewMovedFresh of the slots is
// kept without the relabelled fallback: relabelling moves most slots (80% at 64 ranks on
// lognormal loads), and computing it was a third of the policy's time past 32 ranks.
constexpr int64_t kFewMovedFresh = 4;

int64_t count_moved(std::span<const int32_t> before, std::span<const int32_t> after) {
  int64_t moved = 0;
  for (size_t p = 0; p < before.size(); ++p) moved += before[p] != after[p];
  return moved;
}

// Hierarchical: the node of each group, groups/N per node, giving each group the node that
// holds most of its slots in `slots` (greedy over (group, node) pairs by overlap, ties by
// index). [groups]
std::vector<int64_t> groups_to_nodes(std::span<const int32_t> slots, const Layout& layout) {
  const int64_t per_group = layout.experts / layout.groups;
  std::vector<int64_t> overlap(static_cast<size_t>(layout.groups * layout.nodes), 0);
  for (size_t p = 0; p < slots.size(); ++p) {
    ++overlap[(slots[p] / per_group) * layout.nodes + layout.node_of_slot(p)];
  }
  std::vector<int64_t> pairs(overlap.size());
  std::iota(pairs.begin(), pairs.end(), 0);
  std::stable_sort(pairs.begin(), pairs.end(),
                   [&](int64_t a, int64_t b) { return overlap[a] > overlap[b]; });
  std::vector<int64_t> node(static_cast<size_t>(layout.groups), -1);
  std::vector<int64_t> taken(static_cast<size_t>(layout.nodes), 0);
  const int64_t per_node = layout.groups / layout.nodes;
  for (const int64_t pair : pairs) {
    const int64_t k = pair / layout.nodes, n = pair % layout.nodes;
    if (node[k] < 0 && taken[n] < per_node) {
      node[k] = n;
      ++taken[n];
    }
  }
  return node;
}

// [experts]: the node of each expert's group.
std::vector<int32_t> expert_nodes(std::span<const int64_t> group_node, const Layout& layout) {
  const int64_t per_group = layout.experts / layout.groups;
  std::vector<int32_t> out(static_cast<size_t>(layout.experts));
  for (int64_t e = 0; e < layout.experts; ++e) {
    out[e] = static_cast<int32_t>(group_node[e / per_group]);
  }
  return out;
}

// Whether the nodes' loads let the top rank reach `cap` at all.
bool nodes_can_reach(std::span<const double> w, std::span<const int32_t> node_of_expert,
                     const Layout& layout, double cap) {
  std::vector<double> node_load(static_cast<size_t>(layout.nodes), 0.0);
  for (int64_t e = 0; e < layout.experts; ++e) node_load[node_of_expert[e]] += w[e];
  for (const double l : node_load) {
    if (l / static_cast<double>(layout.ranks_per_node()) > cap) return false;
  }
  return true;
}

// One slot per rank, every expert allowed anywhere: a rank's load is its one replica's, so a
// placement reaches `cap` exactly when every expert e has at least need_e replicas, the fewest
// with w_e / need_e <= cap. Every expert keeps min(need_e, its previous slots); the slots left
// over go to experts that held more before (each keeps one more of its slots), largest load
// per replica first; the experts short of their count take the freed slots. No placement that
// reaches the cap moves fewer: each expert short of need_e must gain the difference. Empty when
// the needs exceed the slots (never when the cap is at least balanced's largest rank).
std::vector<int32_t> one_slot(std::span<const double> w, std::span<const int32_t> prev,
                              double cap) {
  const int64_t experts = static_cast<int64_t>(w.size());
  const int64_t slots = static_cast<int64_t>(prev.size());
  std::vector<int32_t> had(w.size(), 0);
  for (const int32_t e : prev) ++had[e];
  std::vector<int32_t> count(w.size(), 1);
  int64_t used = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t c = 1;
    if (w[e] > cap) {
      c = static_cast<int64_t>(std::min(std::ceil(w[e] / cap), static_cast<double>(slots)));
      while (c < slots && w[e] / static_cast<double>(c) > cap) ++c;
      while (c > 1 && w[e] / static_cast<double>(c - 1) <= cap) --c;
    }
    count[e] = static_cast<int32_t>(c);
    used += c;
  }
  if (used > slots) return {};
  // The slots left over: the counts of all experts and of those that held more sum to at
  // least the slots, so experts that held more can always take them.
  std::vector<std::pair<double, int32_t>> heap;  // (load per replica, -expert)
  for (int32_t e = 0; e < experts; ++e) {
    if (had[e] > count[e]) heap.emplace_back(w[e] / count[e], -e);
  }
  std::make_heap(heap.begin(), heap.end());
  for (int64_t left = slots - used; left > 0; --left) {
    EPLB_CHECK(!heap.empty(), "one slot per rank: no expert can keep another slot");
    std::pop_heap(heap.begin(), heap.end());
    const int32_t e = -heap.back().second;
    heap.pop_back();
    if (++count[e] < had[e]) {
      heap.emplace_back(w[e] / count[e], -e);
      std::push_heap(heap.begin(), heap.end());
    }
  }
  // Each expert keeps its first count[e] previous slots; the others take the rest, in order.
  std::vector<int32_t> out(prev.size(), -1);
  std::vector<int32_t> placed(w.size(), 0);
  for (int64_t p = 0; p < slots; ++p) {
    const int32_t e = prev[p];
    if (placed[e] < count[e]) {
      out[p] = e;
      ++placed[e];
    }
  }
  int32_t next = 0;
  for (int64_t p = 0; p < slots; ++p) {
    if (out[p] >= 0) continue;
    while (placed[next] >= count[next]) ++next;
    out[p] = next;
    ++placed[next];
  }
  return out;
}

struct Candidate {
  std::vector<int32_t> slots;
  int64_t moved = 0;
};

// Steps 1-4 for one layer. `fresh` computes balanced's placement of the layer when needed.
std::vector<int32_t> place_layer(std::span<const double> w, std::span<const int32_t> prev,
                                 const std::function<std::vector<int32_t>()>& fresh_of,
                                 const Layout& layout, double tolerance, bool hierarchical) {
  double total = 0;
  for (const double v : w) total += v;
  const double mean = total / static_cast<double>(layout.ranks);
  auto cap_for = [&](double target) { return target > 0 ? mean / target : kInf; };
  const int64_t slots = static_cast<int64_t>(prev.size());
  // Step 0, past two slots per rank (where the bound is cheap and balanced within 0.1% of it):
  // the target from the lower bound instead, which is at least balanced's; reaching it with a
  // small budget needs no fresh placement at all.
  std::optional<Incremental> search;
  if (layout.slots_per_rank() > 2 && !hierarchical && total > 0) {
    const double bound_target = mean / layer_lower_bound(w, layout) - tolerance;
    search.emplace(w, prev, layout, std::span<const int32_t>{});
    search->settle(cap_for(bound_target), slots / kFewMovedBound);
    if (search->run(cap_for(bound_target), slots / kFewMovedBound) &&
        layer_balancedness(w, search->slots(), layout) >= bound_target) {
      return {search->slots().begin(), search->slots().end()};
    }
    // Not met: Step 3 goes on from where this search stopped, against balanced's target (at
    // most the bound's: its cap is at least this one). Starting again from the previous
    // placement repeated the same actions, and was a third of the policy's time.
  }
  // Step 1.
  const std::vector<int32_t> fresh = fresh_of();
  const double target = layer_balancedness(w, fresh, layout) - tolerance;
  const double cap = cap_for(target);
  auto good = [&](std::span<const int32_t> placed) {
    return layer_balancedness(w, placed, layout) >= target;
  };
  // One slot per rank, every expert anywhere: the fewest moves, exactly.
  if (layout.slots_per_rank() == 1 && !hierarchical) {
    std::vector<int32_t> placed = one_slot(w, prev, cap);
    if (!placed.empty() && good(placed)) return placed;
  }

  // Step 3, groups on the nodes that hold most of their slots now; a small budget first.
  const std::vector<int32_t> kept_nodes =
      hierarchical ? expert_nodes(groups_to_nodes(prev, layout), layout) : std::vector<int32_t>{};
  const bool reachable = !hierarchical || nodes_can_reach(w, kept_nodes, layout, cap);
  if (reachable) {
    if (!search) search.emplace(w, prev, layout, kept_nodes);
    if (search->run(cap, slots / kFewMoved) && good(search->slots())) {
      return {search->slots().begin(), search->slots().end()};
    }
  }

  Candidate best{{}, slots + 1};  // none yet
  auto consider = [&](Incremental& s, int64_t budget) {
    if (s.run(cap, std::min(budget, best.moved - 1)) && s.moved() < best.moved && good(s.slots())) {
      best = {std::vector<int32_t>(s.slots().begin(), s.slots().end()), s.moved()};
    }
  };
  // Step 3 goes on, first within kFewMovedFresh: what it reaches there is kept.
  if (search && !hierarchical) {
    consider(*search, slots / kFewMovedFresh);
    if (best.moved <= slots / kFewMovedFresh) return best.slots;
  }
  // Two slots per rank, where Step 3 does not reach the target within kFewMovedFresh: the
  // previous pairs moved to balanced's counts (two_slots.h), which keeps far more than
  // relabelling balanced's pairs. Where Step 3 does reach it there, it moved fewer than this on
  // every layer of the presets' loads (at 144 ranks it never reaches it, at 256 on 47 of the 48
  // layers that come here), so this runs only after it: it was a fifth of the policy's time at
  // 256 ranks.
  if (layout.slots_per_rank() == 2 && !hierarchical) {
    std::vector<int32_t> counts(static_cast<size_t>(layout.experts), 0);
    for (const int32_t e : fresh) ++counts[e];
    std::vector<int32_t> repaired(prev.size());
    if (two_slots::repair(w, prev, counts, layout.ranks, cap, repaired) && good(repaired)) {
      const int64_t moved = count_moved(prev, repaired);
      if (moved < best.moved) best = {std::move(repaired), moved};
    }
    if (best.moved <= slots / kFewMovedFresh) return best.slots;
  }
  // Step 2. It has balanced's balancedness (its ranks are balanced's, relabelled), so it is
  // taken when nothing cheaper reaches the target.
  std::vector<int32_t> relabelled = relabel(fresh, prev, layout, hierarchical);
  const std::vector<int32_t> fresh_nodes =
      hierarchical ? expert_nodes(groups_to_nodes(relabelled, layout), layout)
                   : std::vector<int32_t>{};
  const int64_t relabelled_moved = count_moved(prev, relabelled);
  if (relabelled_moved < best.moved) best = {std::move(relabelled), relabelled_moved};
  // Step 3 goes on with the budget the fallback leaves.
  if (search) consider(*search, slots);
  // In hierarchical mode, also with the groups on balanced's nodes (relabelled).
  if (hierarchical) {
    if (fresh_nodes != kept_nodes && nodes_can_reach(w, fresh_nodes, layout, cap)) {
      Incremental again(w, prev, layout, fresh_nodes);
      consider(again, slots);
    }
  }
  // Step 4.
  return best.slots;
}

}  // namespace

void check_previous(const Placement& previous, const LoadMatrix& load, const Layout& layout) {
  if (previous.layers != load.layers || previous.experts != layout.experts ||
      previous.physical != layout.physical) {
    fail("the previous placement has ", previous.layers, " layers, ", previous.experts,
         " experts, ", previous.physical, " physical slots; the new one needs ", load.layers, ", ",
         layout.experts, ", ", layout.physical);
  }
  if (previous.phy2log.size() != static_cast<size_t>(previous.layers * previous.physical)) {
    fail("the previous placement's phy2log holds ", previous.phy2log.size(), " entries, expected ",
         previous.layers, " x ", previous.physical);
  }
  for (size_t i = 0; i < previous.phy2log.size(); ++i) {
    if (previous.phy2log[i] < 0 || previous.phy2log[i] >= previous.experts) {
      fail("the previous placement's slot ", static_cast<int64_t>(i) % previous.physical,
           " of layer ", static_cast<int64_t>(i) / previous.physical, " holds expert ",
           previous.phy2log[i], ", outside [0, ", previous.experts, ")");
    }
  }
}

Placement sticky(const LoadMatrix& load, const Layout& layout, const Placement& previous,
                 double tolerance, bool hierarchical, bool thorough) {
  if (!(tolerance >= 0 && tolerance < 1)) {
    fail("tolerance ", tolerance, " must be in [0, 1) (a loss of balancedness)");
  }
  check_previous(previous, load, layout);
  check_balanced_inputs(load, layout, hierarchical);
  Placement out(load.layers, layout.experts, layout.physical);
  for (int64_t l = 0; l < load.layers; ++l) {
    // balanced's placement of this one layer, only when Step 0 does not suffice.
    auto fresh_of = [&] { return balanced_layer(load.row(l), layout, hierarchical, thorough); };
    const std::vector<int32_t> slots = place_layer(load.row(l), previous.layer_phy2log(l), fresh_of,
                                                   layout, tolerance, hierarchical);
    std::copy(slots.begin(), slots.end(), out.layer_phy2log(l).begin());
  }
  out.derive_from_phy2log();
  return out;
}

}  // namespace eplb::placement
