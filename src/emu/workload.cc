#include "emu/workload.h"

#include <fmt/core.h>

#include <cstdlib>
#include <filesystem>
#include <numeric>

#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/memory.h"
#include "eplb/stats/load_file.h"

namespace eplb::emu {
namespace {

uint64_t splitmix(uint64_t& state) { return mix64(state += 0x9E3779B97F4A7C15ull); }

double uniform(uint64_t& state) {
  return static_cast<double>(splitmix(state) >> 11) * (1.0 / 9007199254740992.0);
}

}  // namespace

int64_t Workload::period(int64_t ranks, int64_t tokens_per_rank) const {
  return tokens / std::gcd(tokens, ranks * tokens_per_rank);
}

std::string default_trace_path() {
  if (const char* dir = std::getenv("EPLB_DATA_DIR"); dir != nullptr && *dir != '\0') {
    return std::string(dir) + "/flame-moe-290m/routing_top6.csv";
  }
#ifdef EPLB_EMU_DATA_DIR
  return EPLB_EMU_DATA_DIR "/flame-moe-290m/routing_top6.csv";
#else
  return "data/flame-moe-290m/routing_top6.csv";
#endif
}

std::string default_load_path() {
  if (const char* dir = std::getenv("EPLB_DATA_DIR"); dir != nullptr && *dir != '\0') {
    return std::string(dir) + "/deepseek-v3-sglang/prefill_in1024.json";
  }
#ifdef EPLB_EMU_DATA_DIR
  return EPLB_EMU_DATA_DIR "/deepseek-v3-sglang/prefill_in1024.json";
#else
  return "data/deepseek-v3-sglang/prefill_in1024.json";
#endif
}

void keep_layers(Workload& w, int64_t layers) {
  if (layers < 0) fail("--layers ", layers, " must not be negative (0: every layer)");
  // More layers than the input has would be a silent clamp: the run would serve fewer layers
  // than asked, and its figures would not be those of the model asked for.
  if (layers > w.layers) {
    fail("--layers ", layers, " is more than the ", w.layers, " MoE layer",
         w.layers == 1 ? "" : "s", " of ", w.source, " (1 to ", w.layers, ", or 0: every layer)");
  }
  if (layers == 0 || layers == w.layers) return;
  w.routes.resize(static_cast<size_t>(layers * w.tokens * w.top_k));
  w.source += ", first " + std::to_string(layers) + " of " + std::to_string(w.layers) + " layers";
  w.layers = layers;
}

Workload workload_from_trace(const std::string& path) {
  if (!std::filesystem::exists(path)) {
    fail<IoError>("routing trace ", path,
                  " not found (pass --trace FILE, or set EPLB_DATA_DIR to the source tree's "
                  "data folder)");
  }
  const stats::RoutingTrace trace = stats::read_routing_trace(path);
  Workload w;
  w.layers = trace.layers;
  w.experts = trace.experts;
  w.top_k = trace.top_k;
  w.tokens = trace.tokens;
  w.routes = trace.routes;
  w.source = path;
  if (w.layers < 1 || w.tokens < 1 || w.top_k < 1) {
    fail("routing trace ", path, " has no routed tokens");
  }
  return w;
}

Workload workload_from_load(const std::string& path, int64_t top_k, int64_t tokens, uint64_t seed,
                            int64_t layers) {
  if (top_k < 1) fail("--top-k ", top_k, " must be at least 1");
  // Each token's draw scans the experts of every layer: past a million tokens, minutes.
  if (tokens < 1 || tokens > kMaxSampleTokens) {
    fail("--sample-tokens ", tokens, " is outside [1, ", kMaxSampleTokens,
         "] (tokens in one pass of the sampled loads; the steps reuse them in a cycle)");
  }
  const LoadMatrix file = stats::read_load(path);
  if (file.experts < top_k) {
    fail("--top-k ", top_k, " is more than the ", file.experts, " experts of ", path);
  }
  // Dense layers (no load at all: DeepSeek-V3's first three) route no tokens: left out.
  LoadMatrix load(0, file.experts);
  for (int64_t l = 0; l < file.layers; ++l) {
    double total = 0;
    for (const double v : file.row(l)) total += v > 0 ? v : 0;
    if (total <= 0) continue;
    load.values.insert(load.values.end(), file.row(l).begin(), file.row(l).end());
    ++load.layers;
  }
  if (load.layers == 0) fail("load file ", path, " has no layer with load (every layer is dense)");
  Workload w;
  w.layers = load.layers;
  w.experts = load.experts;
  w.top_k = top_k;
  w.tokens = tokens;
  w.source = path + " (sampled, seed " + std::to_string(seed) +
             (load.layers < file.layers
                  ? ", " + std::to_string(file.layers - load.layers) + " dense layers left out)"
                  : ")");
  // Only the layers kept are sampled (the draws run layer by layer, so theirs are the same as
  // when every layer is): `eplb run` keeps 6 of DeepSeek-V3's 58 by default, and sampling all
  // of them was most of what it did before its ranks started.
  if (layers != 0 && layers != w.layers) {
    keep_layers(w, layers);  // refuses a count outside [0, MoE layers], naming the range
  }
  check_fits_in_memory(checked_mul(checked_mul(w.layers * top_k, tokens, "the sampled tokens"),
                                   4, "the sampled tokens"),
                       fmt::format("--sample-tokens {} ({} layers x top-{} expert ids)", tokens,
                                   w.layers, top_k),
                       "lower --sample-tokens");
  w.routes.resize(static_cast<size_t>(w.layers * tokens * top_k));
  uint64_t state = seed;
  std::vector<double> weight(static_cast<size_t>(w.experts));
  for (int64_t l = 0; l < w.layers; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      // Step 1: draw top_k distinct experts, each in proportion to its load among those left;
      // when every expert left has zero load, the lowest id left.
      for (int64_t e = 0; e < w.experts; ++e) weight[e] = load.at(l, e);
      for (int64_t j = 0; j < top_k; ++j) {
        double total = 0;
        for (const double v : weight) total += v > 0 ? v : 0;
        int64_t pick = -1;
        if (total > 0) {
          double u = uniform(state) * total;
          for (int64_t e = 0; e < w.experts; ++e) {
            if (weight[e] <= 0) continue;
            pick = e;
            if (u < weight[e]) break;
            u -= weight[e];
          }
        } else {
          for (int64_t e = 0; e < w.experts && pick < 0; ++e) {
            bool used = false;
            for (int64_t i = 0; i < j; ++i) {
              used |= w.routes[(l * tokens + t) * top_k + i] == e;
            }
            if (!used) pick = e;
          }
        }
        w.routes[(l * tokens + t) * top_k + j] = static_cast<int32_t>(pick);
        weight[pick] = -1;  // drawn: never again for this token
      }
    }
  }
  return w;
}

}  // namespace eplb::emu
