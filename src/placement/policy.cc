#include "eplb/placement/policy.h"

#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "eplb/core/error.h"
#include "placement/balanced.h"
#include "placement/deepseek.h"
#include "placement/sticky.h"

namespace eplb::placement {

Policy parse_policy(std::string_view name) {
  if (name == "deepseek") return Policy::kDeepseek;
  if (name == "balanced") return Policy::kBalanced;
  if (name == "sticky") return Policy::kSticky;
  fail("unknown policy '", name, "' (expected deepseek, balanced or sticky)");
}

std::string_view policy_name(Policy policy) {
  switch (policy) {
    case Policy::kDeepseek: return "deepseek";
    case Policy::kBalanced: return "balanced";
    case Policy::kSticky: return "sticky";
  }
  return "?";
}

namespace {

// A dense layer's previous slots made valid: each expert without a slot (it lived only on ranks
// that are gone) takes a slot of the expert with the most replicas, its lowest slot (lowest
// expert on a tie): the fewest slots any valid layer can move. The slots outnumber the experts,
// so that expert always has two replicas or more.
void give_every_expert_a_slot(std::span<int32_t> slots, int64_t experts) {
  std::vector<int64_t> count(static_cast<size_t>(experts), 0);
  for (const int32_t e : slots) ++count[e];
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e] > 0) continue;
    const int64_t most = std::max_element(count.begin(), count.end()) - count.begin();
    EPLB_CHECK_GE(count[most], 2, "no expert can give up a slot for expert ", e);
    *std::find(slots.begin(), slots.end(), static_cast<int32_t>(most)) = static_cast<int32_t>(e);
    --count[most];
    count[e] = 1;
  }
}

// A layer without load is a dense layer (metrics.h): any placement balances it, so it gets the
// one that costs nothing, the previous placement where one is given (no slot moves; balanced
// takes one too, if only for this), else the trivial one. deepseek is left as the reference
// computes it (identical outputs). On live ranks the previous placement may lack experts; they
// take the fewest slots that make the layer valid.
Placement place_dense_layers(const LoadMatrix& load, Placement placement,
                             const Placement* previous) {
  bool changed = false;
  for (int64_t l = 0; l < load.layers; ++l) {
    double total = 0;
    for (const double w : load.row(l)) total += w;
    if (total > 0) continue;
    const std::span<int32_t> slots = placement.layer_phy2log(l);
    for (int64_t p = 0; p < placement.physical; ++p) {
      slots[p] = previous != nullptr ? previous->layer_phy2log(l)[static_cast<size_t>(p)]
                                     : static_cast<int32_t>(p % placement.experts);
    }
    if (previous != nullptr) give_every_expert_a_slot(slots, placement.experts);
    changed = true;
  }
  if (changed) placement.derive_from_phy2log();
  return placement;
}

// The policy on a layout where every rank is live. `previous`, when given, has the layout's
// shape; every slot holds an expert, but on live ranks some experts may have none.
Placement place_on_all_ranks(const LoadMatrix& load, const Layout& layout,
                             const PolicyOptions& options, bool hierarchical,
                             const Placement* previous) {
  switch (options.policy) {
    case Policy::kDeepseek: return deepseek(load, layout);
    case Policy::kBalanced:
      if (options.cost) {
        return place_dense_layers(
            load, balanced_cost(load, layout, *options.cost, options.cost_steps), previous);
      }
      return place_dense_layers(load, balanced(load, layout, hierarchical, options.thorough),
                                previous);
    case Policy::kSticky:
      return place_dense_layers(
          load, sticky(load, layout, *previous, options.tolerance, hierarchical, options.thorough),
          previous);
  }
  fail("unknown policy");
}

// The live ranks as one compact layout (policy.h): the live ranks in order, their slots, and
// their nodes where those still form whole equal nodes.
struct LiveLayout {
  Layout compact;
  bool hierarchical = false;  // whether hierarchical placement still applies
};

