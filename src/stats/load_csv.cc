// CSV matrix loads: one line of loads per layer, comma- or whitespace-separated; written with
// the steps summed.
#include <charconv>
#include <cmath>
#include <system_error>

#include "eplb/core/error.h"
#include "load_formats.h"

namespace eplb::stats::detail {

namespace {

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

}  // namespace

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
  for (size_t i = 0; i < sum.values.size(); ++i) {
    if (!std::isfinite(sum.values[i])) {
      fail("the loads of layer ", static_cast<int64_t>(i) / sum.experts, " expert ",
           static_cast<int64_t>(i) % sum.experts, " sum over ", history.steps,
           " steps past the largest double: csv holds one matrix, the steps' sum; write eplb, "
           "sglang or vllm, which keep the steps");
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

}  // namespace eplb::stats::detail
