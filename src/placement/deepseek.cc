// The public DeepSeek EPLB algorithm (deepseek-ai/EPLB `rebalance_experts`), restated in C++.
//
// Three steps per layer (hierarchical; the global policy is the same with one group, one node):
//   Step 1: pack the groups' summed loads into nodes (balanced packing, groups/N per node).
//           Node n's "local" experts are its groups' experts, ordered by (position of the group
//           in the pack, offset in the group).
//   Step 2: replicate each node's E/N local experts into P/N replicas (greedy on w / count).
//   Step 3: pack each node's P/N replicas (load w / count) into its G/N ranks, P/G per rank.
//
// Parity with the reference: its arithmetic is float32 (loads cast to float32, group sums,
// w / count, pack sums), and so is ours. Its sort is torch's CPU sort, which by default is not
// stable: it is std::sort over (value, index) pairs with a "greater value" comparator. We make
// the same std::sort call with the same comparisons, so with the same standard library (GNU
// libstdc++) even the order of exactly tied items is the reference's. Ties are the replicas of
// one expert (they carry the same per-replica load); their order shows only in log2phy's
// replica order, never in phy2log or replica_count. Everything else breaks ties by the lowest
// index, as the reference does (Python's min, torch's max). One known difference: torch sums a
// group's loads in a vectorised order, we sum them in expert order; the float32 sums can differ
// in the last bit, which changes the result only when two group or node sums are that close.
//
// Speed: one workspace sized once per call, reused for every layer and node; no allocation in
// the per-layer loops. Loads are compared as integer keys (float bits and index), the lightest
// pack and the heaviest expert are found by branch-free scans.

#include "placement/deepseek.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#include "eplb/core/error.h"
#include "placement/replicas.h"

namespace eplb::placement {
namespace {

// Ordering keys. Loads are non-negative floats, whose bit patterns order like their values, so
// (value bits << 32 | index bits) compares as one integer: no float compare chains, and the
// index part breaks ties the way the reference does.
uint64_t value_bits(float v) { return static_cast<uint64_t>(std::bit_cast<uint32_t>(v)) << 32; }

// Max key: the largest value, the lowest index on a tie.
uint64_t max_first_key(float v, int64_t index) {
  return value_bits(v) | (0xffffffffu - static_cast<uint32_t>(index));
}
// Min key: the smallest value, the lowest index on a tie.
uint64_t min_first_key(float v, int64_t index) {
  return value_bits(v) | static_cast<uint32_t>(index);
}
int64_t index_of_max_first_key(uint64_t key) {
  return 0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu);
}
int64_t index_of_min_first_key(uint64_t key) { return static_cast<int64_t>(key & 0xffffffffu); }
float value_of_key(uint64_t key) { return std::bit_cast<float>(static_cast<uint32_t>(key >> 32)); }
constexpr uint64_t kFullPack = ~uint64_t{0};

// Largest of n >= 1 keys; four independent chains keep the loop throughput-bound.
uint64_t max_key(const uint64_t* keys, int64_t n) {
  uint64_t a = keys[0], b = keys[0], c = keys[0], d = keys[0];
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a = std::max(a, keys[i]);
    b = std::max(b, keys[i + 1]);
    c = std::max(c, keys[i + 2]);
    d = std::max(d, keys[i + 3]);
  }
  for (; i < n; ++i) a = std::max(a, keys[i]);
  return std::max(std::max(a, b), std::max(c, d));
}

constexpr int64_t kSmallPacks = 8;

// Smallest of exactly kSmallPacks keys, as a tree: short dependency chains, no branches.
uint64_t min_key_of_8(const uint64_t* k) {
  const uint64_t a = std::min(k[0], k[1]), b = std::min(k[2], k[3]);
  const uint64_t c = std::min(k[4], k[5]), d = std::min(k[6], k[7]);
  return std::min(std::min(a, b), std::min(c, d));
}

