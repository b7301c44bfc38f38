#include "parse_util.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "eplb/core/error.h"

namespace eplb::stats::detail {

namespace {

// nlohmann's messages start "[json.exception.parse_error.101] parse error at line 1, column 11: ";
// keep what comes after the position, which we state ourselves.
std::string_view reason_of(std::string_view what) {
  if (what.starts_with("[json.exception.")) {
    const size_t close = what.find("] ");
    if (close != std::string_view::npos) what.remove_prefix(close + 2);
  }
  if (what.starts_with("parse error")) {
    const size_t colon = what.find(": ");
    if (colon != std::string_view::npos) what.remove_prefix(colon + 2);
  }
  return what;
}

bool contains_nocase(std::string_view haystack, std::string_view needle) {
  return std::search(haystack.begin(), haystack.end(), needle.begin(), needle.end(),
                     [](char a, char b) {
                       return std::tolower(static_cast<unsigned char>(a)) ==
                              std::tolower(static_cast<unsigned char>(b));
                     }) != haystack.end();
}

}  // namespace

Json parse_json(std::string_view content, std::string_view source) {
  try {
    return Json::parse(content.begin(), content.end());
  } catch (const Json::parse_error& e) {
    // e.byte is 1-based: the byte at which the parser gave up.
    const size_t at = std::min<size_t>(e.byte, content.size());
    const size_t from = at >= 8 ? at - 8 : 0;
    const std::string_view near = content.substr(from, 16);
    const bool nonfinite = contains_nocase(near, "nan") || contains_nocase(near, "inf");
    fail(source, ": not valid JSON at byte ", e.byte, ": ", reason_of(e.what()),
         nonfinite ? " (NaN and Infinity are not JSON numbers; loads must be finite)" : "");
  } catch (const Json::exception& e) {
    // Out-of-range numbers (1e999) and the like.
    fail(source, ": not valid JSON: ", reason_of(e.what()));
  }
}

std::string shown(std::string_view text) {
  constexpr size_t kMaxShown = 40;
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f || c == '\'' || c == '\\') {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kMaxShown) out += "...";
  out += "'";
  return out;
}

std::string describe(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return value.get<bool>() ? "true" : "false";
    case Json::value_t::string: return "the string " + shown(value.get_ref<const std::string&>());
    case Json::value_t::array: return value.empty() ? "an empty array" : "an array";
    case Json::value_t::object: return "an object";
    case Json::value_t::number_integer: return std::to_string(value.get<int64_t>());
    case Json::value_t::number_unsigned: return std::to_string(value.get<uint64_t>());
    case Json::value_t::number_float: {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%g", value.get<double>());
      return buf;
    }
    default: return "a binary value";
  }
}

std::string keys_of(const Json& object) {
  std::string out;
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (!out.empty()) out += ", ";
    out += shown(it.key());
  }
  return out.empty() ? "none" : out;
}

int64_t json_integer(const Json& value, std::string_view source, const std::string& path,
                     int64_t lo, int64_t hi) {
  int64_t v = 0;
  if (value.is_number_unsigned()) {
    const auto u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) {
      fail(source, ": ", path, " is ", u, ", expected an integer in [", lo, ", ", hi, "]");
    }
    v = static_cast<int64_t>(u);
  } else if (value.is_number_integer()) {
    v = value.get<int64_t>();
  } else {
    fail(source, ": ", path, " is ", describe(value), ", expected an integer in [", lo, ", ", hi,
         "]");
  }
  if (v < lo || v > hi) {
    fail(source, ": ", path, " is ", v, ", expected an integer in [", lo, ", ", hi, "]");
  }
  return v;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t' || text.front() == '\r')) {
    text.remove_prefix(1);
  }
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) {
    text.remove_suffix(1);
  }
  return text;
}

std::string_view skip_bom(std::string_view text) {
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);
  return text;
}

}  // namespace eplb::stats::detail
