#pragma once
// Helpers shared by the stats file parsers (private to src/stats): turning nlohmann-json's
// exceptions into InvalidArgument with a position, quoting user text in messages, and reading
// text line by line.

#include <cstdint>
#include <new>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"

namespace eplb::stats::detail {

using Json = nlohmann::json;

// Expert ids at or above this are corrupt data, not a model (core/types.h); the bound keeps a
// bad file from sizing a huge allocation.
using ::eplb::kMaxExperts;

// The most numbers one JSON array may hold, checked while parsing, before the document is
// built: a row of a million loads is refused after its first `most` + 1 values instead of
// sizing a document of gigabytes. `what` ends the message ("eplb supports at most 65536
// experts per layer").
struct RowLimit {
  int64_t most = 0;  // 0: no limit
  std::string_view what;
};

// The largest number written as an integer (digits only) that an array may hold, checked while
// parsing: above it the number is refused naming its path, where a double would have rounded
// it. An integer too long for 64 bits, which nlohmann reads as a float, is caught by its digits.
// `what` ends the message.
struct IntegerLimit {
  uint64_t most = 0;  // 0: no limit
  std::string_view what;
};

// Parses JSON; any error becomes InvalidArgument "<source>: not valid JSON at byte N ...", a
// row over `limit` or an integer over `integers` InvalidArgument naming its path ("load[0][2]")
// and the limit.
Json parse_json(std::string_view content, std::string_view source, RowLimit limit = {},
                IntegerLimit integers = {});

// A value for a message: strings quoted and cut to a few dozen characters, control bytes
// escaped; other JSON values by kind ("an array", "null", "true").
std::string shown(std::string_view text);
std::string describe(const Json& value);

// The keys of a JSON object, quoted and comma-separated (for "found keys ...").
std::string keys_of(const Json& object);

// An integer in [lo, hi] at `path`, else InvalidArgument naming the path and the range.
int64_t json_integer(const Json& value, std::string_view source, const std::string& path,
                     int64_t lo, int64_t hi);

// parse(), with running out of memory (a large file can need several times its size) said as
// an IoError naming the file, its size and the memory available, not a bare std::bad_alloc.
template <typename F>
auto parse_within_memory(std::string_view path, size_t bytes, F&& parse) {
  try {
    return parse();
  } catch (const std::bad_alloc&) {
    fail<IoError>("out of memory parsing ", path, " (", bytes, " bytes; ",
                  human_bytes(memory_available()), " available)");
  }
}

std::string_view trim(std::string_view text);     // spaces, tabs, CR
std::string_view skip_bom(std::string_view text);  // a leading UTF-8 byte-order mark
bool is_blank(std::string_view line);              // nothing but spaces, tabs, CR

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

}  // namespace eplb::stats::detail
