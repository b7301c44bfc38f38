// Routing traces "layer,token,experts,weights": the top-k experts of every token of every layer,
// and the load history they make (one step per token).
#include <algorithm>
#include <array>
#include <charconv>
#include <map>
#include <system_error>
#include <vector>

#include "eplb/core/error.h"
#include "load_formats.h"

namespace eplb::stats::detail {

namespace {

// A trace's history is dense ([tokens][layers][experts]); past this many values (8 GiB) say so
// instead of failing to allocate.
constexpr int64_t kMaxHistoryValues = int64_t{1} << 30;

// A whole field as an integer; false when it is not one.
bool parse_integer(std::string_view field, int64_t& out) {
  if (field.empty()) return false;
  const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), out);
  return ec == std::errc() && ptr == field.data() + field.size();
}

struct TraceRow {
  int64_t token = 0;
  int64_t line = 0;
  size_t offset = 0;  // into the flat buffer of expert ids
};

}  // namespace

bool is_trace_header(std::string_view line) {
  std::array<std::string_view, 3> names;
  size_t pos = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const size_t comma = line.find(',', pos);
    if (comma == std::string_view::npos && i + 1 < names.size()) return false;
    const size_t stop = comma == std::string_view::npos ? line.size() : comma;
    names[i] = trim(line.substr(pos, stop - pos));
    pos = stop + 1;
  }
  return names[0] == "layer" && names[1] == "token" && names[2] == "experts";
}

