#include "eplb/stats/placement_file.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/core/file.h"
#include "parse_util.h"

namespace eplb::stats {

namespace {

using detail::describe;
using detail::json_integer;
using detail::Json;
using detail::kMaxExperts;

constexpr int64_t kMaxSlot = std::numeric_limits<int32_t>::max();

// A [rows][cols] array of integers in [lo, hi]; every row as long as the first.
struct IntGrid {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<int32_t> values;  // [rows][cols]
};

IntGrid read_grid(const Json& value, std::string_view source, const std::string& path,
                  int64_t lo, int64_t hi, const char* what) {
  if (!value.is_array() || value.empty()) {
    fail(source, ": ", path, " is ", describe(value), ", expected an array of ", what);
  }
  IntGrid out;
  out.rows = static_cast<int64_t>(value.size());
  for (int64_t r = 0; r < out.rows; ++r) {
    const Json& row = value[static_cast<size_t>(r)];
    const std::string row_path = path + "[" + std::to_string(r) + "]";
    if (!row.is_array() || row.empty()) {
      fail(source, ": ", row_path, " is ", describe(row), ", expected a non-empty array");
    }
    const auto cols = static_cast<int64_t>(row.size());
    if (r == 0) {
      out.cols = cols;
      out.values.reserve(static_cast<size_t>(out.rows * out.cols));
    } else if (cols != out.cols) {
      fail(source, ": ", row_path, " has ", cols, " entries, expected ", out.cols, " (as ", path,
           "[0])");
    }
    for (int64_t c = 0; c < cols; ++c) {
      const Json& item = row[static_cast<size_t>(c)];
      // Fast path without a path string; json_integer builds the message otherwise.
      bool ok = false;
      int64_t v = 0;
      if (item.is_number_unsigned()) {
        ok = item.get<uint64_t>() <= static_cast<uint64_t>(hi);
        v = ok ? static_cast<int64_t>(item.get<uint64_t>()) : 0;
      } else if (item.is_number_integer()) {
        ok = true;
        v = item.get<int64_t>();
      }
      if (!ok || v < lo || v > hi) {
        json_integer(item, source, row_path + "[" + std::to_string(c) + "]", lo, hi);
        fail(source, ": ", row_path, "[", c, "] is out of [", lo, ", ", hi, "]");
      }
      out.values.push_back(static_cast<int32_t>(v));
    }
  }
  return out;
}

// An optional integer field of the header; -1 when absent.
int64_t header_field(const Json& doc, const char* key, std::string_view source, int64_t lo,
                     int64_t hi) {
  if (!doc.contains(key)) return -1;
  return json_integer(doc[key], source, key, lo, hi);
}

void check_header(int64_t stated, int64_t actual, const char* key, const char* counted,
                  std::string_view source) {
  if (stated >= 0 && stated != actual) {
    fail(source, ": \"", key, "\" is ", stated, " but phy2log has ", actual, " ", counted);
  }
}

PlacementFile parse_eplb(const Json& doc, int64_t min_experts, std::string_view source) {
  if (doc.contains("version")) {
    const int64_t version = json_integer(doc["version"], source, "version", 0, kMaxSlot);
    if (version != 1) {
      fail(source, ": placement file version ", version, " is not supported (expected 1)");
    }
  }
  const IntGrid phy2log =
      read_grid(doc["phy2log"], source, "phy2log", 0, kMaxExperts - 1, "layers, each an array "
                "of the logical expert in every physical slot");
  const int64_t layers = phy2log.rows;
  const int64_t physical = phy2log.cols;
  check_header(header_field(doc, "layers", source, 1, kMaxSlot), layers, "layers", "layers",
               source);
  check_header(header_field(doc, "physical", source, 1, kMaxSlot), physical, "physical",
               "slots per layer", source);
  const int64_t largest = *std::max_element(phy2log.values.begin(), phy2log.values.end());
  int64_t experts = header_field(doc, "experts", source, 1, kMaxExperts);
  if (experts >= 0 && largest >= experts) {
    fail(source, ": phy2log holds expert ", largest, " but \"experts\" is ", experts,
         " (expert ids are in [0, experts))");
  }
  if (experts < 0) experts = largest + 1;
  experts = std::max(experts, min_experts);
  if (experts > physical) {
    fail(source, ": ", experts, " experts do not fit in ", physical,
         " physical slots (every logical expert needs at least one)");
  }

  PlacementFile out;
  out.ranks = std::max<int64_t>(0, header_field(doc, "ranks", source, 1, kMaxSlot));
  out.nodes = std::max<int64_t>(0, header_field(doc, "nodes", source, 1, kMaxSlot));
  if (out.ranks > 0 && physical % out.ranks != 0) {
    fail(source, ": physical ", physical, " is not a multiple of ranks ", out.ranks,
         " (every rank holds the same number of slots)");
  }
  if (out.nodes > 0 && (out.ranks == 0 || out.ranks % out.nodes != 0)) {
    fail(source, ": ranks ", out.ranks, " is not a multiple of nodes ", out.nodes,
         " (every node holds the same number of ranks)");
  }

  Placement& p = out.placement;
  p = Placement(layers, experts, physical);
  p.phy2log = phy2log.values;
  for (int64_t l = 0; l < layers; ++l) {
    std::vector<bool> seen(static_cast<size_t>(experts));
    for (const int32_t e : p.layer_phy2log(l)) seen[static_cast<size_t>(e)] = true;
    for (int64_t e = 0; e < experts; ++e) {
      if (!seen[static_cast<size_t>(e)]) {
        fail(source, ": layer ", l, " expert ", e, " has no slot in phy2log (", experts,
             " experts; every one needs at least one slot)");
      }
    }
  }
  p.derive_from_phy2log();  // replicas in slot order, unless the file says otherwise below

  if (doc.contains("replica_count")) {
    const IntGrid counts = read_grid(doc["replica_count"], source, "replica_count", 1, physical,
                                     "layers, each an array of replica counts per expert");
    if (counts.rows != layers || counts.cols != experts) {
      fail(source, ": replica_count is ", counts.rows, " x ", counts.cols, ", expected ", layers,
           " x ", experts, " (layers x experts)");
    }
    for (int64_t i = 0; i < layers * experts; ++i) {
      if (counts.values[i] != p.replica_count[i]) {
        fail(source, ": replica_count[", i / experts, "][", i % experts, "] is ",
             counts.values[i], " but phy2log holds expert ", i % experts, " in ",
             p.replica_count[i], " slots");
      }
    }
  }

  if (doc.contains("log2phy")) {
    // Keep the file's replica order: it is part of the placement (see Placement).
    const Json& value = doc["log2phy"];
    if (!value.is_array() || static_cast<int64_t>(value.size()) != layers) {
      fail(source, ": log2phy is ", describe(value), ", expected an array of ", layers,
           " layers, each [experts][max_replicas]");
    }
    std::vector<int32_t> log2phy;
    int64_t width = 0;
    for (int64_t l = 0; l < layers; ++l) {
      const std::string path = "log2phy[" + std::to_string(l) + "]";
      const IntGrid grid = read_grid(value[static_cast<size_t>(l)], source, path, -1,
                                     physical - 1, "experts, each an array of slots");
      if (grid.rows != experts) {
        fail(source, ": ", path, " has ", grid.rows, " experts, expected ", experts);
      }
      if (l == 0) {
        width = grid.cols;
        log2phy.reserve(static_cast<size_t>(layers * experts * width));
      } else if (grid.cols != width) {
        fail(source, ": ", path, " has rows of ", grid.cols, " replicas, expected ", width,
             " (as log2phy[0])");
      }
      log2phy.insert(log2phy.end(), grid.values.begin(), grid.values.end());
    }
    const int32_t most = *std::max_element(p.replica_count.begin(), p.replica_count.end());
    if (width < most) {
      fail(source, ": log2phy has room for ", width, " replicas per expert, but phy2log holds an "
           "expert in ", most, " slots");
    }
    p.max_replicas = width;
    p.log2phy = std::move(log2phy);
  }

  try {
    p.validate();
  } catch (const InvalidArgument& e) {
    fail(source, ": ", e.what());
  }
  return out;
}

PlacementFile parse_sglang(const Json& doc, int64_t min_experts, std::string_view source) {
  const IntGrid map = read_grid(doc["physical_to_logical_map"], source,
                                "physical_to_logical_map", 0, kMaxExperts - 1,
                                "layers, each an array of the logical expert in every slot");
  const int64_t largest = *std::max_element(map.values.begin(), map.values.end());
  const int64_t experts = std::max(largest + 1, min_experts);
  if (experts > map.cols) {
    fail(source, ": ", experts, " experts do not fit in ", map.cols,
         " physical slots (every logical expert needs at least one)");
  }
  PlacementFile out;
  Placement& p = out.placement;
  p = Placement(map.rows, experts, map.cols);
  p.phy2log = map.values;
  p.derive_from_phy2log();
  for (int64_t l = 0; l < p.layers; ++l) {
    for (int64_t e = 0; e < experts; ++e) {
      if (p.replica_count[l * experts + e] == 0) {
        fail(source, ": layer ", l, " expert ", e, " has no slot in physical_to_logical_map (",
             experts, " experts; every one needs at least one slot)");
      }
    }
  }
  return out;
}

std::string header_of(const Placement& placement, const Layout& layout) {
  return eplb::detail::concat("{\"version\":1,\"layers\":", placement.layers, ",\"experts\":",
                              placement.experts, ",\"physical\":", placement.physical,
                              ",\"ranks\":", layout.ranks, ",\"nodes\":", layout.nodes);
}

}  // namespace

PlacementFile parse_placement(std::string_view content, int64_t min_experts,
                              std::string_view source) {
  if (min_experts < 0 || min_experts > kMaxExperts) {
    fail(source, ": experts ", min_experts, " is outside [0, ", kMaxExperts, "]");
  }
  if (content.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    fail(source, ": the file is empty (expected a placement: {\"phy2log\": [[...]], ...} or "
         "{\"physical_to_logical_map\": [[...]]})");
  }
  const Json doc = detail::parse_json(
      content, source,
      {.most = kMaxPhysical, .what = "eplb supports at most 1048576 physical slots per layer"});
  static_assert(kMaxPhysical == 1048576, "the message above");
  if (doc.is_object() && doc.contains("phy2log")) return parse_eplb(doc, min_experts, source);
  if (doc.is_object() && doc.contains("physical_to_logical_map")) {
    return parse_sglang(doc, min_experts, source);
  }
  fail(source, ": a placement file is a JSON object with key \"phy2log\" (eplb) or "
       "\"physical_to_logical_map\" (SGLang); found ",
       doc.is_object() ? "keys " + detail::keys_of(doc) : describe(doc));
}

PlacementFile read_placement(const std::string& path, int64_t min_experts) {
  const std::string content = read_file(path);
  return detail::parse_within_memory(path, content.size(),
                                     [&] { return parse_placement(content, min_experts, path); });
}

std::string format_placement(const Placement& placement, const Layout& layout) {
  EPLB_CHECK_EQ(placement.experts, layout.experts, "placement and layout disagree on experts");
  EPLB_CHECK_EQ(placement.physical, layout.physical, "placement and layout disagree on physical");
  placement.validate();
  const int64_t layers = placement.layers;
  const int64_t experts = placement.experts;
  const int64_t physical = placement.physical;
  const int64_t width = placement.max_replicas;
  std::string out = header_of(placement, layout);
  const auto append_row = [&out](const int32_t* row, int64_t n) {
    out += '[';
    for (int64_t i = 0; i < n; ++i) {
      if (i) out += ',';
      out += std::to_string(row[i]);
    }
    out += ']';
  };
  out += ",\"phy2log\":[";
  for (int64_t l = 0; l < layers; ++l) {
    if (l) out += ',';
    append_row(placement.phy2log.data() + l * physical, physical);
  }
  out += "],\"log2phy\":[";
  for (int64_t l = 0; l < layers; ++l) {
    out += l ? ",[" : "[";
    for (int64_t e = 0; e < experts; ++e) {
      if (e) out += ',';
      append_row(placement.log2phy.data() + (l * experts + e) * width, width);
    }
    out += ']';
  }
  out += "],\"replica_count\":[";
  for (int64_t l = 0; l < layers; ++l) {
    if (l) out += ',';
    append_row(placement.replica_count.data() + l * experts, experts);
  }
  out += "]}";
  return out;
}

std::string format_placement_sglang(const Placement& placement) {
  placement.validate();
  std::string out = "{\"physical_to_logical_map\":[";
  for (int64_t l = 0; l < placement.layers; ++l) {
    out += l ? ",[" : "[";
    const int32_t* row = placement.phy2log.data() + l * placement.physical;
    for (int64_t p = 0; p < placement.physical; ++p) {
      if (p) out += ',';
      out += std::to_string(row[p]);
    }
    out += ']';
  }
  out += "]}";
  return out;
}

std::string_view placement_format_name(PlacementFormat format) {
  return format == PlacementFormat::kSglang ? "sglang" : "eplb";
}

PlacementFormat parse_placement_format(std::string_view name) {
  if (name == "eplb") return PlacementFormat::kEplb;
  if (name == "sglang") return PlacementFormat::kSglang;
  fail("placement format ", detail::shown(name), " is not one eplb writes (expected eplb or "
       "sglang)");
}

void write_placement(const std::string& path, const Placement& placement, const Layout& layout,
                     PlacementFormat format) {
  write_file(path, (format == PlacementFormat::kSglang ? format_placement_sglang(placement)
                                                       : format_placement(placement, layout)) +
                       "\n");
}

}  // namespace eplb::stats
