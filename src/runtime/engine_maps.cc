#include "runtime/engine_maps.h"

#include <fmt/core.h>

#include <algorithm>
#include <string>
#include <utility>

#include "eplb/core/error.h"

namespace eplb::runtime {

int64_t IntTensor::offset(std::initializer_list<int64_t> index) const {
  int64_t at = 0;
  int64_t row = 1;  // a contiguous tensor's stride of the dimension being walked (from the last)
  const size_t dims = shape.size();
  const auto* idx = index.begin();
  for (size_t d = dims; d-- > 0;) {
    const int64_t stride = strides.empty() ? row : strides[d];
    at += idx[d] * stride;
    row *= shape[d];
  }
  return at;
}

std::string IntTensor::describe() const {
  std::string dims;
  for (size_t d = 0; d < shape.size(); ++d) dims += (d ? ", " : "") + std::to_string(shape[d]);
  return fmt::format("{} [{}]", type == Type::kInt32 ? "int32" : "int64", dims);
}

std::string_view map_kind_name(MapKind kind) {
  switch (kind) {
    case MapKind::kPhysicalToLogical: return "physical_to_logical";
    case MapKind::kLogicalToPhysical: return "logical_to_physical";
    case MapKind::kReplicaCount: return "replica_count";
    case MapKind::kRankDispatch: return "rank_dispatch";
  }
  return "?";
}

namespace {

void store(const IntTensor& t, int64_t at, int64_t value) {
  if (t.type == IntTensor::Type::kInt32) {
    static_cast<int32_t*>(t.data)[at] = static_cast<int32_t>(value);
  } else {
    static_cast<int64_t*>(t.data)[at] = value;
  }
}

int64_t load(const IntTensor& t, int64_t at) {
  return t.type == IntTensor::Type::kInt32 ? static_cast<const int32_t*>(t.data)[at]
                                           : static_cast<const int64_t*>(t.data)[at];
}

// The shape a tensor must have; R (the last size) is checked by the caller.
void check_shape(const IntTensor& t, const std::string& name, std::vector<int64_t> want,
                 const char* layout_words) {
  if (t.data == nullptr) fail(name, ": no data (a null pointer)");
  if (!t.strides.empty() && t.strides.size() != t.shape.size()) {
    fail(name, ": ", t.strides.size(), " strides for ", t.shape.size(), " dimensions");
  }
  for (const int64_t s : t.strides) {
    if (s < 1) fail(name, " has a stride of ", s, ": map tensors need positive strides");
  }
  bool same = t.shape.size() == want.size();
  for (size_t d = 0; same && d < want.size(); ++d) same = want[d] < 0 || t.shape[d] == want[d];
  if (!same) {
    std::string dims;
    for (size_t d = 0; d < want.size(); ++d) {
      dims += (d ? ", " : "") + (want[d] < 0 ? std::string("R") : std::to_string(want[d]));
    }
    fail(name, " is ", t.describe(), ", expected [", dims, "] (", layout_words, ")");
  }
}


// Whether a [layers][width] tensor is at the layout's width (false) or the members' (true);
// InvalidArgument otherwise, naming both.
bool compact_width(const IntTensor& t, const std::string& name, int64_t layers,
                   const Layout& layout, const CompactSlots& compact, const char* words) {
  const int64_t P = layout.physical;
  const bool two = t.shape.size() == 2 && t.shape[0] == layers;
  const bool narrow = two && t.shape[1] != P && t.shape[1] == compact.width();
  if (!narrow && two && t.shape[1] != P && compact.width() != P) {
    fail(name, " is ", t.describe(), ", expected [", layers, ", ", P, "] (", words, ") or [",
         layers, ", ", compact.width(), "] (the slots of the group's ",
         compact.width() / layout.slots_per_rank(), " members, in seat order)");
  }
  check_shape(t, name, {layers, narrow ? compact.width() : P}, words);
  return narrow;
}

}  // namespace

void EngineMaps::bind(std::vector<MapBinding> maps, int64_t layers, const Layout& layout,
                      const CompactSlots& members) {
  const int64_t E = layout.experts, P = layout.physical;
  // The call's numbering: its physical_to_logical tensors' widths say it.
  bool narrow = false;
  for (const MapBinding& m : maps) {
    if (m.kind == MapKind::kPhysicalToLogical) {
      const std::string name = m.name.empty() ? std::string(map_kind_name(m.kind)) : m.name;
      narrow = compact_width(m.tensor, name, layers, layout, members, "layers, physical slots");
      break;
    }
  }
  const int64_t width = narrow ? members.width() : P;
  // The most replicas the tables can give one expert: P - E + 1, at the members' width too
  // (before a repair, the experts of the lost seats have no slot, so the members' slots may
  // hold that many copies of the others; vLLM keeps its R through elastic EP).
  const int64_t most = P - E + 1;
  for (MapBinding& m : maps) {
    if (m.name.empty()) m.name = std::string(map_kind_name(m.kind));
    switch (m.kind) {
      case MapKind::kPhysicalToLogical:
        if (compact_width(m.tensor, m.name, layers, layout, members, "layers, physical slots") !=
            narrow) {
          fail(m.name, " is ", m.tensor.describe(), ", but another physical_to_logical tensor of "
               "this call is ", width, " slots wide: bind the maps of one numbering together");
        }
        break;
      case MapKind::kLogicalToPhysical:
        check_shape(m.tensor, m.name, {layers, E, -1}, "layers, experts, R");
        if (m.tensor.size(2) < most) {
          fail(m.name, " is ", m.tensor.describe(), ": R = ", m.tensor.size(2), " columns, but a "
               "placement of ", P, " slots for ", E, " experts can give one expert ", most,
               " replicas; R must be at least ", most, " (physical - experts + 1: vLLM sizes it "
               "num_redundant_experts + 1)");
        }
        break;
      case MapKind::kReplicaCount:
      case MapKind::kRankDispatch:
        check_shape(m.tensor, m.name, {layers, E}, "layers, experts");
        break;
    }
  }
  std::vector<Bound> bound;
  for (MapBinding& m : maps) {
    bound.push_back({std::move(m), narrow ? std::optional<CompactSlots>(members) : std::nullopt});
  }
  maps_ = std::move(bound);
}

std::vector<std::string> EngineMaps::unbind_other_members(const CompactSlots& members) {
  std::vector<std::string> names;
  std::vector<Bound> kept;
  for (Bound& b : maps_) {
    if (!b.compact || *b.compact == members) {
      kept.push_back(std::move(b));
    } else {
      names.push_back(b.map.name);
    }
  }
  maps_ = std::move(kept);
  return names;
}

void EngineMaps::write(int64_t layer, std::span<const int32_t> phy2log,
                       const routing::DispatchTables& tables, int rank) const {
  for (const Bound& b : maps_) {
    const IntTensor& t = b.map.tensor;
    // A slot of the tables in the tensor's numbering (-1 stays -1; the tables name no slot of a
    // seat that is no member once the group changed).
    const auto slot_of = [&](int64_t slot) {
      return slot < 0 || !b.compact ? slot : b.compact->compact_slot(slot);
    };
    switch (b.map.kind) {
      case MapKind::kPhysicalToLogical:
        for (int64_t i = 0; i < t.size(1); ++i) {
          const int64_t slot = b.compact ? b.compact->seat_slot(i) : i;
          store(t, t.offset({layer, i}), phy2log[static_cast<size_t>(slot)]);
        }
        break;
      case MapKind::kLogicalToPhysical:
        for (int64_t e = 0; e < tables.experts; ++e) {
          const std::span<const int32_t> replicas = tables.replicas(e);
          const int64_t width = t.size(2);
          for (int64_t i = 0; i < width; ++i) {
            const int64_t slot = i < static_cast<int64_t>(replicas.size()) ? replicas[i] : -1;
            store(t, t.offset({layer, e, i}), slot_of(slot));
          }
        }
        break;
      case MapKind::kReplicaCount:
        for (int64_t e = 0; e < tables.experts; ++e) {
          store(t, t.offset({layer, e}), tables.replica_count[e]);
        }
        break;
      case MapKind::kRankDispatch:
        for (int64_t e = 0; e < tables.experts; ++e) {
          store(t, t.offset({layer, e}), slot_of(tables.static_slot[rank * tables.experts + e]));
        }
        break;
    }
  }
}

void read_pass_counts(const IntTensor& counts, CountsOf of, int64_t layers, const Layout& layout,
                      const CompactSlots& compact, std::span<const int32_t> phy2log,
                      std::span<int64_t> logical) {
  const int64_t E = layout.experts, P = layout.physical;
  bool narrow = false;
  if (of == CountsOf::kSlots) {
    narrow = compact_width(counts, "record_pass: counts", layers, layout, compact,
                           "layers, physical slots: tokens per slot");
  } else {
    check_shape(counts, "record_pass: counts", {layers, E},
                "layers, experts: tokens per logical expert");
  }
  const int64_t width = counts.size(1);
  // Every count is checked before any is added: an error leaves nothing half recorded.
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < width; ++i) {
      const int64_t c = load(counts, counts.offset({l, i}));
      if (c < 0) {
        fail("record_pass: counts[", l, "][", i, "] is ", c, ": token counts are never negative");
      }
    }
  }
  std::fill(logical.begin(), logical.end(), 0);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < width; ++i) {
      const int64_t c = load(counts, counts.offset({l, i}));
      const int64_t slot = narrow ? compact.seat_slot(i) : i;
      const int64_t e = of == CountsOf::kSlots ? phy2log[l * P + slot] : i;
      logical[l * E + e] += c;
    }
  }
}

}  // namespace eplb::runtime
