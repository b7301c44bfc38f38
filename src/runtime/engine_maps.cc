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

}  // namespace

void EngineMaps::bind(std::vector<MapBinding> maps, int64_t layers, const Layout& layout) {
  const int64_t E = layout.experts, P = layout.physical;
  const int64_t most = P - E + 1;  // the most replicas a placement can give one expert
  for (MapBinding& m : maps) {
    if (m.name.empty()) m.name = std::string(map_kind_name(m.kind));
    switch (m.kind) {
      case MapKind::kPhysicalToLogical:
        check_shape(m.tensor, m.name, {layers, P}, "layers, physical slots");
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
        check_shape(m.tensor, m.name, {layers, E}, "layers, experts");
        break;
      case MapKind::kRankDispatch:
        check_shape(m.tensor, m.name, {layers, E}, "layers, experts");
        break;
    }
  }
  maps_ = std::move(maps);
}

void EngineMaps::write(int64_t layer, std::span<const int32_t> phy2log,
                       const routing::DispatchTables& tables, int rank) const {
  for (const MapBinding& m : maps_) {
    const IntTensor& t = m.tensor;
    switch (m.kind) {
      case MapKind::kPhysicalToLogical:
        for (size_t p = 0; p < phy2log.size(); ++p) {
          store(t, t.offset({layer, static_cast<int64_t>(p)}), phy2log[p]);
        }
        break;
      case MapKind::kLogicalToPhysical:
        for (int64_t e = 0; e < tables.experts; ++e) {
          const std::span<const int32_t> replicas = tables.replicas(e);
          const int64_t width = t.size(2);
          for (int64_t i = 0; i < width; ++i) {
            const int64_t slot = i < static_cast<int64_t>(replicas.size()) ? replicas[i] : -1;
            store(t, t.offset({layer, e, i}), slot);
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
          store(t, t.offset({layer, e}), tables.static_slot[rank * tables.experts + e]);
        }
        break;
    }
  }
}

void read_pass_counts(const IntTensor& counts, CountsOf of, int64_t layers, const Layout& layout,
                      std::span<const int32_t> phy2log, std::span<int64_t> logical) {
  const int64_t E = layout.experts, P = layout.physical;
  const int64_t width = of == CountsOf::kSlots ? P : E;
  check_shape(counts, "record_pass: counts", {layers, width},
              of == CountsOf::kSlots ? "layers, physical slots: tokens per slot"
                                     : "layers, experts: tokens per logical expert");
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
      const int64_t e = of == CountsOf::kSlots ? phy2log[l * P + i] : i;
      logical[l * E + e] += c;
    }
  }
}

}  // namespace eplb::runtime
