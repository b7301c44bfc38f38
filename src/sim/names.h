#pragma once
// The sim layer's comma-separated lists of names (--policy, --dispatch): one parser, so that
// every list reports the same errors.

#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::sim::detail {

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

// "a, b,c" -> {"a", "b", "c"}, trimmed of spaces. An empty list, an empty name or a name given
// twice throws InvalidArgument naming it, `what` (e.g. "policy") and `choices`.
inline std::vector<std::string_view> split_names(std::string_view list, std::string_view what,
                                                 std::string_view choices) {
  if (trim(list).empty()) {
    fail("no ", what, " given (expected a comma-separated list of ", choices, ")");
  }
  std::vector<std::string_view> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string_view name = trim(list.substr(at, comma - at));
    if (name.empty()) {
      fail(what, " list '", list, "' has an empty name (expected a comma-separated list of ",
           choices, ")");
    }
    for (const std::string_view seen : out) {
      if (seen == name) fail(what, " '", name, "' is listed twice in '", list, "'");
    }
    out.push_back(name);
    at = comma + 1;
  }
  return out;
}

}  // namespace eplb::sim::detail