LiveLayout live_layout(const Layout& layout, std::span<const int32_t> live, bool hierarchical) {
  const auto count = static_cast<int64_t>(live.size());
  LiveLayout out;
  out.compact = Layout{.experts = layout.experts,
                       .physical = count * layout.slots_per_rank(),
                       .ranks = count,
                       .nodes = 1,
                       .groups = layout.groups};
  std::vector<int64_t> per_node(static_cast<size_t>(layout.nodes), 0);
  for (const int32_t g : live) ++per_node[layout.node_of_rank(g)];
  int64_t nodes = 0, ranks_per_node = 0;
  bool even = true;
  for (const int64_t n : per_node) {
    if (n == 0) continue;
    ++nodes;
    even = even && (ranks_per_node == 0 || n == ranks_per_node);
    ranks_per_node = n;
  }
  if (even && layout.groups % nodes == 0) {
    out.compact.nodes = nodes;
    out.hierarchical = hierarchical;
  }
  return out;
}

// `live` (empty: every rank) ascending, unique, in range, and holding a slot for every expert.
void check_live_ranks(std::span<const int32_t> live, const Layout& layout) {
  if (live.empty()) return;
  for (size_t i = 0; i < live.size(); ++i) {
    if (live[i] < 0 || live[i] >= layout.ranks) {
      fail("live rank ", live[i], " is outside [0, ", layout.ranks, ") (the layout's ranks)");
    }
    if (i > 0 && live[i] <= live[i - 1]) {
      fail("live ranks must be ascending and unique: ", live[i], " follows ", live[i - 1]);
    }
  }
  const auto slots = static_cast<int64_t>(live.size()) * layout.slots_per_rank();
  if (slots < layout.experts) {
    fail("the ", live.size(), " live ranks hold ", slots, " slots per layer, fewer than the ",
         layout.experts, " experts: every expert needs a slot on a live rank");
  }
}

// Slot c of the compact layout is this slot of the full one.
int64_t full_slot(int64_t c, std::span<const int32_t> live, int64_t spr) {
  return live[c / spr] * spr + c % spr;
}

// The live ranks' slots of `previous`, in order; experts that lived only on the other ranks
// have no slot (replica_count 0, which derive_from_phy2log allows and validate would not).
Placement compact_previous(const Placement& previous, std::span<const int32_t> live,
                           int64_t spr) {
  const int64_t physical = static_cast<int64_t>(live.size()) * spr;
  Placement out(previous.layers, previous.experts, physical);
  for (int64_t l = 0; l < previous.layers; ++l) {
    const std::span<const int32_t> from = previous.layer_phy2log(l);
    const std::span<int32_t> to = out.layer_phy2log(l);
    for (int64_t c = 0; c < physical; ++c) to[c] = from[full_slot(c, live, spr)];
  }
  out.derive_from_phy2log();
  return out;
}