RoutingTrace parse_trace(std::string_view content, int64_t given_experts, std::string_view source) {
  if (given_experts < 0 || given_experts > kMaxExperts) {
    fail(source, ": experts ", given_experts, " is outside [0, ", kMaxExperts, "]");
  }
  Lines lines(detail::skip_bom(content));
  std::string_view line;
  bool header = false;
  while (lines.next(line)) {
    if (is_blank(line)) continue;
    if (!is_trace_header(line)) {
      fail(source, " line ", lines.number(), ": expected the header 'layer,token,experts,weights' "
           "of a routing trace, got ", shown(trim(line)));
    }
    header = true;
    break;
  }
  if (!header) fail(source, ": the routing trace is empty (expected 'layer,token,experts,weights')");

  // Step 1: read the rows, grouped by layer number.
  std::map<int64_t, std::vector<TraceRow>> layers;
  std::vector<int32_t> ids;
  std::vector<int32_t> sorted;
  int64_t top_k = -1;
  int64_t k_line = 0;
  int32_t largest = -1;
  while (lines.next(line)) {
    if (is_blank(line)) continue;
    std::array<std::string_view, 3> fields;
    size_t pos = 0;
    for (size_t i = 0; i < fields.size(); ++i) {
      const size_t comma = line.find(',', pos);
      if (comma == std::string_view::npos && i + 1 < fields.size()) {
        fail(source, " line ", lines.number(), " has ", i + 1,
             " columns, expected layer,token,experts[,weights]");
      }
      const size_t stop = comma == std::string_view::npos ? line.size() : comma;
      fields[i] = trim(line.substr(pos, stop - pos));
      pos = stop + 1;
    }
    // Weights (and anything after them) are not needed for loads: ignored.
    int64_t layer = 0;
    int64_t token = 0;
    if (!parse_integer(fields[0], layer)) {
      fail(source, " line ", lines.number(), ", column 1: layer ", shown(fields[0]),
           " is not an integer");
    }
    if (!parse_integer(fields[1], token)) {
      fail(source, " line ", lines.number(), ", column 2: token ", shown(fields[1]),
           " is not an integer");
    }
    std::string_view list = fields[2];
    if (list.size() >= 2 && list.front() == '"' && list.back() == '"') {
      list = trim(list.substr(1, list.size() - 2));
    }
    const size_t offset = ids.size();
    size_t at = 0;
    while (at < list.size()) {
      if (list[at] == ' ' || list[at] == '\t') {
        ++at;
        continue;
      }
      size_t stop = at;
      while (stop < list.size() && list[stop] != ' ' && list[stop] != '\t') ++stop;
      const std::string_view item = list.substr(at, stop - at);
      int64_t id = 0;
      if (!parse_integer(item, id) || id < 0 || id >= kMaxExperts) {
        fail(source, " line ", lines.number(), ", column 3: expert ", shown(item),
             " is not an expert id (expected integers in [0, ", kMaxExperts,
             ") separated by spaces)");
      }
      if (given_experts > 0 && id >= given_experts) {
        fail(source, " line ", lines.number(), ", column 3: expert ", id, " is outside [0, ",
             given_experts, "), the ", given_experts, " experts per layer given");
      }
      ids.push_back(static_cast<int32_t>(id));
      largest = std::max(largest, static_cast<int32_t>(id));
      at = stop;
    }
    const auto k = static_cast<int64_t>(ids.size() - offset);
    if (k == 0) {
      fail(source, " line ", lines.number(),
           ", column 3: no experts listed (expected the token's top-k expert ids separated by "
           "spaces)");
    }
    sorted.assign(ids.begin() + static_cast<ptrdiff_t>(offset), ids.end());
    std::sort(sorted.begin(), sorted.end());
    if (const auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
      fail(source, " line ", lines.number(), ", column 3: expert ", *dup,
           " is listed twice (a token's top-k experts are distinct)");
    }
    if (top_k < 0) {
      top_k = k;
      k_line = lines.number();
    } else if (k != top_k) {
      fail(source, " line ", lines.number(), ": token ", token, " of layer ", layer, " lists ", k,
           " experts, expected ", top_k, " (as line ", k_line, "): every token needs the same k");
    }
    layers[layer].push_back({token, lines.number(), offset});
  }
  if (layers.empty()) fail(source, ": the routing trace has a header but no rows");

  // Step 2: order each layer's tokens and check every layer lists the same ones.
  for (auto& [number, rows] : layers) {
    std::stable_sort(rows.begin(), rows.end(),
                     [](const TraceRow& a, const TraceRow& b) { return a.token < b.token; });
    for (size_t i = 1; i < rows.size(); ++i) {
      if (rows[i].token == rows[i - 1].token) {
        fail(source, ": layer ", number, " lists token ", rows[i].token, " twice (lines ",
             rows[i - 1].line, " and ", rows[i].line, ")");
      }
    }
  }
  const auto& [first_layer, first] = *layers.begin();
  for (const auto& [number, rows] : layers) {
    for (size_t i = 0; i < rows.size() && i < first.size(); ++i) {
      if (rows[i].token != first[i].token) {
        const bool missing = rows[i].token > first[i].token;
        const int64_t token = missing ? first[i].token : rows[i].token;
        fail(source, ": layer ", missing ? number : first_layer, " has no token ", token,
             " but layer ", missing ? first_layer : number,
             " has it (every layer must list the same tokens)");
      }
    }
    if (rows.size() != first.size()) {
      fail(source, ": layer ", number, " has ", rows.size(), " tokens, expected ", first.size(),
           " (as layer ", first_layer, "): every layer must list the same tokens");
    }
  }

  // Step 3: lay the routes out as [layers][tokens][top_k], layers renumbered in order.
  RoutingTrace out;
  out.layers = static_cast<int64_t>(layers.size());
  out.tokens = static_cast<int64_t>(first.size());
  out.top_k = top_k;
  out.experts = std::max<int64_t>(largest + 1, given_experts);
  out.layer_ids.reserve(layers.size());
  out.routes.reserve(static_cast<size_t>(out.layers * out.tokens * out.top_k));
  for (const auto& [number, rows] : layers) {
    out.layer_ids.push_back(number);
    for (const TraceRow& row : rows) {
      const auto begin = ids.begin() + static_cast<ptrdiff_t>(row.offset);
      out.routes.insert(out.routes.end(), begin, begin + top_k);
    }
  }
  return out;
}

LoadHistory history_of_trace(const RoutingTrace& trace, std::string_view source) {
  const int64_t per_step = trace.layers * trace.experts;
  if (trace.tokens > kMaxHistoryValues / per_step) {
    fail(source, ": a load history of ", trace.tokens, " tokens x ", trace.layers, " layers x ",
         trace.experts, " experts is over the limit of ", kMaxHistoryValues,
         " values (read a shorter trace)");
  }
  LoadHistory out;
  out.format = LoadFormat::kTrace;
  out.steps = trace.tokens;
  out.layers = trace.layers;
  out.experts = trace.experts;
  out.values.assign(static_cast<size_t>(out.steps * per_step), 0.0);
  for (int64_t l = 0; l < trace.layers; ++l) {
    for (int64_t t = 0; t < trace.tokens; ++t) {
      const int32_t* route = trace.routes.data() + (l * trace.tokens + t) * trace.top_k;
      double* row = out.values.data() + (t * trace.layers + l) * trace.experts;
      for (int64_t i = 0; i < trace.top_k; ++i) row[route[i]] += 1.0;
    }
  }
  return out;
}

}  // namespace eplb::stats::detail
