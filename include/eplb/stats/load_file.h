#pragma once
// Load files: per-layer, per-logical-expert loads in every format eplb reads, detected from the
// content (an explicit format overrides). Loads of files with steps are kept per step for replay
// and summed for placement.
//
//   eplb    {"load": [[...E]...L]}  or  {"load": [[[...E]...L]...steps]}
//   sglang  {"logical_count": [[[...E]...L]...steps]}
//   vllm    {"load_history": [{"logical_expert_load": [[...E]...L]}, ...]}  (one entry per step)
//   csv     one line per layer of comma-separated loads
//   trace   routing trace CSV "layer,token,experts,weights": each listed expert of a token counts
//           1 on its layer; layers renumbered 0..L-1 in order; experts = largest id + 1 unless
//           LoadReadOptions::experts says more. One step per token.
//
// Every malformed input (ragged rows, negative, non-numeric, NaN or infinite loads, truncated or
// empty files) throws InvalidArgument naming the file and the position; nothing else escapes.
// So does a load written as an integer above kMaxExactLoad (2^53): loads are doubles, which
// would round it, and a count is kept exact or refused.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/file.h"
#include "eplb/core/types.h"

namespace eplb::stats {

enum class LoadFormat { kAuto, kEplb, kSglang, kVllm, kCsv, kTrace };

// "auto" | "eplb" | "sglang" | "vllm" | "csv" | "trace"; else InvalidArgument naming `option`
// (the option or parameter the name came from) and listing them.
LoadFormat parse_load_format(std::string_view name, std::string_view option = "--format");
std::string_view load_format_name(LoadFormat format);

struct LoadReadOptions {
  LoadFormat format = LoadFormat::kAuto;
  // The experts per layer (0: as the file says). A trace's experts are its largest id + 1, a
  // matrix's its row length; an input with fewer gains zero-load experts up to this, one with
  // more (an id at or above it: InvalidArgument naming the line) is refused.
  int64_t experts = 0;
};

// Loads per step. Formats without steps hold one step.
struct LoadHistory {
  int64_t steps = 0;
  int64_t layers = 0;
  int64_t experts = 0;
  LoadFormat format = LoadFormat::kAuto;  // the format it was read as
  std::vector<double> values;             // [steps][layers][experts]

  const double* step(int64_t s) const { return values.data() + s * layers * experts; }
  LoadMatrix sum() const;  // summed over steps
};

// A routing trace: the top-k logical experts of every token of every layer.
struct RoutingTrace {
  int64_t layers = 0;
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t experts = 0;
  std::vector<int64_t> layer_ids;  // [layers]: the file's layer numbers, in order
  std::vector<int32_t> routes;     // [layers][tokens][top_k]
};

// JSON by its key ("load" before "logical_count" before "load_history"); CSV whose first line is
// the header "layer,token,experts[,weights]" is a trace, other CSV a matrix. Throws
// InvalidArgument, naming `source` (the file), for empty content, invalid JSON, or JSON without
// any of the keys.
LoadFormat detect_load_format(std::string_view content, std::string_view source = "<input>");

// Parse from memory; `source` names the input in messages (a path, or "<input>").
LoadHistory parse_load_history(std::string_view content, const LoadReadOptions& options,
                               std::string_view source = "<input>");
// `experts` as in LoadReadOptions::experts (0: largest id + 1).
RoutingTrace parse_routing_trace(std::string_view content, int64_t experts = 0,
                                 std::string_view source = "<input>");

// Read a file (IoError when it cannot be read, InvalidArgument when it is malformed; read_load
// also when a sum over steps overflows).
LoadHistory read_load_history(const std::string& path, const LoadReadOptions& options = {});
LoadMatrix read_load(const std::string& path, const LoadReadOptions& options = {});
RoutingTrace read_routing_trace(const std::string& path, int64_t experts = 0);

// Whole files (read_file: regular files of any size, pipes up to kMaxStreamBytes, devices and
// directories refused; write_file), from the core layer, where they are documented.
using ::eplb::kMaxStreamBytes;
using ::eplb::read_file;
using ::eplb::write_file;

// Writers, so a run can seed the next one and a recorded distribution can move between engines
// (`eplb convert`). Each reads back, with parse_load_history, to the same loads:
//   eplb    {"load": [[[...E]...L]...steps]}
//   sglang  {"logical_count": ...}: [L][E] for one step, as SGLang's statistics files are,
//           [steps][L][E] for more
//   vllm    {"load_history": [{"logical_expert_load": [[...E]...L]}, ...]}, one entry per step
//   csv     one line per layer, the steps summed (a matrix holds no steps); a sum of integer
//           counts past 2^53, which a double may have rounded, is refused (InvalidArgument
//           naming the layer and expert)
// A double above 2^53 is written in scientific notation, never as digits that would claim an
// exact count. A trace cannot be written back from loads (InvalidArgument naming the formats
// that can).
std::string format_load(const LoadHistory& history, LoadFormat format);
std::string format_load_eplb(const LoadHistory& history);
std::string format_load_sglang(const LoadHistory& history);

}  // namespace eplb::stats
