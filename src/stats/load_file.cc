#include "eplb/stats/load_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <new>
#include <system_error>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "parse_util.h"

namespace eplb::stats {

namespace {

using detail::describe;
using detail::Json;
using detail::kMaxExperts;
using detail::shown;
using detail::trim;

// A trace's history is dense ([tokens][layers][experts]); past this many values (8 GiB) say so
// instead of failing to allocate.
constexpr int64_t kMaxHistoryValues = int64_t{1} << 30;

// A JSON row of numbers is one layer's loads (or a step's, of one layer).
constexpr detail::RowLimit kLoadRowLimit{
    .most = kMaxExperts, .what = "eplb supports at most 65536 experts per layer"};
static_assert(kMaxExperts == 65536, "kLoadRowLimit's message");

// An integer count above kMaxExactLoad is refused rather than rounded (core/types.h).
constexpr detail::IntegerLimit kLoadIntegerLimit{
    .most = static_cast<uint64_t>(kMaxExactLoad),
    .what = " (2^53), the largest integer a double holds exactly; eplb holds loads as doubles "
            "and would round it"};
static_assert(kMaxExactLoad == int64_t{1} << 53, "kLoadIntegerLimit's message");

constexpr std::array<std::string_view, 6> kFormatNames = {"auto", "eplb",  "sglang",
                                                          "vllm", "csv",   "trace"};

// ---------------------------------------------------------------------------------------------
// Text: lines and numbers.

// Yields the lines of a text one by one, numbered from 1, without their line ending.
class Lines {
 public:
  explicit Lines(std::string_view text) : text_(text) {}

  bool next(std::string_view& line) {
    if (pos_ >= text_.size()) return false;
    const size_t end = text_.find('\n', pos_);
    const size_t stop = end == std::string_view::npos ? text_.size() : end;
    line = text_.substr(pos_, stop - pos_);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    pos_ = stop + 1;
    ++number_;
    return true;
  }
  int64_t number() const { return number_; }

 private:
  std::string_view text_;
  size_t pos_ = 0;
  int64_t number_ = 0;
};

bool is_blank(std::string_view line) { return trim(line).empty(); }

// A whole field as a finite, non-negative load; otherwise the reason it is not one.
const char* parse_load_value(std::string_view field, double& out) {
  if (field.empty()) return "is empty, expected a number";
  std::string_view digits = field;
  if (digits.front() == '+') digits.remove_prefix(1);
  if (digits.empty() || digits.front() == '+') return "is not a number";
  const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
  if (ec == std::errc::result_out_of_range) return "is out of range of a double";
  if (ec != std::errc() || ptr != digits.data() + digits.size()) return "is not a number";
  if (!std::isfinite(out)) return "is not finite (loads must be finite, non-negative numbers)";
  if (out < 0) return "is negative (loads must be non-negative)";
  // A count written as an integer is compared exactly (the double may have rounded it down to
  // the bound): above kMaxExactLoad it is refused, not rounded.
  if (out >= static_cast<double>(kMaxExactLoad) &&
      digits.find_first_not_of("0123456789") == std::string_view::npos) {
    uint64_t exact = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), exact);
    if (error != std::errc() || exact > static_cast<uint64_t>(kMaxExactLoad)) {
      return "is an integer above 9007199254740992 (2^53), the largest integer a double holds "
             "exactly; eplb holds loads as doubles and would round it";
    }
  }
  out += 0.0;  // -0 -> +0
  return nullptr;
}

// A whole field as an integer; false when it is not one.
bool parse_integer(std::string_view field, int64_t& out) {
  if (field.empty()) return false;
  const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), out);
  return ec == std::errc() && ptr == field.data() + field.size();
}

// ---------------------------------------------------------------------------------------------
// CSV matrix: one line per layer.

