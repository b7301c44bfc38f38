#pragma once
// The load file formats, one file each (private to src/stats); load_file.cc detects the format,
// calls these and holds the public entries (eplb/stats/load_file.h).
//   load_json.cc   eplb, SGLang and vLLM JSON: one reader, the formats differ in their key
//   load_csv.cc    CSV matrix, one line of loads per layer
//   load_trace.cc  routing trace CSV "layer,token,experts,weights"

#include <cstdint>
#include <string>
#include <string_view>

#include "eplb/stats/load_file.h"
#include "parse_util.h"

namespace eplb::stats::detail {

// JSON (load_json.cc).
// The format of a parsed JSON document, by its keys ("load" first).
LoadFormat json_format(const Json& doc, std::string_view source);
// The loads under the key of `format` (eplb, sglang or vllm).
LoadHistory parse_json_loads(const Json& doc, LoadFormat format, std::string_view source);
// {"key": [L][E]} when `flat` (one step), {"key": [steps][L][E]} otherwise.
std::string format_load_json(const LoadHistory& history, std::string_view key, bool flat);
std::string format_load_vllm(const LoadHistory& history);

// CSV matrix (load_csv.cc).
LoadHistory parse_csv_matrix(std::string_view content, std::string_view source);
std::string format_load_csv(const LoadHistory& history);

// Routing trace (load_trace.cc).
bool is_trace_header(std::string_view line);
RoutingTrace parse_trace(std::string_view content, int64_t given_experts, std::string_view source);
LoadHistory history_of_trace(const RoutingTrace& trace, std::string_view source);

// Shared by the writers (load_file.cc): InvalidArgument unless `history` holds
// steps x layers x experts values, all three positive; `v` appended as text that reads back.
void check_shape(const LoadHistory& history);
void append_number(std::string& out, double v);

}  // namespace eplb::stats::detail
