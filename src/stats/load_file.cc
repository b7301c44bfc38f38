// The public entries of eplb/stats/load_file.h: format names and detection, then each read or
// write handed to the file of its format (load_formats.h); the widening to the experts a
// caller gives, and the writers' shared checks.
#include "eplb/stats/load_file.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "load_formats.h"

namespace eplb::stats {

namespace {

using detail::format_load_csv;
using detail::format_load_json;
using detail::format_load_vllm;
using detail::history_of_trace;
using detail::is_blank;
using detail::is_trace_header;
using detail::Json;
using detail::json_format;
using detail::kMaxExperts;
using detail::Lines;
using detail::parse_csv_matrix;
using detail::parse_json_loads;
using detail::parse_trace;
using detail::shown;

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

}  // namespace

namespace detail {

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

}  // namespace detail

// ---------------------------------------------------------------------------------------------

LoadFormat parse_load_format(std::string_view name, std::string_view option) {
  for (size_t i = 0; i < kFormatNames.size(); ++i) {
    if (name == kFormatNames[i]) return static_cast<LoadFormat>(i);
  }
  fail(option, " ", shown(name), " is not a load format (expected auto, eplb, sglang, vllm, csv "
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

LoadFormat detect_load_format(std::string_view content, std::string_view source) {
  const std::string_view body = body_of(content);
  if (body.empty()) fail(source, ": the input is empty");
  if (looks_like_json(body)) {
    return json_format(detail::parse_json(content, source, kLoadRowLimit, kLoadIntegerLimit),
                       source);
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
