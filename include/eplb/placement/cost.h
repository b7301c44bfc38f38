#pragma once
// The cost model: what one rank pays, in time, for one MoE layer of one step (docs/design.md,
// "What a step pays"). Balancing tokens is its first approximation; this makes the rest explicit:
//
//   rank time  = rank_us + sum over the rank's activated slots of slot_time(n)
//   slot_time(n) = 0                                                  n == 0 (not activated)
//                = slot_us + token_us * min(n, knee) + token_us_above * max(0, n - knee)
//
// n is the tokens the slot computes in that layer and step. A layer waits for its slowest rank:
//
//   layer time = E[max over ranks of rank time x max(0, 1 + noise x Z_rank)]
//
// with Z independent standard normals, one per rank (expected_max_us): `noise` is how much a
// rank's time varies around the model from step to step (other work on its core, caches). With
// noise 0 the layer time is the largest rank time; with noise, ranks whose times are close pay
// more than the largest of them, since one of them is slow at almost every step.
//
// slot_us is the fixed part of an
// activated slot (its weights read once, the launch); with knee_tokens 0 there is no knee and
// every token costs token_us. A roofline (memory-bound below the knee, compute-bound above) is
// slot_us = weights / bandwidth, token_us = 0, knee = slot_us / token_us_above.
//
// A model comes from a fit to measured times (fit_cost_model: the emulator's per-rank times, or
// an engine's per-layer times; fit_slot_table: a kernel's time per token count), from stated
// hardware figures (roofline_cost_model), from a preset (cost_model_preset), or from JSON
// (cost_model_from_json). It lives in the placement layer, the lowest one every user of it
// reaches: placement (balanced with a cost), routing (adaptive_cost), sim, emu, cli, python.
// Pure: no I/O, no threads.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace eplb::placement {

struct CostModel {
  double rank_us = 0;         // fixed per rank and layer
  double slot_us = 0;         // fixed per activated slot
  double token_us = 1;        // per token (below the knee, when there is one)
  double knee_tokens = 0;     // 0: no knee
  double token_us_above = 0;  // per token above the knee (read only with a knee)
  double noise = 0;           // relative standard deviation of a rank's time, in [0, 1]
  std::string source;         // where it came from, for reports ("preset h100-v3-decode")
  // How well the model predicted MoE times it was not fitted on: the relative error of the mean
  // predicted step time over held-back steps (predicted / measured - 1), and how many steps were
  // held back. None for a model that is not a fit (a preset, a roofline) or whose fit was not
  // cross-validated.
  std::optional<double> heldout_error;
  int64_t heldout_steps = 0;

  bool has_knee() const { return knee_tokens > 0; }
  // Time of one slot computing `tokens` tokens (0 for none: an idle slot is not activated).
  double slot_time_us(double tokens) const {
    if (!(tokens > 0)) return 0;
    if (!has_knee()) return slot_us + token_us * tokens;
    const double below = tokens < knee_tokens ? tokens : knee_tokens;
    return slot_us + token_us * below + token_us_above * (tokens - below);
  }
  // A rank's time from its slots' token counts.
  double rank_time_us(std::span<const int64_t> slot_tokens) const;
  // A layer's time from its ranks' modeled times: expected_max_us(rank_times_us, noise).
  double layer_time_us(std::span<const double> rank_times_us) const;
  // Linear part only (no knee): a rank with `slots` activated slots and `tokens` tokens.
  double linear_rank_time_us(double slots, double tokens) const {
    return rank_us + slot_us * slots + token_us * tokens;
  }
  // InvalidArgument naming the parameter for a negative, NaN or infinite one, a value past
  // kMaxCostUs, a noise outside [0, 1], or a model under which everything is free (slot_us,
  // token_us and, with a knee, token_us_above all 0).
  void validate() const;
  std::string describe() const;  // "rank 0 us + slot 13.15 us + token 0 us (knee 295, ...)"
  // "-1.2% on 16 held-back steps", or what says there is none ("none: not a fit ...").
  std::string describe_heldout() const;
};

// The most any parameter may be, in microseconds: a second for one expert in one layer is
// corrupt input, and the bound keeps integer ticks (routing's cost solver) inside int64.
inline constexpr double kMaxCostUs = 1e6;

// One measurement: a rank's `time_us` in one layer of one step, with `slots` slots activated and
// `tokens` tokens computed. `step` groups the samples taken at the same step (every rank and
// layer of it), or -1: the fit's noise is then measured within each step, leaving out what moves
// every rank's time at once (the machine's load changing from step to step), which does not
// make one rank slower than the others.
struct CostSample {
  double slots = 0;
  double tokens = 0;
  double time_us = 0;
  int64_t step = -1;
};