LoadHistory parse_csv_matrix(std::string_view content, std::string_view source) {
  LoadHistory out;
  out.format = LoadFormat::kCsv;
  Lines lines(detail::skip_bom(content));
  std::string_view line;
  char delimiter = 0;  // ',' or ' ' (whitespace-separated, as numpy.savetxt writes by default)
  int64_t first_line = 0;
  while (lines.next(line)) {
    const std::string_view body = trim(line);
    if (body.empty() || body.front() == '#') continue;  // blank lines and comments
    if (delimiter == 0) {
      delimiter = body.find(',') != std::string_view::npos ? ',' : ' ';
      first_line = lines.number();
    }
    int64_t column = 0;
    size_t pos = 0;
    while (pos <= body.size()) {
      std::string_view field;
      if (delimiter == ',') {
        const size_t comma = body.find(',', pos);
        const size_t stop = comma == std::string_view::npos ? body.size() : comma;
        field = trim(body.substr(pos, stop - pos));
        pos = stop + 1;
      } else {
        while (pos < body.size() && (body[pos] == ' ' || body[pos] == '\t')) ++pos;
        if (pos == body.size()) break;
        size_t stop = pos;
        while (stop < body.size() && body[stop] != ' ' && body[stop] != '\t') ++stop;
        field = body.substr(pos, stop - pos);
        pos = stop;
      }
      ++column;
      if (column > kMaxExperts) {
        fail(source, " line ", lines.number(), " has more than ", kMaxExperts,
             " loads; eplb supports at most ", kMaxExperts, " experts per layer");
      }
      double value = 0;
      if (const char* why = parse_load_value(field, value)) {
        fail(source, " line ", lines.number(), ", column ", column, ": ", shown(field), " ", why);
      }
      out.values.push_back(value);
    }
    if (out.layers == 0) {
      out.experts = column;
    } else if (column != out.experts) {
      fail(source, " line ", lines.number(), " has ", column, " loads, expected ", out.experts,
           " (as line ", first_line, "): every layer needs one load per expert");
    }
    ++out.layers;
  }
  if (out.layers == 0) {
    fail(source, ": no loads found (expected one line of comma-separated loads per layer)");
  }
  out.steps = 1;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Routing trace: "layer,token,experts,weights".

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

struct TraceRow {
  int64_t token = 0;
  int64_t line = 0;
  size_t offset = 0;  // into the flat buffer of expert ids
};

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

// ---------------------------------------------------------------------------------------------
// JSON formats.

// Collects [layers][experts] matrices (one per step) from a JSON document, checking that each
// is a non-empty array of equally long arrays of non-negative numbers, and that every step has
// the shape of the first. Paths ("load[2][1]") are only built for messages.
class MatrixReader {
 public:
  explicit MatrixReader(std::string_view source) : source_(source) {}

  void add(const Json& matrix, const std::string& path) {
    if (!matrix.is_array() || matrix.empty()) {
      fail(source_, ": ", path, " is ", describe(matrix),
           ", expected an array of layers, each an array of loads per expert");
    }
    const auto layers = static_cast<int64_t>(matrix.size());
    if (steps_ == 0) {
      layers_ = layers;
      first_ = path;
    } else if (layers != layers_) {
      fail(source_, ": ", path, " has ", layers, " layers, expected ", layers_, " (as ", first_,
           ")");
    }
    for (int64_t l = 0; l < layers; ++l) {
      const Json& row = matrix[static_cast<size_t>(l)];
      if (!row.is_array() || row.empty()) {
        fail(source_, ": ", path, "[", l, "] is ", describe(row),
             ", expected an array of loads, one per expert");
      }
      const auto experts = static_cast<int64_t>(row.size());
      if (steps_ == 0 && l == 0) {
        experts_ = experts;
      } else if (experts != experts_) {
        fail(source_, ": ", path, "[", l, "] has ", experts, " experts, expected ", experts_,
             " (as ", first_, "[0])");
      }
      for (int64_t e = 0; e < experts; ++e) {
        const Json& value = row[static_cast<size_t>(e)];
        double v = 0;
        if (value.is_number_unsigned()) {
          v = static_cast<double>(value.get<uint64_t>());
        } else if (value.is_number_integer()) {
          v = static_cast<double>(value.get<int64_t>());
        } else if (value.is_number_float()) {
          v = value.get<double>();
        } else {
          fail(source_, ": ", path, "[", l, "][", e, "] is ", describe(value),
               ", expected a non-negative number");
        }
        if (!std::isfinite(v) || v < 0) {
          fail(source_, ": ", path, "[", l, "][", e, "] is ", describe(value),
               " (loads must be finite, non-negative numbers)");
        }
        values_.push_back(v + 0.0);
      }
    }
    ++steps_;
  }

  // A value that holds either one matrix or an array of them (steps).
  void add_matrix_or_steps(const Json& value, const std::string& path) {
    const bool steps = value.is_array() && !value.empty() && value[0].is_array() &&
                       !value[0].empty() && value[0][0].is_array();
    if (!steps) {
      add(value, path);
      return;
    }
    for (size_t s = 0; s < value.size(); ++s) {
      add(value[s], path + "[" + std::to_string(s) + "]");
    }
  }

  LoadHistory finish(LoadFormat format) {
    LoadHistory out;
    out.format = format;
    out.steps = steps_;
    out.layers = layers_;
    out.experts = experts_;
    out.values = std::move(values_);
    return out;
  }

 private:
  std::string_view source_;
  int64_t steps_ = 0;
  int64_t layers_ = 0;
  int64_t experts_ = 0;
  std::string first_;           // the path of the first matrix, for messages
  std::vector<double> values_;  // [steps][layers][experts]
};

std::string_view key_of(LoadFormat format) {
  switch (format) {
    case LoadFormat::kEplb: return "load";
    case LoadFormat::kSglang: return "logical_count";
    case LoadFormat::kVllm: return "load_history";
    default: return "";
  }
}

// The format of a parsed JSON document, by its keys ("load" first).
LoadFormat json_format(const Json& doc, std::string_view source) {
  if (!doc.is_object()) {
    fail(source, ": a JSON load file is an object with key \"load\", \"logical_count\" or "
         "\"load_history\", not ", describe(doc));
  }
  for (const LoadFormat format : {LoadFormat::kEplb, LoadFormat::kSglang, LoadFormat::kVllm}) {
    if (doc.contains(key_of(format))) return format;
  }
  fail(source, ": a JSON load file needs key \"load\" (eplb), \"logical_count\" (SGLang) or "
       "\"load_history\" (vLLM); found keys ", detail::keys_of(doc));
}

LoadHistory parse_json_loads(const Json& doc, LoadFormat format, std::string_view source) {
  const std::string_view key = key_of(format);
  if (!doc.is_object() || !doc.contains(key)) {
    fail(source, ": as ", load_format_name(format), " loads, expected a JSON object with key \"",
         key, "\"; found ", doc.is_object() ? "keys " + detail::keys_of(doc) : describe(doc));
  }
  const Json& value = doc[std::string(key)];
  MatrixReader reader(source);
  if (format == LoadFormat::kVllm) {
    if (!value.is_array() || value.empty()) {
      fail(source, ": load_history is ", describe(value),
           ", expected an array of {\"logical_expert_load\": [[...]]}, one per step");
    }
    for (size_t s = 0; s < value.size(); ++s) {
      const std::string path = "load_history[" + std::to_string(s) + "]";
      const Json& entry = value[s];
      if (!entry.is_object() || !entry.contains("logical_expert_load")) {
        fail(source, ": ", path, " is ", describe(entry),
             " without key \"logical_expert_load\", expected {\"logical_expert_load\": "
             "[[...]]}");
      }
      reader.add(entry["logical_expert_load"], path + ".logical_expert_load");
    }
  } else {
    reader.add_matrix_or_steps(value, std::string(key));
  }
  return reader.finish(format);
}

bool looks_like_json(std::string_view body) {
  return !body.empty() && (body.front() == '{' || body.front() == '[');
}

std::string_view first_line(std::string_view body) {
  Lines lines(body);
  std::string_view line;
  while (lines.next(line)) {
    if (!is_blank(line)) return line;
  }
  return {};
}

// The body of a file: without a byte-order mark and leading whitespace.
std::string_view body_of(std::string_view content) {
  content = detail::skip_bom(content);
  const size_t start = content.find_first_not_of(" \t\r\n");
  return start == std::string_view::npos ? std::string_view() : content.substr(start);
}

void check_shape(const LoadHistory& history) {
  EPLB_CHECK(history.steps > 0 && history.layers > 0 && history.experts > 0 &&
                 history.values.size() ==
                     static_cast<size_t>(history.steps * history.layers * history.experts),
             "load history shape ", history.steps, " x ", history.layers, " x ", history.experts,
             " does not match its ", history.values.size(), " values");
}

// The shortest text that reads back as `v`. Above kMaxExactLoad in scientific notation: the
// shortest text of such a double can be all digits (9223372036854775808), which would claim an
// exact integer count the double does not hold, and which the readers refuse.
void append_number(std::string& out, double v) {
  if (!std::isfinite(v)) fail("cannot write the load ", v, " (loads must be finite)");
  char buf[32];
  const auto [ptr, ec] =
      v > static_cast<double>(kMaxExactLoad)
          ? std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific)
          : std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, ptr);
}

