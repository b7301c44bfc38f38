#include "parse_util.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <unordered_set>
#include <vector>

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

// nlohmann's DOM builder with a callback, which also keeps the text of a number it read as a
// float although it is written as an integer (digits only: one too long for 64 bits), for the
// callback (RowCounter) to refuse it with its path: it is called for that value right after.
class IntegerAwareBuilder : public nlohmann::detail::json_sax_dom_callback_parser<Json> {
 public:
  IntegerAwareBuilder(Json& result, Json::parser_callback_t on_event, std::string& long_integer)
      : json_sax_dom_callback_parser(result, std::move(on_event), true),
        long_integer_(long_integer) {}

  // Hides the base's: nlohmann's parser is a template over the builder's type.
  bool number_float(double value, const std::string& text) {
    long_integer_.clear();
    if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos) {
      long_integer_ = text;
    }
    return json_sax_dom_callback_parser::number_float(value, text);
  }

 private:
  std::string& long_integer_;
};

// Counts the numbers of every open array while nlohmann's parser runs (its callback sees
// every event in document order) and throws once one passes the limit, once an array holds
// an integer above `integers`, or once an object repeats a key (nlohmann would keep the last
// value silently: which of two "load" arrays the file meant is a guess).
class RowCounter {
 public:
  RowCounter(std::string_view source, RowLimit limit, IntegerLimit integers,
             const std::string* long_integer)
      : source_(source), limit_(limit), integers_(integers), long_integer_(long_integer) {}

  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (!open_.empty()) ++open_.back().index;  // a container is an element too
        open_.push_back({event == Json::parse_event_t::array_start, -1, pending_key_, 0, {}});
        pending_key_.clear();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!open_.empty()) open_.pop_back();
        break;
      case Json::parse_event_t::key:
        if (parsed.is_string()) {
          pending_key_ = parsed.get<std::string>();
          if (!open_.empty() && !open_.back().keys.insert(pending_key_).second) {
            const std::string where = path();
            fail(source_, ": the key ", shown(pending_key_), " appears twice in ",
                 where == "an array" ? "the top-level object" : where,
                 " (each key may appear once)");
          }
        }
        break;
      case Json::parse_event_t::value:
        if (open_.empty()) break;
        ++open_.back().index;
        if (!open_.back().array || !parsed.is_number()) break;
        if (limit_.most > 0 && ++open_.back().numbers > limit_.most) {
          fail(source_, ": ", path(), " holds more than ", limit_.most, " numbers; ",
               limit_.what);
        }
        if (integers_.most > 0) check_integer(parsed);
        break;
    }
    return true;
  }

 private:
  void check_integer(const Json& parsed) const {
    std::string written;
    if (parsed.is_number_unsigned() && parsed.get<uint64_t>() > integers_.most) {
      written = std::to_string(parsed.get<uint64_t>());
    } else if (parsed.is_number_float() && long_integer_ != nullptr && !long_integer_->empty()) {
      written = *long_integer_;
    }
    if (written.empty()) return;
    fail(source_, ": ", path(), "[", open_.back().index, "] is ",
         written.size() > 40 ? written.substr(0, 40) + "..." : written, ", above ",
         integers_.most, integers_.what);
  }

  struct Open {
    bool array = false;
    int64_t index = -1;  // of the element being parsed
    std::string key;     // the key this container is the value of (in an object)
    int64_t numbers = 0;
    std::unordered_set<std::string> keys;  // an object's keys so far
  };

  // "load[0][2]": the keys and indices down to the innermost open array.
  std::string path() const {
    std::string out;
    for (size_t i = 0; i < open_.size(); ++i) {
      if (!open_[i].key.empty()) out += (out.empty() ? "" : ".") + open_[i].key;
      if (i + 1 < open_.size() && open_[i].array) {
        out += "[" + std::to_string(open_[i].index) + "]";
      }
    }
    return out.empty() ? "an array" : out;
  }

  std::string_view source_;
  RowLimit limit_;
  IntegerLimit integers_;
  const std::string* long_integer_;  // IntegerAwareBuilder's, or null
  std::vector<Open> open_;
  std::string pending_key_;
};

Json parse_json(std::string_view content, std::string_view source, RowLimit limit,
                IntegerLimit integers) {
  try {
    if (integers.most > 0) {
      Json result;
      std::string long_integer;
      IntegerAwareBuilder builder(result, RowCounter(source, limit, integers, &long_integer),
                                  long_integer);
      Json::sax_parse(content.begin(), content.end(), &builder);
      return result;
    }
    if (limit.most > 0) {
      return Json::parse(content.begin(), content.end(), RowCounter(source, limit, {}, nullptr));
    }
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

bool is_blank(std::string_view line) { return trim(line).empty(); }

}  // namespace eplb::stats::detail
