#include "eplb/migration/planner.h"

#include <algorithm>
#include <limits>
#include <ranges>

#include "eplb/core/error.h"

namespace eplb::migration {

std::string_view action_name(Action action) {
  switch (action) {
    case Action::kUnchanged: return "unchanged";
    case Action::kLocalCopy: return "local_copy";
    case Action::kFreeRide: return "free_ride";
    case Action::kReadSameNode: return "read_same_node";
    case Action::kReadOtherNode: return "read_other_node";
    case Action::kRestore: return "restore";
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

void check_sources(const PlanSources& sources, const Layout& layout) {
  if (!sources.usable.empty() && static_cast<int64_t>(sources.usable.size()) != layout.physical) {
    fail("usable has ", sources.usable.size(), " slots, expected physical ", layout.physical,
         " (one per slot of the layer, or none: all valid)");
  }
  if (!sources.members.empty() && static_cast<int64_t>(sources.members.size()) != layout.ranks) {
    fail("members has ", sources.members.size(), " ranks, expected ranks ", layout.ranks,
         " (one per rank, or none: all take part)");
  }
  for (size_t e = 0; e < sources.backup_holders.size(); ++e) {
    for (const int32_t g : sources.backup_holders[e]) {
      if (g < 0 || g >= layout.ranks) {
        fail("backup holders of expert ", e, ": rank ", g, " is outside ranks [0, ",
             layout.ranks, ")");
      }
    }
  }
}

// A list per expert, flattened: items[begin[e], begin[e + 1]).
struct PerExpert {
  std::vector<int32_t> begin;  // [experts + 1]
  std::vector<int32_t> items;

  std::span<const int32_t> of(int32_t expert) const {
    if (expert + 1 >= static_cast<int32_t>(begin.size())) return {};
    return {items.data() + begin[expert], static_cast<size_t>(begin[expert + 1] - begin[expert])};
  }
};

// The valid old holders of every expert, in slot order (hence by rank). `valid`: [physical].
PerExpert index_holders(std::span<const int32_t> phy2log, std::span<const uint8_t> valid,
                        int32_t experts) {
  PerExpert h;
  h.begin.assign(static_cast<size_t>(experts) + 1, 0);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    if (valid[p]) ++h.begin[phy2log[p] + 1];
  }
  for (int32_t e = 0; e < experts; ++e) h.begin[e + 1] += h.begin[e];
  h.items.resize(static_cast<size_t>(h.begin.back()));
  std::vector<int32_t> fill(h.begin.begin(), h.begin.end() - 1);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    if (valid[p]) h.items[fill[phy2log[p]]++] = static_cast<int32_t>(p);
  }
  return h;
}

// The member ranks that hold a host copy of every expert, ascending and distinct.
PerExpert index_backups(std::span<const std::vector<int32_t>> holders,
                        std::span<const uint8_t> member, int32_t experts) {
  PerExpert b;
  b.begin.assign(static_cast<size_t>(experts) + 1, 0);
  for (int32_t e = 0; e < experts; ++e) {
    const size_t first = b.items.size();
    if (static_cast<size_t>(e) < holders.size()) {
      for (const int32_t g : holders[e]) {
        if (member[g]) b.items.push_back(g);
      }
    }
    std::sort(b.items.begin() + first, b.items.end());
    b.items.erase(std::unique(b.items.begin() + first, b.items.end()), b.items.end());
    b.begin[e + 1] = static_cast<int32_t>(b.items.size());
  }
  return b;
}

// A slot that must fetch its expert from another rank (a read, or a restore from a peer's host
// copy), before the source is chosen.
struct Demand {
  int32_t dst_slot;
  int32_t expert;
  int32_t candidates;  // distinct candidate source ranks
  bool same_node;      // the candidates are the sources on the destination's node
};

// The indices of the demands, fewest candidates first, in their order otherwise (a stable
// counting sort).
std::vector<int32_t> most_constrained_first(const std::vector<Demand>& demands, int64_t ranks) {
  std::vector<int32_t> ordered(demands.size());
  std::vector<int32_t> start(static_cast<size_t>(ranks) + 1, 0);
  for (const Demand& d : demands) ++start[d.candidates];
  for (int64_t c = 0, sum = 0; c <= ranks; ++c) {
    const int32_t n = start[c];
    start[c] = static_cast<int32_t>(sum);
    sum += n;
  }
  for (size_t i = 0; i < demands.size(); ++i) {
    ordered[start[demands[i].candidates]++] = static_cast<int32_t>(i);
  }
  return ordered;
}

// A read's source: a rank and its slot that holds the expert.
struct Source {
  int32_t rank = -1;
  int32_t slot = -1;
};

// SourceChoice::kLowestPeakDegree: a holder for every read demand such that the most reads one
// rank takes part in (in plus out) is as low as it can be (planner.h). `holders`: the valid
// old holders of every expert by slot, hence by rank.
std::vector<Source> lowest_peak_sources(const std::vector<Demand>& demands,
                                        const PerExpert& holders,
                                        std::span<const int32_t> slot_rank,
                                        std::span<const int32_t> rank_node, int64_t ranks) {
  const size_t n = demands.size();
  std::vector<int64_t> load(static_cast<size_t>(ranks), 0);  // [ranks] reads in + out
  for (const Demand& d : demands) ++load[slot_rank[d.dst_slot]];
  auto slot_of = [&](int32_t expert, int32_t rank) {
    for (const int32_t s : holders.of(expert)) {
      if (slot_rank[s] == rank) return s;
    }
    return -1;
  };

  // Step 3a: greedy, the most constrained demands first, each to its least loaded holder
  // (ties: on the reader's node, then the lowest rank, whose lowest slot comes first).
  std::vector<Source> source(n);
  for (const int32_t i : most_constrained_first(demands, ranks)) {
    const Demand& d = demands[i];
    const int32_t node = rank_node[slot_rank[d.dst_slot]];
    Source best;
    for (const int32_t s : holders.of(d.expert)) {
      const int32_t r = slot_rank[s];
      if (best.rank >= 0 &&
          (load[r] > load[best.rank] ||
           (load[r] == load[best.rank] &&
            (rank_node[r] != node || rank_node[best.rank] == node)))) {
        continue;
      }
      best = {r, s};
    }
    source[i] = best;
    ++load[best.rank];
  }

  // Step 3b: lower the peak along chains of holders. From a busiest rank, a breadth-first
  // search over "a read served by x could come from y instead"; a chain that ends at a rank at
  // least two reads below the start moves each of its reads one step, which takes one read
  // off the start and adds one to the end, nothing else changes.
  std::vector<std::vector<int32_t>> served(static_cast<size_t>(ranks));  // [ranks] demands
  for (size_t i = 0; i < n; ++i) served[source[i].rank].push_back(static_cast<int32_t>(i));
  std::vector<int32_t> seen(static_cast<size_t>(ranks), -1);   // [ranks] search stamp
  std::vector<int32_t> via_rank(static_cast<size_t>(ranks));   // [ranks] chain's previous rank
  std::vector<int32_t> via_read(static_cast<size_t>(ranks));   // [ranks] the read that moves
  std::vector<int32_t> queue;
  int32_t stamp = 0;
  auto move_read = [&](int32_t i, int32_t from, int32_t to) {
    std::vector<int32_t>& list = served[from];
    list.erase(std::find(list.begin(), list.end(), i));
    served[to].push_back(i);
    source[i] = {to, slot_of(demands[i].expert, to)};
  };
  auto lower = [&](int32_t start) {
    ++stamp;
    queue.assign(1, start);
    seen[start] = stamp;
    for (size_t q = 0; q < queue.size(); ++q) {
      const int32_t x = queue[q];
      for (const int32_t i : served[x]) {
        for (const int32_t s : holders.of(demands[i].expert)) {
          const int32_t y = slot_rank[s];
          if (seen[y] == stamp) continue;
          seen[y] = stamp;
          via_rank[y] = x;
          via_read[y] = i;
          if (load[y] + 2 > load[start]) {
            queue.push_back(y);
            continue;
          }
          --load[start];
          ++load[y];
          for (int32_t to = y; to != start; to = via_rank[to]) move_read(via_read[to], via_rank[to], to);
          return true;
        }
      }
    }
    return false;
  };
  for (;;) {
    const int64_t peak = *std::max_element(load.begin(), load.end());
    bool lowered_all = true;
    for (int32_t g = 0; g < ranks; ++g) {
      if (load[g] == peak && !lower(g)) lowered_all = false;
    }
    if (!lowered_all || peak < 2) break;
  }
  return source;
}

}  // namespace