// One matrix [layers][experts] as JSON rows.
void append_matrix(std::string& out, const LoadHistory& history, const double* matrix) {
  out += '[';
  for (int64_t l = 0; l < history.layers; ++l) {
    out += l ? ",[" : "[";
    const double* row = matrix + l * history.experts;
    for (int64_t e = 0; e < history.experts; ++e) {
      if (e) out += ',';
      append_number(out, row[e]);
    }
    out += ']';
  }
  out += ']';
}

// {"key": [L][E]} when `flat` (one step), {"key": [steps][L][E]} otherwise.
std::string format_load_json(const LoadHistory& history, std::string_view key, bool flat) {
  check_shape(history);
  std::string out;
  out.reserve(static_cast<size_t>(history.values.size() * 4 + 32));
  out += "{\"";
  out += key;
  out += "\":";
  if (flat && history.steps == 1) {
    append_matrix(out, history, history.step(0));
  } else {
    out += '[';
    for (int64_t s = 0; s < history.steps; ++s) {
      if (s) out += ',';
      append_matrix(out, history, history.step(s));
    }
    out += ']';
  }
  out += "}\n";
  return out;
}

std::string format_load_vllm(const LoadHistory& history) {
  check_shape(history);
  std::string out;
  out.reserve(static_cast<size_t>(history.values.size() * 4 + 32 * history.steps + 32));
  out += "{\"load_history\":[";
  for (int64_t s = 0; s < history.steps; ++s) {
    out += s ? ",\n{\"logical_expert_load\":" : "{\"logical_expert_load\":";
    append_matrix(out, history, history.step(s));
    out += '}';
  }
  out += "]}\n";
  return out;
}

