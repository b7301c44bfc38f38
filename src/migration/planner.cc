#include "eplb/migration/planner.h"

#include <algorithm>
#include <limits>

#include "eplb/core/error.h"

namespace eplb::migration {

std::string_view action_name(Action action) {
  switch (action) {
    case Action::kUnchanged: return "unchanged";
    case Action::kLocalCopy: return "local_copy";
    case Action::kFreeRide: return "free_ride";
    case Action::kReadSameNode: return "read_same_node";
    case Action::kReadOtherNode: return "read_other_node";
  }
  return "unknown";
}

namespace {

void check_inputs(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                  const Layout& layout, int64_t expert_bytes) {
  if (expert_bytes <= 0) fail("expert bytes ", expert_bytes, " must be at least 1");
  if (layout.ranks <= 0) fail("ranks ", layout.ranks, " must be at least 1");
  if (layout.nodes <= 0) fail("nodes ", layout.nodes, " must be at least 1");
  if (layout.physical <= 0) fail("physical ", layout.physical, " must be at least 1");
  // The plan's byte counts are at most every slot moved: bounded so, none can overflow.
  if (expert_bytes > std::numeric_limits<int64_t>::max() / layout.physical) {
    fail("expert bytes ", expert_bytes, " x ", layout.physical,
         " slots does not fit a 64-bit byte count (at most ",
         std::numeric_limits<int64_t>::max() / layout.physical, " bytes per expert)");
  }
  if (layout.physical % layout.ranks != 0) {
    fail("physical ", layout.physical, " is not a multiple of ranks ", layout.ranks,
         " (every rank holds the same number of slots)");
  }
  if (layout.ranks % layout.nodes != 0) {
    fail("ranks ", layout.ranks, " is not a multiple of nodes ", layout.nodes,
         " (every node holds the same number of ranks)");
  }
  if (static_cast<int64_t>(old_phy2log.size()) != layout.physical ||
      static_cast<int64_t>(new_phy2log.size()) != layout.physical) {
    fail("old placement has ", old_phy2log.size(), " slots and new placement ", new_phy2log.size(),
         ", expected physical ", layout.physical, " for both");
  }
  for (int64_t p = 0; p < layout.physical; ++p) {
    if (old_phy2log[p] < 0) fail("old placement: slot ", p, " holds expert ", old_phy2log[p]);
    if (new_phy2log[p] < 0) fail("new placement: slot ", p, " holds expert ", new_phy2log[p]);
  }
}

// The old holders of every expert, in slot order: holders[begin[e], begin[e + 1]).
struct Holders {
  std::vector<int32_t> begin;  // [experts + 1]
  std::vector<int32_t> slots;  // [physical]

  std::span<const int32_t> of(int32_t expert) const {
    if (expert + 1 >= static_cast<int32_t>(begin.size())) return {};
    return {slots.data() + begin[expert], static_cast<size_t>(begin[expert + 1] - begin[expert])};
  }
};

Holders index_holders(std::span<const int32_t> phy2log, int32_t experts) {
  Holders h;
  h.begin.assign(static_cast<size_t>(experts) + 1, 0);
  for (const int32_t e : phy2log) ++h.begin[e + 1];
  for (int32_t e = 0; e < experts; ++e) h.begin[e + 1] += h.begin[e];
  h.slots.resize(phy2log.size());
  std::vector<int32_t> fill(h.begin.begin(), h.begin.end() - 1);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    h.slots[fill[phy2log[p]]++] = static_cast<int32_t>(p);
  }
  return h;
}

// A slot that must be read from a peer, before a holder is chosen.
struct Demand {
  int32_t dst_slot;
  int32_t expert;
  int32_t candidates;  // distinct candidate holder ranks
};

}  // namespace

