// eplb, SGLang and vLLM JSON loads: reading a parsed document's [layers][experts] matrices
// (one per step) under the format's key, and writing them back.
#include <cmath>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "load_formats.h"

namespace eplb::stats::detail {

namespace {

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

}  // namespace

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

}  // namespace eplb::stats::detail