uint64_t min_key(const uint64_t* keys, int64_t n) {
  uint64_t a = keys[0], b = keys[0], c = keys[0], d = keys[0];
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a = std::min(a, keys[i]);
    b = std::min(b, keys[i + 1]);
    c = std::min(c, keys[i + 2]);
    d = std::min(d, keys[i + 3]);
  }
  for (; i < n; ++i) a = std::min(a, keys[i]);
  return std::min(std::min(a, b), std::min(c, d));
}

// Float32 copy of a validated (non-negative) load; -0 becomes +0 so its bits order right.
float to_float32(double v) { return v > 0 ? static_cast<float>(v) : 0.0f; }

// Buffers for one call, sized for the largest step, reused across layers and nodes.
struct Workspace {
  std::vector<uint64_t> order;      // [items]: (value bits, item) in packing visit order
  std::vector<int32_t> pack_items;  // [packs]
  std::vector<uint64_t> pack_key;   // [packs]: min_first_key(sum, pack), kFullPack when full
  std::vector<uint64_t> ratio_key;  // [local experts]: max_first_key of w / count

  explicit Workspace(int64_t max_items, int64_t max_packs, int64_t max_local)
      : order(static_cast<size_t>(max_items)),
        pack_items(static_cast<size_t>(max_packs)),
        pack_key(static_cast<size_t>(max_packs)),
        ratio_key(static_cast<size_t>(max_local)) {}
};

// Balanced packing of n = weight.size() items into `packs` packs of n / packs items each.
// Visits items by descending weight (ties in the reference's sort order), puts each into the
// lightest pack that still has room (lowest pack index on a tie); an item's position is the
// order it arrived in its pack. With one item per pack the reference skips the search and keeps
// item i in pack i, and so do we.
//   weight [n] -> pack [n], position [n]
void balanced_packing(std::span<const float> weight, int64_t packs, std::span<int32_t> pack,
                      std::span<int32_t> position, Workspace& ws) {
  const int64_t n = static_cast<int64_t>(weight.size());
  const int64_t per_pack = n / packs;
  if (per_pack == 1) {
    for (int64_t i = 0; i < n; ++i) {
      pack[i] = static_cast<int32_t>(i);
      position[i] = 0;
    }
    return;
  }

  // Step 1: visit order, sorted exactly as torch's CPU sort(descending=True) sorts: std::sort
  // with a comparator that looks at the value only (the index bits ride along).
  uint64_t* order = ws.order.data();
  for (int64_t i = 0; i < n; ++i) order[i] = value_bits(weight[i]) | static_cast<uint32_t>(i);
  std::sort(order, order + n, [](uint64_t a, uint64_t b) { return (a >> 32) > (b >> 32); });

  // Step 2: greedy fill. A pack's key holds its float32 sum and its index, a full pack's key is
  // the largest possible: the lightest open pack (lowest index on a tie) is the smallest key.
  // Up to kSmallPacks packs (the ranks of one node, typically) the scan has a fixed length,
  // padded with full packs, and compiles to a few branch-free instructions.
  uint64_t* pack_key = ws.pack_key.data();
  int32_t* pack_items = ws.pack_items.data();
  const int64_t scan = std::max(packs, kSmallPacks);
  for (int64_t p = 0; p < scan; ++p) {
    pack_items[p] = 0;
    pack_key[p] = p < packs ? min_first_key(0.0f, p) : kFullPack;
  }
  const auto fill = [&](auto lightest_key) {
    for (int64_t k = 0; k < n; ++k) {
      const uint64_t key = lightest_key();
      const int64_t best = index_of_min_first_key(key);
      const auto item = static_cast<int32_t>(order[k] & 0xffffffffu);
      pack[item] = static_cast<int32_t>(best);
      position[item] = pack_items[best]++;
      const float sum = value_of_key(key) + weight[item];
      pack_key[best] = pack_items[best] < per_pack ? min_first_key(sum, best) : kFullPack;
    }
  };
  if (packs <= kSmallPacks) {
    fill([&] { return min_key_of_8(pack_key); });
  } else {
    fill([&] { return min_key(pack_key, packs); });
  }
}