// The compact placement back on the full layout: the live slots from `placed`, the others as
// in `previous` (slot p mod experts without one). log2phy: each expert's live replicas in
// `placed`'s order, then its slots on the other ranks by slot.
Placement expand(const Placement& placed, const Layout& layout, std::span<const int32_t> live,
                 const Placement* previous) {
  const int64_t spr = layout.slots_per_rank();
  const int64_t E = layout.experts, P = layout.physical;
  Placement out(placed.layers, E, P);
  std::vector<uint8_t> is_live(static_cast<size_t>(layout.ranks), 0);
  for (const int32_t g : live) is_live[g] = 1;
  for (int64_t l = 0; l < placed.layers; ++l) {
    const std::span<int32_t> slots = out.layer_phy2log(l);
    for (int64_t p = 0; p < P; ++p) {
      if (is_live[layout.rank_of_slot(p)]) continue;
      slots[p] = previous != nullptr ? previous->layer_phy2log(l)[static_cast<size_t>(p)]
                                     : static_cast<int32_t>(p % E);
    }
    const std::span<const int32_t> compact = placed.layer_phy2log(l);
    for (int64_t c = 0; c < placed.physical; ++c) slots[full_slot(c, live, spr)] = compact[c];
    for (const int32_t e : slots) ++out.replica_count[l * E + e];
  }
  out.max_replicas = *std::max_element(out.replica_count.begin(), out.replica_count.end());
  out.log2phy.assign(static_cast<size_t>(placed.layers * E * out.max_replicas), -1);
  std::vector<int64_t> filled(static_cast<size_t>(E));
  for (int64_t l = 0; l < placed.layers; ++l) {
    std::fill(filled.begin(), filled.end(), 0);
    auto add = [&](int64_t e, int64_t slot) {
      out.log2phy[(l * E + e) * out.max_replicas + filled[e]++] = static_cast<int32_t>(slot);
    };
    for (int64_t e = 0; e < E; ++e) {
      for (const int32_t c : placed.replicas(l, e)) add(e, full_slot(c, live, spr));
    }
    const std::span<const int32_t> slots = out.layer_phy2log(l);
    for (int64_t p = 0; p < P; ++p) {
      if (!is_live[layout.rank_of_slot(p)]) add(slots[p], p);
    }
  }
  return out;
}

}  // namespace

Placement place(const LoadMatrix& load, const Layout& layout, const PolicyOptions& options) {
  layout.validate();
  load.validate();
  if (load.experts != layout.experts) {
    fail("the load has ", load.experts, " experts per layer but the layout has ", layout.experts);
  }
  if (!(options.tolerance >= 0 && options.tolerance < 1)) {
    fail("tolerance ", options.tolerance, " must be in [0, 1) (a loss of balancedness)");
  }
  // Only the previous phy2log is read (sticky, dense layers, lost ranks' slots), so only that
  // is checked: the whole validate() was a fifth of sticky's time at 448 slots per layer.
  if (options.previous != nullptr) check_previous(*options.previous, load, layout);
  if (options.thorough && options.policy == Policy::kDeepseek) {
    fail("thorough applies to the balanced and sticky policies, not deepseek (whose replica "
         "counts are the reference's own)");
  }
  if (options.policy == Policy::kSticky && options.previous == nullptr) {
    fail("policy sticky needs the previous placement (--previous FILE)");
  }
  if (options.cost) {
    if (options.policy != Policy::kBalanced) {
      fail("a cost model places with the balanced policy only, not ",
           policy_name(options.policy));
    }
    if (options.hierarchical || options.thorough) {
      fail("placement under a cost model is neither hierarchical nor thorough (drop ",
           options.hierarchical ? "hierarchical" : "thorough", ")");
    }
    options.cost->validate();
    if (options.cost_steps < 1) {
      fail("cost_steps ", options.cost_steps, " must be at least 1 (the steps the loads sum)");
    }
  }
  const std::span<const int32_t> live = options.live_ranks;
  check_live_ranks(live, layout);
  if (live.empty() || static_cast<int64_t>(live.size()) == layout.ranks) {
    return place_on_all_ranks(load, layout, options, options.hierarchical, options.previous);
  }

  // Step 1: the request as it stands must be valid on the full layout (the same errors as with
  // every rank live); then the compact layout of the live ranks and their previous slots.
  if (options.policy != Policy::kDeepseek) {
    check_balanced_inputs(load, layout, options.hierarchical);
  }
  const LiveLayout compact = live_layout(layout, live, options.hierarchical);
  std::optional<Placement> previous;
  if (options.previous != nullptr) {
    previous = compact_previous(*options.previous, live, layout.slots_per_rank());
  }
  // Step 2: the policy on the live ranks, then back to the full layout.
  const Placement placed =
      place_on_all_ranks(load, compact.compact, options, compact.hierarchical,
                         previous ? &*previous : nullptr);
  return expand(placed, layout, live, options.previous);
}

}  // namespace eplb::placement
