#include "eplb/core/types.h"

#include <algorithm>
#include <cmath>

#include "eplb/core/error.h"

namespace eplb {

void Layout::validate() const {
  if (experts <= 0 || experts > kMaxExperts) {
    fail("experts ", experts, " is outside [1, ", kMaxExperts,
         "] (the logical experts of one layer)");
  }
  if (ranks <= 0 || ranks > kMaxRanks) fail("ranks ", ranks, " is outside [1, ", kMaxRanks, "]");
  if (nodes <= 0) fail("nodes ", nodes, " must be at least 1");
  if (groups <= 0) fail("groups ", groups, " must be at least 1");
  if (physical > kMaxPhysical) {
    fail("physical ", physical, " is above the largest supported, ", kMaxPhysical,
         " slots per layer");
  }
  if (physical < experts) {
    fail("physical ", physical, " is below experts ", experts,
         " (every logical expert needs at least one slot)");
  }
  if (physical % ranks != 0) {
    fail("physical ", physical, " is not a multiple of ranks ", ranks,
         " (every rank holds the same number of slots)");
  }
  if (ranks % nodes != 0) {
    fail("ranks ", ranks, " is not a multiple of nodes ", nodes,
         " (every node holds the same number of ranks)");
  }
  if (experts % groups != 0) {
    fail("groups ", groups, " does not divide experts ", experts,
         " (every group holds the same number of experts)");
  }
}

std::string Layout::describe() const {
  return detail::concat("E=", experts, " P=", physical, " G=", ranks, " N=", nodes,
                        " groups=", groups);
}

void LoadMatrix::validate() const {
  if (layers <= 0 || experts <= 0) {
    fail("load matrix is empty (", layers, " layers x ", experts, " experts)");
  }
  if (layers > kMaxLayers || experts > kMaxExperts) {
    fail("load matrix has ", layers, " layers x ", experts, " experts; eplb supports at most ",
         kMaxLayers, " layers and ", kMaxExperts, " experts per layer");
  }
  if (values.size() != static_cast<size_t>(layers * experts)) {
    fail("load matrix holds ", values.size(), " values, expected ", layers, " x ", experts);
  }
  for (int64_t l = 0; l < layers; ++l) {
    double total = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const double v = at(l, e);
      if (!std::isfinite(v) || v < 0) {
        fail("load of layer ", l, " expert ", e, " is ", v,
             " (loads must be finite and non-negative)");
      }
      total += v;
    }
    check_layer_total(l, total);
  }
}

void check_layer_total(int64_t layer, double total, std::string_view context) {
  if (total <= kMaxLayerLoad) return;  // false for NaN too
  fail("the loads of layer ", layer, context, " sum to ", total,
       std::isinf(total) ? " (past the largest double)" : "", ", above ", kMaxLayerLoad,
       ", the most one layer's loads may sum to (the deepseek policy computes in float32, as its "
       "reference does, and would overflow): scale the loads down");
}

void Placement::derive_from_phy2log() {
  replica_count.assign(static_cast<size_t>(layers * experts), 0);
  int64_t most = 1;
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t p = 0; p < physical; ++p) {
      const int32_t e = phy2log[l * physical + p];
      EPLB_CHECK(e >= 0 && e < experts, "layer ", l, " slot ", p, " holds expert ", e,
                 ", outside [0, ", experts, ")");
      most = std::max<int64_t>(most, ++replica_count[l * experts + e]);
    }
  }
  max_replicas = most;
  log2phy.assign(static_cast<size_t>(layers * experts * max_replicas), -1);
  std::vector<int32_t> filled(static_cast<size_t>(experts));
  for (int64_t l = 0; l < layers; ++l) {
    std::fill(filled.begin(), filled.end(), 0);
    for (int64_t p = 0; p < physical; ++p) {
      const int32_t e = phy2log[l * physical + p];
      log2phy[(l * experts + e) * max_replicas + filled[e]++] = static_cast<int32_t>(p);
    }
  }
}

void Placement::validate() const {
  if (layers <= 0 || experts <= 0 || physical < experts) {
    fail("placement shape is invalid: ", layers, " layers, ", experts, " experts, ", physical,
         " physical slots (need at least one layer and physical >= experts)");
  }
  if (phy2log.size() != static_cast<size_t>(layers * physical)) {
    fail("phy2log holds ", phy2log.size(), " entries, expected ", layers, " x ", physical);
  }
  if (replica_count.size() != static_cast<size_t>(layers * experts)) {
    fail("replica_count holds ", replica_count.size(), " entries, expected ", layers, " x ",
         experts);
  }
  if (log2phy.size() != static_cast<size_t>(layers * experts * max_replicas)) {
    fail("log2phy holds ", log2phy.size(), " entries, expected ", layers, " x ", experts, " x ",
         max_replicas);
  }
  std::vector<int32_t> count(static_cast<size_t>(experts));
  for (int64_t l = 0; l < layers; ++l) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t p = 0; p < physical; ++p) {
      const int32_t e = phy2log[l * physical + p];
      if (e < 0 || e >= experts) {
        fail("layer ", l, " slot ", p, " holds expert ", e, ", outside [0, ", experts, ")");
      }
      ++count[e];
    }
    for (int64_t e = 0; e < experts; ++e) {
      if (count[e] == 0) fail("layer ", l, " expert ", e, " has no slot");
      if (count[e] != replica_count[l * experts + e]) {
        fail("layer ", l, " expert ", e, ": replica_count says ", replica_count[l * experts + e],
             " but phy2log holds it in ", count[e], " slots");
      }
      const int32_t* row = log2phy.data() + (l * experts + e) * max_replicas;
      for (int64_t i = 0; i < max_replicas; ++i) {
        if (i < count[e]) {
          if (row[i] < 0 || row[i] >= physical || phy2log[l * physical + row[i]] != e) {
            fail("layer ", l, " expert ", e, ": log2phy replica ", i, " is slot ", row[i],
                 ", which does not hold it");
          }
        } else if (row[i] != -1) {
          fail("layer ", l, " expert ", e, ": log2phy padding at ", i, " is ", row[i],
               ", expected -1");
        }
      }
    }
  }
}

Placement trivial_placement(int64_t layers, int64_t experts, int64_t physical) {
  EPLB_CHECK(layers > 0 && experts > 0 && physical >= experts, "trivial placement needs layers ",
             layers, " > 0 and physical ", physical, " >= experts ", experts, " > 0");
  Placement out(layers, experts, physical);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t p = 0; p < physical; ++p) {
      out.phy2log[l * physical + p] = static_cast<int32_t>(p % experts);
    }
  }
  out.derive_from_phy2log();
  return out;
}

}  // namespace eplb