// Replication of m = weight.size() experts into `slots` replicas: replica j < m is expert j
// with replica index 0; each further replica goes to the expert with the largest w / count
// (float32, lowest expert on a tie), with replica index = its count before the increment.
//   weight [m] -> replica_expert [slots], replica_index [slots], count [m]
void replicate_experts(std::span<const float> weight, int64_t slots,
                       std::span<int32_t> replica_expert, std::span<int32_t> replica_index,
                       std::span<int32_t> count, Workspace& ws) {
  const int64_t m = static_cast<int64_t>(weight.size());
  uint64_t* ratio_key = ws.ratio_key.data();
  for (int64_t e = 0; e < m; ++e) {
    replica_expert[e] = static_cast<int32_t>(e);
    replica_index[e] = 0;
    count[e] = 1;
    ratio_key[e] = max_first_key(weight[e], e);
  }
  for (int64_t j = m; j < slots; ++j) {
    const int64_t best = index_of_max_first_key(max_key(ratio_key, m));
    replica_expert[j] = static_cast<int32_t>(best);
    replica_index[j] = count[best]++;
    ratio_key[best] = max_first_key(weight[best] / static_cast<float>(count[best]), best);
  }
}

}  // namespace

std::vector<int32_t> deepseek_global_counts(std::span<const double> w, int64_t slots) {
  // replicate_experts' choice: by thresholds on its float keys (replicas.h), else with its keys
  // in a heap (the keys are distinct, so the largest is the one its scan finds).
  std::vector<int32_t> count(w.size(), 1);
  std::vector<float> weight(w.size());
  for (size_t e = 0; e < w.size(); ++e) weight[e] = to_float32(w[e]);
  const int64_t extra = slots - static_cast<int64_t>(w.size());
  if (counts_by_thresholds<float>(weight, extra, extra, count)) return count;
  std::vector<uint64_t> heap(w.size());
  for (size_t e = 0; e < w.size(); ++e) heap[e] = max_first_key(weight[e], static_cast<int64_t>(e));
  std::make_heap(heap.begin(), heap.end());
  for (int64_t j = static_cast<int64_t>(w.size()); j < slots; ++j) {
    std::pop_heap(heap.begin(), heap.end());
    const int64_t best = index_of_max_first_key(heap.back());
    ++count[best];
    heap.back() = max_first_key(weight[best] / static_cast<float>(count[best]), best);
    std::push_heap(heap.begin(), heap.end());
  }
  return count;
}