LayerPlan plan_layer(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                     const Layout& layout, int64_t expert_bytes, const PlanSources& sources,
                     SourceChoice choice) {
  check_inputs(old_phy2log, new_phy2log, layout, expert_bytes);
  check_sources(sources, layout);
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

  // Step 1: which ranks take part and which slots are valid (a slot of a rank that does not
  // take part never is), the valid old holders of every expert, by slot (hence by rank), and
  // the member ranks with a host copy of it.
  std::vector<int32_t> slot_rank(static_cast<size_t>(physical));  // [physical]
  std::vector<int32_t> rank_node(static_cast<size_t>(ranks));     // [ranks]
  for (int64_t p = 0, g = 0; g < ranks; ++g) {
    for (int64_t i = 0; i < per_rank; ++i) slot_rank[p++] = static_cast<int32_t>(g);
  }
  for (int64_t g = 0; g < ranks; ++g) rank_node[g] = static_cast<int32_t>(layout.node_of_rank(g));
  auto rank_of = [&](int32_t slot) { return slot_rank[slot]; };
  std::vector<uint8_t> member(static_cast<size_t>(ranks), 1);  // [ranks]
  if (!sources.members.empty()) {
    for (int64_t g = 0; g < ranks; ++g) member[g] = sources.members[g] != 0;
  }
  std::vector<uint8_t> valid(static_cast<size_t>(physical), 1);  // [physical]
  for (int64_t p = 0; p < physical; ++p) {
    valid[p] = member[slot_rank[p]] && (sources.usable.empty() || sources.usable[p] != 0);
  }
  const PerExpert holders = index_holders(old_phy2log, valid, experts);
  const PerExpert backups = index_backups(sources.backup_holders, member, experts);
  auto holds_backup = [&](int32_t g, int32_t e) {
    const std::span<const int32_t> b = backups.of(e);
    return std::binary_search(b.begin(), b.end(), g);
  };

  // Step 2: the same-rank actions, in slot order. `first_fetch[e]` is the first slot of the
  // current rank that reads or restores e, valid when `first_fetch_rank[e]` is that rank.
  std::vector<int32_t> first_fetch(static_cast<size_t>(experts), -1);
  std::vector<int32_t> first_fetch_rank(static_cast<size_t>(experts), -1);
  std::vector<Demand> reads, restores;
  for (int32_t g = 0; g < ranks; ++g) {
    for (int64_t p = g * per_rank; p < (g + 1) * per_rank; ++p) {
      const int32_t e = new_phy2log[p];
      SlotAction& a = plan.actions[p];
      a.expert = e;
      a.src_rank = g;
      if (!member[g] || (valid[p] && old_phy2log[p] == e)) {
        a.action = Action::kUnchanged;
        a.src_slot = static_cast<int32_t>(p);
        continue;
      }
      const std::span<const int32_t> held = holders.of(e);
      const auto local = std::lower_bound(held.begin(), held.end(), g * per_rank);
      if (local != held.end() && rank_of(*local) == g) {
        a.action = Action::kLocalCopy;
        a.src_slot = *local;
        continue;
      }
      if (first_fetch_rank[e] == g) {
        a.action = Action::kFreeRide;
        a.src_slot = first_fetch[e];
        continue;
      }
      first_fetch_rank[e] = g;
      first_fetch[e] = static_cast<int32_t>(p);
      const int32_t node = rank_node[g];
      // The distinct ranks among `sorted_ranks` (ascending, repeats allowed): on g's node, all.
      auto count = [&](auto&& sorted_ranks, int32_t& same_node, int32_t& all) {
        int32_t last = -1;
        same_node = all = 0;
        for (const int32_t r : sorted_ranks) {
          if (r == last) continue;
          last = r;
          ++all;
          if (rank_node[r] == node) ++same_node;
        }
      };
      if (!held.empty()) {
        // Candidates: the holder ranks on g's node if any, else all of them (all of them
        // always, for the lowest peak), unless g can restore from its own copy rather than
        // cross nodes. The action (same node or not) follows the source, in step 3.
        int32_t same_node = 0, all = 0;
        count(held | std::views::transform(rank_of), same_node, all);
        if (same_node == 0 && holds_backup(g, e)) {
          a.action = Action::kRestore;
          a.src_slot = -1;
          continue;
        }
        const bool near = same_node > 0 && choice == SourceChoice::kSpreadServed;
        reads.push_back({static_cast<int32_t>(p), e, near ? same_node : all, near});
        continue;
      }
      // Nothing valid holds e: a restore, from g's own copy, a member's copy on g's node, one
      // elsewhere, or the loader.
      a.action = Action::kRestore;
      a.src_slot = -1;
      if (holds_backup(g, e)) continue;
      int32_t same_node = 0, all = 0;
      count(backups.of(e), same_node, all);
      if (all > 0) {
        restores.push_back({static_cast<int32_t>(p), e, same_node > 0 ? same_node : all,
                            same_node > 0});
      } else if (sources.loader) {
        a.src_rank = -1;
      } else if (sources.usable.empty() && sources.members.empty()) {
        // Nothing is lost: the new placement names an expert the old one never had.
        fail("expert ", e, " (new slot ", p,
             ") is in no slot of the old placement: there is nothing to read it from");
      } else {
        fail("expert ", e,
             " has no replica on a live rank and no backup (register a host backup or a "
             "loader)");
      }
    }
  }

  // Step 3: sources for the reads and the restores from peers' copies. Reads: by `choice`
  // (planner.h). Restores: the most constrained demands go first, each to the candidate rank
  // that has served the fewest so far (ties: lowest rank, lowest slot). Reads and restores are
  // counted apart: they load different memory (live GPU slots, host copies) at different
  // times (restores before reads).
  auto set_read = [&](const Demand& d, Source source) {
    SlotAction& a = plan.actions[d.dst_slot];
    a.src_rank = source.rank;
    a.src_slot = source.slot;
    a.action = rank_node[source.rank] == rank_node[rank_of(d.dst_slot)] ? Action::kReadSameNode
                                                                        : Action::kReadOtherNode;
  };
  std::vector<int64_t> served(static_cast<size_t>(ranks), 0);
  if (choice == SourceChoice::kLowestPeakDegree) {
    const std::vector<Source> sources_of_reads =
        lowest_peak_sources(reads, holders, slot_rank, rank_node, ranks);
    for (size_t i = 0; i < reads.size(); ++i) set_read(reads[i], sources_of_reads[i]);
  } else {
    for (const int32_t i : most_constrained_first(reads, ranks)) {
      const Demand& d = reads[i];
      const int32_t node = rank_node[rank_of(d.dst_slot)];
      Source best;
      for (const int32_t s : holders.of(d.expert)) {
        const int32_t r = rank_of(s);
        if (d.same_node && rank_node[r] != node) continue;
        if (best.rank < 0 || served[r] < served[best.rank]) best = {r, s};
      }
      ++served[best.rank];
      set_read(d, best);
    }
  }
  std::fill(served.begin(), served.end(), 0);
  for (const int32_t i : most_constrained_first(restores, ranks)) {
    const Demand& d = restores[i];
    SlotAction& a = plan.actions[d.dst_slot];
    const int32_t node = rank_node[rank_of(d.dst_slot)];
    int32_t best_rank = -1;
    for (const int32_t r : backups.of(d.expert)) {
      if (d.same_node && rank_node[r] != node) continue;
      if (best_rank < 0 || served[r] < served[best_rank]) best_rank = r;
    }
    ++served[best_rank];
    a.src_rank = best_rank;
  }

  // Step 4: the reads and restores in destination order, and the byte accounting.
  std::vector<int64_t> staged(static_cast<size_t>(ranks), 0);
  plan.reads.reserve(reads.size());
  for (int64_t p = 0; p < physical; ++p) {
    const SlotAction& a = plan.actions[p];
    const int32_t g = rank_of(static_cast<int32_t>(p));
    ++plan.slots[static_cast<size_t>(a.action)];
    if (is_staged(a.action)) ++staged[g];
    if (a.action == Action::kLocalCopy || a.action == Action::kFreeRide) {
      plan.bytes_local_copy += expert_bytes;
    }
    if (a.action == Action::kRestore) {
      plan.restores.push_back({a.src_rank, g, static_cast<int32_t>(p), a.expert});
      plan.bytes_restored += expert_bytes;
      if (a.src_rank >= 0 && a.src_rank != g) plan.bytes_restored_remote += expert_bytes;
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