// The fewest samples a fit takes: three parameters, and enough beyond them that one outlier
// cannot decide them.
inline constexpr int64_t kMinCostSamples = 8;

// Least squares of time = rank_us + slot_us * slots + token_us * tokens, every parameter >= 0
// (the best non-negative fit: each subset of the parameters is fitted, the best one with no
// negative parameter kept), and the noise: the standard deviation of the samples' relative
// residuals (time / modeled - 1), within each step where samples have one (see CostSample).
// InvalidArgument for fewer than kMinCostSamples samples (naming how many and the least), a bad
// sample (naming its index and value), or samples that cannot tell the slots from the tokens
// (every sample on one line through the origin of (slots, tokens): degenerate, naming the ratio).
CostModel fit_cost_model(std::span<const CostSample> samples);

// fit_cost_model, or where the samples cannot be fitted the `tokens` preset (1 us per token),
// with `why` (when not null) set to the fit's error, and left empty when the fit holds.
CostModel fit_cost_model_or_tokens(std::span<const CostSample> samples, std::string* why);

// The expected largest of rank_times_us[r] * max(0, 1 + noise * Z_r) over the ranks, Z_r
// independent standard normals (in 32 bins of a quarter standard deviation, each at its mean:
// exact for that distribution, and deterministic). noise 0: the largest time; no
// ranks: 0. Symmetric in the times, convex and nondecreasing in each: spreading the ranks' total
// time evenly over them never raises it, which is what makes a floor of it (eplb run's MoE floor).
double expected_max_us(std::span<const double> rank_times_us, double noise);

// A kernel table: the time one slot takes for each token count (an engine's grouped-GEMM
// timings). Fits slot_us, token_us, and where two lines fit better, the knee and
// token_us_above (each knee tried at a token count of the table). rank_us is left 0.
// InvalidArgument for fewer than 4 rows, a bad row, or fewer than 2 distinct token counts.
struct SlotTiming {
  double tokens = 0;
  double time_us = 0;
};
CostModel fit_slot_table(std::span<const SlotTiming> table);

// Stated hardware figures. Every field but launch_us and rank_us is required (> 0).
struct Roofline {
  double hbm_bytes_per_s = 0;   // memory bandwidth
  double peak_flops = 0;        // FLOP/s of the expert's datatype, dense
  double expert_bytes = 0;      // one expert's weights in one layer
  double flops_per_token = 0;   // one token through one expert
  double launch_us = 0;         // per activated slot, on top of the weights' read
  double rank_us = 0;           // per rank and layer
};
// slot_us = launch_us + expert_bytes / hbm_bytes_per_s, token_us 0, token_us_above =
// flops_per_token / peak_flops, knee = the weights' read time over token_us_above.
// InvalidArgument naming each missing or bad figure.
CostModel roofline_cost_model(const Roofline& figures);

// The presets (docs/dispatch.md states their figures and sources):
//   h100-v3-decode  DeepSeek-V3's routed expert (7168 x 2048, gate/up/down, fp8) on an H100 SXM
//                   (3.35 TB/s HBM3, 1979 TFLOP/s dense fp8)
//   h200-v3-decode  the same on an H200 (4.8 TB/s HBM3e)
//   tokens          1 us per token and nothing else: the modeled time is the token count
std::vector<std::string> cost_model_presets();
// InvalidArgument naming the name and the presets for an unknown one.
CostModel cost_model_preset(std::string_view name);

// JSON: {"rank_us": .., "slot_us": .., "token_us": .., "knee_tokens": .., "token_us_above": ..,
// "noise": .., "heldout_error": .., "heldout_steps": ..} (absent fields take their defaults), or {"roofline": {"hbm_bytes_per_s": .., "peak_flops": ..,
// "expert_bytes": .., "flops_per_token": .., "launch_us": .., "rank_us": ..}}, or {"preset":
// "h100-v3-decode"}. `where` names the input in messages. InvalidArgument for text that is not
// such an object (naming an unknown field, a field that is not a number) or a bad model.
CostModel cost_model_from_json(std::string_view text, std::string_view where = "cost model");
std::string cost_model_to_json(const CostModel& model);  // the first form, with "source"

bool is_cost_model_preset(std::string_view name);

// Lower bound on the time of a set of tokens of one expert over at most `replicas` slots: the
// cheapest split, j slots each taking tokens / j, over j = 1..replicas (the model's slot time is
// convex past 0, so an even split is the best for j slots).
double least_expert_time_us(const CostModel& model, double tokens, int64_t replicas);

}  // namespace eplb::placement