Placement deepseek(const LoadMatrix& load, const Layout& layout) {
  layout.validate();
  load.validate();
  if (load.experts != layout.experts) {
    fail("the load has ", load.experts, " experts per layer but the layout has ", layout.experts);
  }

  // Hierarchical when the groups split evenly over the nodes, global otherwise.
  const bool hierarchical = layout.groups % layout.nodes == 0;
  const int64_t groups = hierarchical ? layout.groups : 1;
  const int64_t nodes = hierarchical ? layout.nodes : 1;
  const int64_t layers = load.layers;
  const int64_t experts = layout.experts;
  const int64_t physical = layout.physical;
  const int64_t group_size = experts / groups;
  const int64_t groups_per_node = groups / nodes;
  const int64_t local_experts = experts / nodes;    // E / N
  const int64_t local_slots = physical / nodes;     // P / N
  const int64_t local_ranks = layout.ranks / nodes;  // G / N
  const int64_t slots_per_rank = layout.slots_per_rank();

  Workspace ws(std::max(groups, local_slots), std::max({nodes, local_ranks, kSmallPacks}),
               local_experts);
  // Per-layer buffers (reused), named after the reference's tensors.
  std::vector<float> weight(static_cast<size_t>(experts));            // [E] float32 loads
  std::vector<float> group_weight(static_cast<size_t>(groups));       // [groups]
  std::vector<int32_t> group_node(static_cast<size_t>(groups));       // [groups]
  std::vector<int32_t> group_position(static_cast<size_t>(groups));   // [groups]
  std::vector<int32_t> mlog2log(static_cast<size_t>(experts));        // [E]: local order -> e
  std::vector<float> mlog_weight(static_cast<size_t>(local_experts));  // [E/N]
  std::vector<int32_t> mlog_count(static_cast<size_t>(experts));      // [E]: by local order
  std::vector<int32_t> phy2mlog(static_cast<size_t>(local_slots));    // [P/N]
  std::vector<int32_t> phy_rank(static_cast<size_t>(local_slots));    // [P/N]: replica index
  std::vector<float> phy_weight(static_cast<size_t>(local_slots));    // [P/N]
  std::vector<int32_t> phy_pack(static_cast<size_t>(local_slots));    // [P/N]
  std::vector<int32_t> phy_position(static_cast<size_t>(local_slots));  // [P/N]

  Placement out(layers, experts, physical);
  std::vector<int32_t> slot_replica(static_cast<size_t>(layers * physical));  // [L][P]

  for (int64_t l = 0; l < layers; ++l) {
    const std::span<const double> row = load.row(l);
    for (int64_t e = 0; e < experts; ++e) weight[e] = to_float32(row[e]);

    // Step 1: pack groups to nodes. Group sums accumulate in float32, in expert order.
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t i = 0; i < group_size; ++i) sum += weight[g * group_size + i];
      group_weight[g] = sum;
    }
    balanced_packing(group_weight, nodes, group_node, group_position, ws);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = (group_node[g] * groups_per_node + group_position[g]) * group_size;
      for (int64_t i = 0; i < group_size; ++i) {
        mlog2log[first + i] = static_cast<int32_t>(g * group_size + i);
      }
    }

    int32_t* layer_phy2log = out.phy2log.data() + l * physical;
    int32_t* layer_replica = slot_replica.data() + l * physical;
    for (int64_t n = 0; n < nodes; ++n) {
      const int32_t* node_mlog2log = mlog2log.data() + n * local_experts;
      const std::span<int32_t> node_count(mlog_count.data() + n * local_experts,
                                          static_cast<size_t>(local_experts));

      // Step 2: replicate the node's local experts into its slots.
      for (int64_t i = 0; i < local_experts; ++i) mlog_weight[i] = weight[node_mlog2log[i]];
      replicate_experts(mlog_weight, local_slots, phy2mlog, phy_rank, node_count, ws);

      // Step 3: pack the node's replicas (load w / count, float32) into its ranks.
      for (int64_t j = 0; j < local_slots; ++j) {
        const int32_t m = phy2mlog[j];
        phy_weight[j] = mlog_weight[m] / static_cast<float>(node_count[m]);
      }
      balanced_packing(phy_weight, local_ranks, phy_pack, phy_position, ws);
      for (int64_t j = 0; j < local_slots; ++j) {
        const int64_t slot = n * local_slots + phy_pack[j] * slots_per_rank + phy_position[j];
        layer_phy2log[slot] = node_mlog2log[phy2mlog[j]];
        layer_replica[slot] = phy_rank[j];
      }
    }

    int32_t* layer_count = out.replica_count.data() + l * experts;
    for (int64_t m = 0; m < experts; ++m) layer_count[mlog2log[m]] = mlog_count[m];
  }

  // log2phy in replica (creation) order, padded to the largest count of any layer.
  int32_t most = 1;
  for (const int32_t c : out.replica_count) most = std::max(most, c);
  out.max_replicas = most;
  out.log2phy.assign(static_cast<size_t>(layers * experts * most), -1);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t p = 0; p < physical; ++p) {
      const int64_t e = out.phy2log[l * physical + p];
      out.log2phy[(l * experts + e) * most + slot_replica[l * physical + p]] =
          static_cast<int32_t>(p);
    }
  }
  return out;
}

}  // namespace eplb::placement