LayerPlan plan_layer(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                     const Layout& layout, int64_t expert_bytes) {
  check_inputs(old_phy2log, new_phy2log, layout, expert_bytes);
  const int64_t physical = layout.physical;
  const int64_t ranks = layout.ranks;
  const int64_t per_rank = layout.slots_per_rank();
  int32_t experts = 0;
  for (int64_t p = 0; p < physical; ++p) {
    experts = std::max({experts, old_phy2log[p] + 1, new_phy2log[p] + 1});
  }

  LayerPlan plan;
  plan.actions.resize(static_cast<size_t>(physical));
  plan.rank_bytes_in.assign(static_cast<size_t>(ranks), 0);
  plan.rank_bytes_out.assign(static_cast<size_t>(ranks), 0);

  // Step 1: the old holders of every expert, by slot (hence by rank).
  const Holders holders = index_holders(old_phy2log, experts);
  std::vector<int32_t> slot_rank(static_cast<size_t>(physical));  // [physical]
  std::vector<int32_t> rank_node(static_cast<size_t>(ranks));     // [ranks]
  for (int64_t p = 0, g = 0; g < ranks; ++g) {
    for (int64_t i = 0; i < per_rank; ++i) slot_rank[p++] = static_cast<int32_t>(g);
  }
  for (int64_t g = 0; g < ranks; ++g) rank_node[g] = static_cast<int32_t>(layout.node_of_rank(g));
  auto rank_of = [&](int32_t slot) { return slot_rank[slot]; };

  // Step 2: the same-rank actions, in slot order. `first_read[e]` is the first slot of the
  // current rank that reads e, valid when `first_read_rank[e]` is that rank.
  std::vector<int32_t> first_read(static_cast<size_t>(experts), -1);
  std::vector<int32_t> first_read_rank(static_cast<size_t>(experts), -1);
  std::vector<Demand> demands;
  for (int32_t g = 0; g < ranks; ++g) {
    for (int64_t p = g * per_rank; p < (g + 1) * per_rank; ++p) {
      const int32_t e = new_phy2log[p];
      SlotAction& a = plan.actions[p];
      a.expert = e;
      a.src_rank = g;
      if (old_phy2log[p] == e) {
        a.action = Action::kUnchanged;
        a.src_slot = static_cast<int32_t>(p);
        continue;
      }
      const std::span<const int32_t> held = holders.of(e);
      if (held.empty()) {
        fail("expert ", e, " (new slot ", p,
             ") is in no slot of the old placement: there is "
             "nothing to read it from");
      }
      const auto local = std::lower_bound(held.begin(), held.end(), g * per_rank);
      if (local != held.end() && rank_of(*local) == g) {
        a.action = Action::kLocalCopy;
        a.src_slot = *local;
        continue;
      }
      if (first_read_rank[e] == g) {
        a.action = Action::kFreeRide;
        a.src_slot = first_read[e];
        continue;
      }
      first_read_rank[e] = g;
      first_read[e] = static_cast<int32_t>(p);
      // Candidates: the holder ranks on g's node if any, else all of them.
      const int32_t node = rank_node[g];
      int32_t same_node = 0, all = 0, last = -1;
      for (const int32_t s : held) {
        const int32_t r = rank_of(s);
        if (r == last) continue;
        last = r;
        ++all;
        if (rank_node[r] == node) ++same_node;
      }
      a.action = same_node > 0 ? Action::kReadSameNode : Action::kReadOtherNode;
      demands.push_back({static_cast<int32_t>(p), e, same_node > 0 ? same_node : all});
    }
  }

  // Step 3: holders for the reads. The most constrained demands go first, each to the
  // candidate rank that has served the fewest reads so far (ties: lowest rank, lowest slot).
  std::vector<Demand> ordered(demands.size());
  {
    std::vector<int32_t> start(static_cast<size_t>(ranks) + 1, 0);  // counting sort, stable
    for (const Demand& d : demands) ++start[d.candidates];
    for (int64_t c = 0, sum = 0; c <= ranks; ++c) {
      const int32_t n = start[c];
      start[c] = static_cast<int32_t>(sum);
      sum += n;
    }
    for (const Demand& d : demands) ordered[start[d.candidates]++] = d;
  }
  std::vector<int64_t> served(static_cast<size_t>(ranks), 0);
  for (const Demand& d : ordered) {
    SlotAction& a = plan.actions[d.dst_slot];
    const int32_t node = rank_node[rank_of(d.dst_slot)];
    const bool same_node_only = a.action == Action::kReadSameNode;
    int32_t best_slot = -1, best_rank = -1;
    for (const int32_t s : holders.of(d.expert)) {
      const int32_t r = rank_of(s);
      if (same_node_only && rank_node[r] != node) continue;
      if (best_rank < 0 || served[r] < served[best_rank]) {
        best_rank = r;
        best_slot = s;
      }
    }
    ++served[best_rank];
    a.src_rank = best_rank;
    a.src_slot = best_slot;
  }

  // Step 4: the reads in destination order, and the byte accounting.
  std::vector<int64_t> staged(static_cast<size_t>(ranks), 0);
  plan.reads.reserve(demands.size());
  for (int64_t p = 0; p < physical; ++p) {
    const SlotAction& a = plan.actions[p];
    const int32_t g = rank_of(static_cast<int32_t>(p));
    ++plan.slots[static_cast<size_t>(a.action)];
    if (is_staged(a.action)) ++staged[g];
    if (a.action == Action::kLocalCopy || a.action == Action::kFreeRide) {
      plan.bytes_local_copy += expert_bytes;
    }
    if (!is_remote(a.action)) continue;
    plan.reads.push_back({a.src_rank, a.src_slot, g, static_cast<int32_t>(p), a.expert});
    plan.rank_bytes_in[g] += expert_bytes;
    plan.rank_bytes_out[a.src_rank] += expert_bytes;
    plan.bytes_total += expert_bytes;
    (a.action == Action::kReadSameNode ? plan.bytes_intra_node : plan.bytes_inter_node) +=
        expert_bytes;
  }
  plan.max_rank_bytes_in = *std::max_element(plan.rank_bytes_in.begin(), plan.rank_bytes_in.end());
  plan.max_rank_bytes_out =
      *std::max_element(plan.rank_bytes_out.begin(), plan.rank_bytes_out.end());
  plan.staging_slots = *std::max_element(staged.begin(), staged.end());
  return plan;
}

}  // namespace eplb::migration