std::string format_load_csv(const LoadHistory& history) {
  check_shape(history);
  const LoadMatrix sum = history.sum();
  // A sum of integer counts past kMaxExactLoad may have been rounded (even down to it): refused,
  // since the steps it came from can be written exactly in the formats that keep them. The
  // exact sum of counts (each at most 2^53) is taken until it passes 2^53, so it fits 64 bits.
  // Loads written as decimals or above 2^53 (1e20) are floats, summed as such.
  if (history.steps > 1) {
    constexpr auto kExact = static_cast<double>(kMaxExactLoad);
    for (size_t i = 0; i < sum.values.size(); ++i) {
      if (!(sum.values[i] >= kExact)) continue;
      bool counts = true;
      uint64_t exact = 0;
      for (int64_t s = 0; s < history.steps && counts; ++s) {
        const double v = history.step(s)[i];
        counts = v == std::floor(v) && v <= kExact;
        if (counts) exact += static_cast<uint64_t>(v);
        if (exact > static_cast<uint64_t>(kMaxExactLoad)) break;
      }
      if (counts && exact > static_cast<uint64_t>(kMaxExactLoad)) {
        fail("the counts of layer ", static_cast<int64_t>(i) / sum.experts, " expert ",
             static_cast<int64_t>(i) % sum.experts, " sum over ", history.steps,
             " steps past 9007199254740992 (2^53), the largest integer a double holds exactly: "
             "csv would hold their rounded sum; write eplb, sglang or vllm, which keep the steps");
      }
    }
  }
  std::string out;
  out.reserve(static_cast<size_t>(sum.values.size() * 4 + 64));
  for (int64_t l = 0; l < sum.layers; ++l) {
    for (int64_t e = 0; e < sum.experts; ++e) {
      if (e) out += ',';
      append_number(out, sum.values[static_cast<size_t>(l * sum.experts + e)]);
    }
    out += '\n';
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

LoadFormat parse_load_format(std::string_view name) {
  for (size_t i = 0; i < kFormatNames.size(); ++i) {
    if (name == kFormatNames[i]) return static_cast<LoadFormat>(i);
  }
  fail("--format ", shown(name), " is not a load format (expected auto, eplb, sglang, vllm, csv "
       "or trace)");
}

std::string_view load_format_name(LoadFormat format) {
  const auto i = static_cast<size_t>(format);
  return i < kFormatNames.size() ? kFormatNames[i] : "unknown";
}

LoadMatrix LoadHistory::sum() const {
  LoadMatrix out(layers, experts);
  const size_t per_step = out.values.size();
  for (int64_t s = 0; s < steps; ++s) {
    const double* src = values.data() + static_cast<size_t>(s) * per_step;
    for (size_t i = 0; i < per_step; ++i) out.values[i] += src[i];
  }
  return out;
}

LoadFormat detect_load_format(std::string_view content) {
  const std::string_view body = body_of(content);
  if (body.empty()) fail("the input is empty");
  if (looks_like_json(body)) {
    return json_format(detail::parse_json(content, "<input>", kLoadRowLimit, kLoadIntegerLimit),
                       "<input>");
  }
  return is_trace_header(first_line(body)) ? LoadFormat::kTrace : LoadFormat::kCsv;
}

LoadHistory parse_load_history(std::string_view content, const LoadReadOptions& options,
                               std::string_view source) {
  if (options.experts < 0 || options.experts > kMaxExperts) {
    fail("experts ", options.experts, " is outside [0, ", kMaxExperts, "]");
  }
  const std::string_view body = body_of(content);
  if (body.empty()) {
    fail(source, ": the file is empty (expected a JSON object of loads, CSV lines of loads, or "
         "a routing trace)");
  }
  LoadFormat format = options.format;
  LoadHistory out;
  const bool json = format == LoadFormat::kAuto
                        ? looks_like_json(body)
                        : (format == LoadFormat::kEplb || format == LoadFormat::kSglang ||
                           format == LoadFormat::kVllm);
  if (json) {
    // Whole: byte offsets are the file's.
    const Json doc = detail::parse_json(content, source, kLoadRowLimit, kLoadIntegerLimit);
    if (format == LoadFormat::kAuto) format = json_format(doc, source);
    out = parse_json_loads(doc, format, source);
  } else {
    if (format == LoadFormat::kAuto) {
      format = is_trace_header(first_line(body)) ? LoadFormat::kTrace : LoadFormat::kCsv;
    }
    if (format == LoadFormat::kTrace) {
      out = history_of_trace(parse_trace(content, options.experts, source), source);
    } else {
      out = parse_csv_matrix(content, source);
    }
  }
  // Step last: widen to the experts the caller knows of (zero load for those never seen).
  if (options.experts > 0 && out.experts > options.experts) {
    fail(source, ": ", out.experts, " experts per layer, more than the ", options.experts,
         " given");
  }
  if (options.experts > out.experts) {
    const int64_t values = checked_mul(checked_mul(out.steps, out.layers, "steps x layers"),
                                       options.experts, "the widened load history");
    check_fits_in_memory(
        checked_mul(values, 8, "the widened load history"),
        eplb::detail::concat(source, " widened to ", options.experts, " experts (", out.steps,
                             " steps x ", out.layers, " layers)"),
        "");
    std::vector<double> wide(static_cast<size_t>(values), 0.0);
    for (int64_t r = 0; r < out.steps * out.layers; ++r) {
      std::copy_n(out.values.begin() + r * out.experts, out.experts,
                  wide.begin() + r * options.experts);
    }
    out.values = std::move(wide);
    out.experts = options.experts;
  }
  return out;
}

RoutingTrace parse_routing_trace(std::string_view content, int64_t given_experts,
                                 std::string_view source) {
  if (body_of(content).empty()) {
    fail(source, ": the file is empty (expected a routing trace 'layer,token,experts,weights')");
  }
  return parse_trace(content, given_experts, source);
}

std::string read_file(const std::string& path) {
  // A device is refused before it is opened (opening some has effects of its own).
  const auto refuse = [&](const struct stat& st) {
    const char* refused = S_ISDIR(st.st_mode)   ? "a directory"
                          : S_ISCHR(st.st_mode) ? "a character device"
                          : S_ISBLK(st.st_mode) ? "a block device"
                                                : nullptr;
    if (refused != nullptr) {
      fail(path, " is ", refused, ", not a file (give a regular file, or a pipe of at most ",
           kMaxStreamBytes >> 30, " GiB)");
    }
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) refuse(st);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) fail<IoError>("cannot open ", path, ": ", std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } closer{fd};
  if (::fstat(fd, &st) != 0) fail<IoError>("cannot stat ", path, ": ", std::strerror(errno));
  refuse(st);
  // A pipe, FIFO or socket has no size to check first: read it up to a limit.
  const bool regular = S_ISREG(st.st_mode);
  std::string out;
  size_t got = 0;
  try {
    if (regular && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n > 0) {
        out.append(buf, static_cast<size_t>(n));
        got += static_cast<size_t>(n);
        if (!regular && got > static_cast<size_t>(kMaxStreamBytes)) {
          fail(path, " is a stream longer than ", kMaxStreamBytes >> 30,
               " GiB, the most eplb reads from a pipe (save it to a file, which may be of any "
               "size)");
        }
      } else if (n == 0) {
        break;
      } else if (errno != EINTR) {
        fail<IoError>("cannot read ", path, ": ", std::strerror(errno));
      }
    }
  } catch (const std::bad_alloc&) {
    fail<IoError>("out of memory reading ", path, " after ", got, " bytes",
                  regular ? eplb::detail::concat(" of ", st.st_size) : std::string());
  }
  return out;
}

