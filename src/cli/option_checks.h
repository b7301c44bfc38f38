#pragma once
// The range checks every verb's options share, so that each says the same thing the same way:
// the option, the value given and the range, then what the option means, e.g.
//   --layers 100000 is outside [1, 65536] (MoE layers)
//   --changed nan is not a number in [0, 1] (slot swaps per layer, a fraction of the slots)
// Each throws InvalidArgument (exit 2). They run before anything is sized by the value.

#include <fmt/core.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::cli {

// `what` in parentheses after a message, or nothing.
inline std::string option_meaning(std::string_view what) {
  return what.empty() ? std::string() : fmt::format(" ({})", what);
}

// An integer option in [lo, hi].
inline void check_range(std::string_view flag, int64_t value, int64_t lo, int64_t hi,
                        std::string_view what = {}) {
  if (value < lo || value > hi) {
    fail(flag, " ", value, " is outside [", lo, ", ", hi, "]", option_meaning(what));
  }
}

// A floating-point option: a number (not NaN) in [lo, hi], both finite.
inline void check_number(std::string_view flag, double value, double lo, double hi,
                         std::string_view what = {}) {
  const std::string range = fmt::format("[{:g}, {:g}]", lo, hi);
  if (std::isnan(value)) fail(flag, " nan is not a number in ", range, option_meaning(what));
  if (value < lo || value > hi) {
    fail(flag, " ", fmt::format("{:g}", value), " is outside ", range, option_meaning(what));
  }
}

// A comma-separated list of integers ("8,32,64"). Every item must be one: an empty item ("2," or
// "2,,3") is refused, not dropped as CLI11's delimiter would, since it is a typo for a count
// the user meant to give.
inline std::vector<int> parse_int_list(std::string_view flag, std::string_view text) {
  std::vector<int> out;
  size_t from = 0;
  for (;;) {
    const size_t comma = std::min(text.find(',', from), text.size());
    const std::string_view item = text.substr(from, comma - from);
    int value = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) {
      fail(flag, " '", text, "' is not a list of integers: item ", out.size() + 1, " is ",
           item.empty() ? std::string("empty") : "'" + std::string(item) + "'",
           " (expected counts separated by commas, such as 8,32,64)");
    }
    out.push_back(value);
    if (comma == text.size()) return out;
    from = comma + 1;
  }
}

}  // namespace eplb::cli
