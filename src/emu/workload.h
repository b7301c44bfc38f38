#pragma once
// Where the emulator's tokens come from: a routing trace (the top-k logical experts of every
// token of every layer), replayed in a cycle. Step s gives rank g the tokens
// s*G*T + g*T + [0, T) of the cycle (T tokens per rank), so every rank can replay every rank's
// tokens, and the workload repeats every period() steps.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace eplb::emu {

struct Workload {
  int64_t layers = 0;
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t tokens = 0;           // tokens in one pass of the trace
  std::vector<int32_t> routes;  // [layers][tokens][top_k]
  std::string source;           // what it was built from, for the summary

  // The top-k experts of global token `token` (taken modulo tokens) of `layer`.
  std::span<const int32_t> experts_of(int64_t layer, int64_t token) const {
    const int64_t t = token % tokens;
    return {routes.data() + (layer * tokens + t) * top_k, static_cast<size_t>(top_k)};
  }
  // Steps after which the tokens of every rank repeat: tokens / gcd(tokens, ranks * per_rank).
  int64_t period(int64_t ranks, int64_t tokens_per_rank) const;
};

// The bundled FLAME-MoE trace, as configured at build time (data/flame-moe-290m in the source
// tree), or EPLB_DATA_DIR/flame-moe-290m/routing_top6.csv when that variable is set.
std::string default_trace_path();

// DeepSeek-V3's real expert loads as SGLang published them (data/deepseek-v3-sglang, prefill
// with 1024-token inputs), found like default_trace_path.
std::string default_load_path();

// Keeps the first `layers` layers (0 or w.layers: all of them). InvalidArgument when negative
// or above w.layers (naming the range the input allows).
void keep_layers(Workload& w, int64_t layers);

// A routing trace file (the "layer,token,experts,weights" CSV `eplb plan` reads).
Workload workload_from_trace(const std::string& path);

// The most tokens workload_from_load samples (--sample-tokens).
inline constexpr int64_t kMaxSampleTokens = int64_t{1} << 20;

// A load file of any format `eplb plan` reads, turned into a trace of `tokens` tokens: each
// token draws `top_k` distinct experts per layer with probability proportional to the layer's
// load (summed over the file's steps), from a generator seeded with `seed`. Dense layers (no
// load anywhere) are left out: they route no tokens. `layers` > 0 samples only the first that
// many MoE layers (their tokens the same as with every layer; keep_layers' refusals past the
// input's); 0: every layer.
Workload workload_from_load(const std::string& path, int64_t top_k, int64_t tokens, uint64_t seed,
                            int64_t layers = 0);

}  // namespace eplb::emu
