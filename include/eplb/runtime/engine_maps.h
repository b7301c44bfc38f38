#pragma once
// Two of the engine's seams (docs/design.md, "Embedding: the engine's four seams"): the map tensors
// its router reads, which eplb writes in place, and the per-pass count tensor its router fills,
// which eplb reads once per step. Both are the engine's memory in the engine's layout; eplb keeps
// only their addresses.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace eplb::runtime {

// An integer tensor the engine owns, in host memory: `shape` sizes and `strides` in elements
// (row-major when empty). The engine keeps it alive, at the same address, while it is bound.
struct IntTensor {
  enum class Type { kInt32, kInt64 };
  void* data = nullptr;
  Type type = Type::kInt64;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;

  int64_t size(int dim) const { return shape[static_cast<size_t>(dim)]; }
  // Element offset of an index (as many indices as dimensions).
  int64_t offset(std::initializer_list<int64_t> index) const;
  std::string describe() const;  // "int64 [4, 64, 33]"
};

// What a bound map tensor holds, row l being layer l:
enum class MapKind {
  // [layers][physical]: the logical expert of each slot (vLLM's physical_to_logical_map,
  // SGLang's physical_to_logical_map and its _cpu copy).
  kPhysicalToLogical,
  // [layers][experts][R]: the slots that serve each expert, in the dispatch tables' order, -1
  // after them. R >= physical - experts + 1, the most replicas any placement gives one expert
  // (vLLM's logical_to_physical_map, R = num_redundant_experts + 1; SGLang's
  // logical_to_all_physical_map and its _cpu copy, R = physical).
  kLogicalToPhysical,
  // [layers][experts]: how many slots serve each expert (vLLM's logical_replica_count, SGLang's
  // logical_to_all_physical_map_num_valid).
  kReplicaCount,
  // [layers][experts]: the slot this rank sends each expert's tokens to, eplb's static choice
  // (its own replica, else one on its node, else replicas shared evenly among the ranks that
  // have none nearby; SGLang's logical_to_rank_dispatch_physical_map).
  kRankDispatch,
};
std::string_view map_kind_name(MapKind kind);

struct MapBinding {
  MapKind kind = MapKind::kPhysicalToLogical;
  IntTensor tensor;
  std::string name;  // the engine's name for it, in messages
};

// What a per-pass count tensor counts: [layers][physical] tokens per slot (vLLM's
// expert_load_pass, SGLang's per-pass physical count) or [layers][experts] per logical expert.
enum class CountsOf { kSlots, kExperts };

}  // namespace eplb::runtime
