#pragma once
// The words of docs/design.md as plain types: layout of a deployment, load matrices, placements.
// Pure data with validation; no I/O, no threads.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace eplb {

// The largest deployment eplb takes. Past these an input is corrupt data or a typo, not a
// model (the largest models have a few hundred experts per layer, the widest expert-parallel
// deployments a few hundred ranks): the bounds are checked before anything is sized, and they
// keep every count x bytes product and every sum of them far inside int64.
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;   // logical experts per layer
inline constexpr int64_t kMaxPhysical = int64_t{1} << 20;  // physical slots per layer
inline constexpr int64_t kMaxRanks = int64_t{1} << 16;     // ranks (and so nodes)
inline constexpr int64_t kMaxLayers = int64_t{1} << 16;    // MoE layers
inline constexpr int64_t kMaxSteps = int64_t{1} << 40;     // an interval or a window, in steps

// The most the loads of one layer may sum to. Loads are token counts, far below it: past it a
// load is corrupt data or needs scaling down. The deepseek policy computes in float32 as the
// public reference does (whose largest number is 3.4e38), and balanced compares layers with
// deepseek's: at most 1e38 a layer, every float32 sum of a layer's loads (a group, a rank's
// replicas) stays finite with room for rounding, and every figure computed in double (rank
// loads, means, bounds, balancedness) is far from overflowing into inf or NaN.
inline constexpr double kMaxLayerLoad = 1e38;
// Loads are doubles, which hold every integer up to 2^53 exactly and round some above it: load
// files refuse a count written as an integer above this rather than change it.
inline constexpr int64_t kMaxExactLoad = int64_t{1} << 53;

// The shape of one expert-parallel deployment. Slot p lives on rank p / slots_per_rank();
// rank g lives on node g / ranks_per_node(); experts [k*E/groups, (k+1)*E/groups) form group k.
struct Layout {
  int64_t experts = 0;   // E: logical experts per layer
  int64_t physical = 0;  // P = E + R: physical slots per layer
  int64_t ranks = 1;     // G
  int64_t nodes = 1;     // N
  int64_t groups = 1;    // DeepSeek's expert groups (1: no group-limited routing)

  int64_t redundant() const { return physical - experts; }
  int64_t slots_per_rank() const { return physical / ranks; }
  int64_t ranks_per_node() const { return ranks / nodes; }
  int64_t rank_of_slot(int64_t slot) const { return slot / slots_per_rank(); }
  int64_t node_of_rank(int64_t rank) const { return rank / ranks_per_node(); }
  int64_t node_of_slot(int64_t slot) const { return node_of_rank(rank_of_slot(slot)); }

  // Throws InvalidArgument naming the bad value and the rule, e.g.
  // "physical 300 is not a multiple of ranks 32 (every rank holds the same number of slots)".
  void validate() const;
  std::string describe() const;  // "E=256 P=288 G=32 N=4 groups=8"
};

// Per-layer, per-logical-expert loads (tokens routed over the window). Row-major [layers][experts].
struct LoadMatrix {
  int64_t layers = 0;
  int64_t experts = 0;
  std::vector<double> values;  // [layers][experts]

  LoadMatrix() = default;
  LoadMatrix(int64_t num_layers, int64_t num_experts)
      : layers(num_layers), experts(num_experts),
        values(static_cast<size_t>(num_layers * num_experts), 0.0) {}

  std::span<double> row(int64_t layer) {
    return {values.data() + layer * experts, static_cast<size_t>(experts)};
  }
  std::span<const double> row(int64_t layer) const {
    return {values.data() + layer * experts, static_cast<size_t>(experts)};
  }
  double& at(int64_t layer, int64_t expert) { return values[layer * experts + expert]; }
  double at(int64_t layer, int64_t expert) const { return values[layer * experts + expert]; }

  // Throws InvalidArgument on an empty matrix, more than kMaxLayers layers, a size mismatch, a
  // negative / non-finite load (naming its layer and expert), or a layer whose loads sum past
  // kMaxLayerLoad (naming the layer and the sum). Every policy, the metrics and the simulator
  // call it, so no load past it reaches a computation that would overflow.
  void validate() const;
};

// Where every logical expert lives, for every layer.
//   phy2log[l][p]      the logical expert held by slot p
//   replica_count[l][e] how many slots hold e (>= 1)
//   log2phy[l][e][i]   the slots holding e, i < replica_count, padded with -1 up to max_replicas
// log2phy's replica order is part of the result: the deepseek policy orders replicas by the
// order it created them (as the reference does), the others by slot.
struct Placement {
  int64_t layers = 0;
  int64_t experts = 0;
  int64_t physical = 0;
  int64_t max_replicas = 0;
  std::vector<int32_t> phy2log;        // [layers][physical]
  std::vector<int32_t> replica_count;  // [layers][experts]
  std::vector<int32_t> log2phy;        // [layers][experts][max_replicas]

  Placement() = default;
  Placement(int64_t num_layers, int64_t num_experts, int64_t num_physical)
      : layers(num_layers), experts(num_experts), physical(num_physical),
        phy2log(static_cast<size_t>(num_layers * num_physical), -1),
        replica_count(static_cast<size_t>(num_layers * num_experts), 0) {}

  std::span<int32_t> layer_phy2log(int64_t layer) {
    return {phy2log.data() + layer * physical, static_cast<size_t>(physical)};
  }
  std::span<const int32_t> layer_phy2log(int64_t layer) const {
    return {phy2log.data() + layer * physical, static_cast<size_t>(physical)};
  }
  std::span<const int32_t> layer_replica_count(int64_t layer) const {
    return {replica_count.data() + layer * experts, static_cast<size_t>(experts)};
  }
  // The slots of expert e in layer l, in replica order.
  std::span<const int32_t> replicas(int64_t layer, int64_t expert) const {
    return {log2phy.data() + (layer * experts + expert) * max_replicas,
            static_cast<size_t>(replica_count[layer * experts + expert])};
  }

  // Recomputes replica_count and log2phy from phy2log, replicas in slot order.
  void derive_from_phy2log();

  // Checks every slot holds an expert in [0, experts), every expert has at least one replica,
  // and replica_count / log2phy agree with phy2log. Throws InvalidArgument naming the first
  // violation.
  void validate() const;
};

// Throws InvalidArgument unless `total`, the sum of the loads of layer `layer`, is at most
// kMaxLayerLoad; `context` follows the layer in the message (" over steps [0, 4)").
void check_layer_total(int64_t layer, double total, std::string_view context = {});

// The trivial placement: slot p holds expert p mod E (what engines start with).
Placement trivial_placement(int64_t layers, int64_t experts, int64_t physical);

}  // namespace eplb
