#pragma once
// Helpers shared by the stats file parsers (private to src/stats): turning nlohmann-json's
// exceptions into InvalidArgument with a position, and quoting user text in messages.

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace eplb::stats::detail {

using Json = nlohmann::json;

// Expert ids at or above this are corrupt data, not a model (the largest models have a few
// hundred experts per layer); the bound keeps a bad file from sizing a huge allocation.
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;

// Parses JSON; any error becomes InvalidArgument "<source>: not valid JSON at byte N ...".
Json parse_json(std::string_view content, std::string_view source);

// A value for a message: strings quoted and cut to a few dozen characters, control bytes
// escaped; other JSON values by kind ("an array", "null", "true").
std::string shown(std::string_view text);
std::string describe(const Json& value);

// The keys of a JSON object, quoted and comma-separated (for "found keys ...").
std::string keys_of(const Json& object);

// An integer in [lo, hi] at `path`, else InvalidArgument naming the path and the range.
int64_t json_integer(const Json& value, std::string_view source, const std::string& path,
                     int64_t lo, int64_t hi);

std::string_view trim(std::string_view text);     // spaces, tabs, CR
std::string_view skip_bom(std::string_view text);  // a leading UTF-8 byte-order mark

}  // namespace eplb::stats::detail