LoadHistory read_load_history(const std::string& path, const LoadReadOptions& options) {
  const std::string content = read_file(path);
  return detail::parse_within_memory(path, content.size(),
                             [&] { return parse_load_history(content, options, path); });
}

LoadMatrix read_load(const std::string& path, const LoadReadOptions& options) {
  LoadMatrix load = read_load_history(path, options).sum();
  // Every value is finite, but a sum over many steps of huge ones need not be.
  for (int64_t i = 0; i < load.layers * load.experts; ++i) {
    if (!std::isfinite(load.values[i])) {
      fail(path, ": the load of layer ", i / load.experts, " expert ", i % load.experts,
           " summed over steps is too large for a double");
    }
  }
  return load;
}

RoutingTrace read_routing_trace(const std::string& path, int64_t given_experts) {
  const std::string content = read_file(path);
  return detail::parse_within_memory(path, content.size(),
                             [&] { return parse_routing_trace(content, given_experts, path); });
}

void write_file(const std::string& path, std::string_view text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail<IoError>("cannot write ", path, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail<IoError>("cannot write ", path, ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) fail<IoError>("cannot write ", path, ": ", std::strerror(errno));
}

std::string format_load(const LoadHistory& history, LoadFormat format) {
  switch (format) {
    case LoadFormat::kEplb: return format_load_json(history, "load", false);
    case LoadFormat::kSglang: return format_load_json(history, "logical_count", true);
    case LoadFormat::kVllm: return format_load_vllm(history);
    case LoadFormat::kCsv: return format_load_csv(history);
    case LoadFormat::kAuto:
    case LoadFormat::kTrace: break;
  }
  fail("cannot write loads as ", load_format_name(format),
       " (loads are written as eplb, sglang, vllm or csv; a routing trace keeps tokens, which "
       "loads no longer have)");
}

std::string format_load_eplb(const LoadHistory& history) {
  return format_load(history, LoadFormat::kEplb);
}

std::string format_load_sglang(const LoadHistory& history) {
  return format_load(history, LoadFormat::kSglang);
}

}  // namespace eplb::stats
