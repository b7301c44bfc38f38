// The cost model (placement/cost.h): validation, fits, the roofline, presets and JSON.

#include "eplb/placement/cost.h"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::placement {
namespace {

// The largest figures a measured sample or kernel row may hold: past them the fits' sums of
// squares could overflow, and no measurement is that large.
constexpr double kMaxSampleUs = 1e12;                  // 11.6 days
constexpr double kMaxSampleCount = 9007199254740992.0;  // 2^53

void check_parameter(std::string_view name, double value) {
  if (!std::isfinite(value) || value < 0) {
    fail("cost model: ", name, " is ", value, " (must be a finite number >= 0)");
  }
  if (value > kMaxCostUs) {
    fail("cost model: ", name, " is ", value, ", above ", kMaxCostUs,
         " (a second per expert and layer is not a model of one; times are in microseconds)");
  }
}

// Solves the normal equations of a least-squares fit over the columns in `use` (a subset of
// {1, slots, tokens}); false when they are singular. Gaussian elimination with partial pivoting
// on at most 3 x 3.
bool solve_subset(const std::array<std::array<double, 3>, 3>& ata, const std::array<double, 3>& atb,
                  const std::array<bool, 3>& use, std::array<double, 3>& out) {
  std::array<int, 3> idx{};
  int n = 0;
  for (int i = 0; i < 3; ++i) {
    if (use[i]) idx[n++] = i;
  }
  double m[3][4] = {};
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < n; ++c) m[r][c] = ata[idx[r]][idx[c]];
    m[r][n] = atb[idx[r]];
  }
  // Relative pivot tolerance: the diagonal's scale.
  double scale = 0;
  for (int r = 0; r < n; ++r) scale = std::max(scale, std::abs(m[r][r]));
  for (int c = 0; c < n; ++c) {
    int best = c;
    for (int r = c + 1; r < n; ++r) {
      if (std::abs(m[r][c]) > std::abs(m[best][c])) best = r;
    }
    if (std::abs(m[best][c]) <= 1e-12 * scale) return false;
    for (int k = 0; k <= n; ++k) std::swap(m[c][k], m[best][k]);
    for (int r = 0; r < n; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (int k = c; k <= n; ++k) m[r][k] -= f * m[c][k];
    }
  }
  out = {0, 0, 0};
  for (int r = 0; r < n; ++r) out[idx[r]] = m[r][n] / m[r][r];
  return true;
}

// `out` = j[key] where j has it (a number, else an error naming it); left as is where not.
void read_number(const nlohmann::json& j, const char* key, std::string_view where, double& out) {
  if (!j.contains(key)) return;
  const nlohmann::json& v = j.at(key);
  if (!v.is_number()) {
    fail(where, ": \"", key, "\" is ", v.dump(), " (expected a number)");
  }
  out = v.get<double>();
}

void check_fields(const nlohmann::json& j, std::initializer_list<const char*> allowed,
                  std::string_view where, std::string_view what) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* a : allowed) known = known || it.key() == a;
    if (!known) {
      std::string list;
      for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      fail(where, ": unknown field \"", it.key(), "\" in ", what, " (expected ", list, ")");
    }
  }
}

// The noise's quadrature: the standard normal cut into kNoiseNodes bins of width 0.25 over
// [-4, 4] (the first and last reaching out to infinity), each bin taken at its conditional mean
// with its probability. The nodes' mean is exactly 0 and the tails reach past 4 standard
// deviations, which the expected largest of hundreds of ranks needs. Closed forms, computed once.
constexpr int kNoiseNodes = 32;
struct NoiseNodes {
  std::array<double, kNoiseNodes> z{};       // the bins' conditional means
  std::array<double, kNoiseNodes> weight{};  // their probabilities
};
const NoiseNodes& noise_nodes() {
  static const NoiseNodes nodes = [] {
    const double inf = std::numeric_limits<double>::infinity();
    const auto cdf = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
    const auto pdf = [](double x) {
      return std::isfinite(x) ? std::exp(-0.5 * x * x) / std::sqrt(2 * std::numbers::pi) : 0.0;
    };
    NoiseNodes n;
    for (int k = 0; k < kNoiseNodes; ++k) {
      const double lo = k == 0 ? -inf : -4 + 0.25 * k;
      const double hi = k == kNoiseNodes - 1 ? inf : -4 + 0.25 * (k + 1);
      const double p = (k == 0 ? cdf(hi) : k == kNoiseNodes - 1 ? cdf(-lo) : cdf(hi) - cdf(lo));
      n.weight[static_cast<size_t>(k)] = p;
      n.z[static_cast<size_t>(k)] = (pdf(lo) - pdf(hi)) / p;
    }
    return n;
  }();
  return nodes;
}

}  // namespace

double expected_max_us(std::span<const double> times, double noise) {
  if (times.empty()) return 0;
  double most = 0;
  for (const double t : times) most = std::max(most, t);
  if (!(noise > 0)) return most;
  // Each rank's time takes the values t_r * f_k (f_k = max(0, 1 + noise z_k)) with the nodes'
  // probabilities w_k. Sweeping every (rank, k) value in ascending order, P(max <= x) is the
  // product over the ranks of their cumulative probability at x; the expectation is the sum of
  // x times the jumps of that product. The product is kept in logs (hundreds of ranks take it
  // far below the smallest double).
  const NoiseNodes& nodes = noise_nodes();
  std::array<double, kNoiseNodes> f{};
  std::array<double, kNoiseNodes + 1> log_cumulative{};  // [c]: log of w_0 + ... + w_{c-1}
  double cumulative = 0;
  for (int k = 0; k < kNoiseNodes; ++k) {
    f[k] = std::max(0.0, 1 + noise * nodes.z[k]);
    cumulative += nodes.weight[k];
    log_cumulative[k + 1] = std::log(cumulative);
  }
  std::vector<std::pair<double, uint32_t>> values;
  values.reserve(times.size() * kNoiseNodes);
  for (size_t r = 0; r < times.size(); ++r) {
    for (int k = 0; k < kNoiseNodes; ++k) {
      values.emplace_back(std::max(0.0, times[r]) * f[k], static_cast<uint32_t>(r));
    }
  }
  // f is nondecreasing in k, so a rank's values come in the order of its nodes.
  std::sort(values.begin(), values.end());
  std::vector<int> count(times.size(), 0);
  size_t empty = times.size();  // ranks with no value at most x yet
  double log_p = 0;             // over the ranks with one
  double previous = 0, sum = 0;
  for (const auto& [x, r] : values) {
    int& c = count[r];
    if (c == 0) --empty;
    log_p += log_cumulative[c + 1] - (c == 0 ? 0.0 : log_cumulative[c]);
    ++c;
    const double p = empty > 0 ? 0.0 : std::exp(log_p);
    sum += x * (p - previous);
    previous = p;
  }
  // The last jump takes the product to 1 (rounding may leave it a hair off).
  sum += values.back().first * (1 - previous);
  return sum;
}

namespace {

// The relative residuals' standard deviation of `m` on `samples`, within each step where the
// samples name one (see CostSample), with the degrees of freedom the within-step means take.
double fit_noise(const CostModel& m, std::span<const CostSample> samples) {
  std::map<int64_t, std::pair<double, int64_t>> by_step;  // sum and count of residuals
  std::vector<double> residual(samples.size(), 0);
  std::vector<uint8_t> used(samples.size(), 0);
  for (size_t i = 0; i < samples.size(); ++i) {
    const CostSample& s = samples[i];
    const double modeled = m.linear_rank_time_us(s.slots, s.tokens);
    if (!(modeled > 0)) continue;
    residual[i] = s.time_us / modeled - 1;
    used[i] = 1;
    auto& [sum, n] = by_step[s.step];
    sum += residual[i];
    ++n;
  }
  double squares = 0;
  int64_t n = 0, groups = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (!used[i]) continue;
    const int64_t step = samples[i].step;
    const auto& [sum, count] = by_step[step];
    // Samples without a step are one group, around the fit (whose residuals are centred).
    const double centre = step >= 0 ? sum / static_cast<double>(count) : 0.0;
    squares += (residual[i] - centre) * (residual[i] - centre);
    ++n;
  }
  for (const auto& [step, g] : by_step) groups += step >= 0 ? 1 : 0;
  const int64_t dof = n - groups - 3;
  if (dof < 1) return 0;
  return std::min(1.0, std::sqrt(squares / static_cast<double>(dof)));
}

}  // namespace

double CostModel::layer_time_us(std::span<const double> rank_times_us) const {
  return expected_max_us(rank_times_us, noise);
}

double CostModel::rank_time_us(std::span<const int64_t> slot_tokens) const {
  double t = rank_us;
  for (const int64_t n : slot_tokens) t += slot_time_us(static_cast<double>(n));
  return t;
}

void CostModel::validate() const {
  check_parameter("rank_us", rank_us);
  check_parameter("slot_us", slot_us);
  check_parameter("token_us", token_us);
  check_parameter("knee_tokens", knee_tokens);
  check_parameter("token_us_above", token_us_above);
  if (!(noise >= 0 && noise <= 1)) {
    fail("cost model: noise is ", noise,
         " (must be in [0, 1]: the relative standard deviation of a rank's time)");
  }
  if (heldout_error && !std::isfinite(*heldout_error)) {
    fail("cost model: heldout_error is ", *heldout_error, " (must be a finite number)");
  }
  if (heldout_steps < 0) {
    fail("cost model: heldout_steps is ", heldout_steps, " (must be >= 0)");
  }
  if (slot_us == 0 && token_us == 0 && (!has_knee() || token_us_above == 0)) {
    fail("cost model: slot_us, token_us", has_knee() ? " and token_us_above" : "",
         " are all 0: nothing would cost anything (give a time per slot or per token)");
  }
}

std::string CostModel::describe() const {
  std::string s = fmt::format("rank {:.4g} us + per activated slot {:.4g} us + per token {:.4g} us",
                              rank_us, slot_us, token_us);
  if (has_knee()) {
    s += fmt::format(" up to {:.4g} tokens, {:.4g} us above", knee_tokens, token_us_above);
  }
  if (noise > 0) s += fmt::format(", rank noise {:.1f}%", noise * 100);
  return s;
}

std::string CostModel::describe_heldout() const {
  if (!heldout_error) return "none (not a fit, or a fit not checked on held-back steps)";
  return fmt::format("{:+.1f}% on {} held-back steps (each predicted by a fit of the others)",
                     *heldout_error * 100, heldout_steps);
}

CostModel fit_cost_model(std::span<const CostSample> samples) {
  const auto n = static_cast<int64_t>(samples.size());
  if (n < kMinCostSamples) {
    fail("cost model fit: ", n, " sample", n == 1 ? "" : "s", " (need at least ",
         kMinCostSamples, " measured (slots, tokens, time) samples)");
  }
  std::array<std::array<double, 3>, 3> ata{};
  std::array<double, 3> atb{};
  for (int64_t i = 0; i < n; ++i) {
    const CostSample& s = samples[static_cast<size_t>(i)];
    for (const double v : {s.slots, s.tokens, s.time_us}) {
      if (!std::isfinite(v) || v < 0) {
        fail("cost model fit: sample ", i, " is (slots ", s.slots, ", tokens ", s.tokens,
             ", time ", s.time_us, " us); every figure must be finite and >= 0");
      }
    }
    // Bounded so that the sums of squares below stay finite: past these no fit is meaningful
    // (a model's parameters are at most kMaxCostUs each).
    if (s.time_us > kMaxSampleUs || s.slots > kMaxSampleCount || s.tokens > kMaxSampleCount) {
      fail("cost model fit: sample ", i, " is (slots ", s.slots, ", tokens ", s.tokens,
           ", time ", s.time_us, " us); a sample is one rank's layer: at most ", kMaxSampleCount,
           " slots and tokens, and ", kMaxSampleUs, " us (times are in microseconds)");
    }
    const std::array<double, 3> x{1.0, s.slots, s.tokens};
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 3; ++c) ata[r][c] += x[r] * x[c];
      atb[r] += x[r] * s.time_us;
    }
  }
  // Degenerate: slots and tokens in a fixed ratio in every sample (or either constant), so no
  // fit can tell their costs apart. The correlation of the two columns, centred, says it.
  const double ms = ata[0][1] / static_cast<double>(n), mt = ata[0][2] / static_cast<double>(n);
  const double vs = ata[1][1] / static_cast<double>(n) - ms * ms;
  const double vt = ata[2][2] / static_cast<double>(n) - mt * mt;
  const double cst = ata[1][2] / static_cast<double>(n) - ms * mt;
  if (!(vs > 1e-12 * std::max(1.0, ms * ms)) || !(vt > 1e-12 * std::max(1.0, mt * mt)) ||
      cst * cst >= (1 - 1e-9) * vs * vt) {
    fail("cost model fit: the ", n,
         " samples cannot tell the slots' cost from the tokens' (activated slots ", ms,
         " and tokens ", mt,
         " on average, varying together or not at all): give samples with different numbers "
         "of tokens per activated slot");
  }
  // Step 1: every subset of the parameters, unconstrained; keep the best one with none negative.
  double best_sse = std::numeric_limits<double>::infinity();
  std::array<double, 3> best{0, 0, 0};
  for (int mask = 1; mask < 8; ++mask) {
    const std::array<bool, 3> use{(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
    std::array<double, 3> p{};
    if (!solve_subset(ata, atb, use, p)) continue;
    if (p[0] < 0 || p[1] < 0 || p[2] < 0) continue;
    double sse = 0;
    for (const CostSample& s : samples) {
      const double r = s.time_us - (p[0] + p[1] * s.slots + p[2] * s.tokens);
      sse += r * r;
    }
    if (sse < best_sse) {
      best_sse = sse;
      best = p;
    }
  }
  CostModel m;
  m.rank_us = best[0];
  m.slot_us = best[1];
  m.token_us = best[2];
  m.noise = fit_noise(m, samples);
  m.source = fmt::format("fit of {} samples", n);
  m.validate();
  return m;
}

CostModel fit_cost_model_or_tokens(std::span<const CostSample> samples, std::string* why) {
  if (why != nullptr) why->clear();
  try {
    return fit_cost_model(samples);
  } catch (const InvalidArgument& e) {
    if (why != nullptr) *why = e.what();
    CostModel m = cost_model_preset("tokens");
    m.source = fmt::format("preset tokens (the fit failed: {})", e.what());
    return m;
  }
}

CostModel fit_slot_table(std::span<const SlotTiming> table) {
  const auto n = static_cast<int64_t>(table.size());
  if (n < 4) fail("kernel table fit: ", n, " rows (need at least 4 (tokens, time) rows)");
  std::vector<double> knees;
  for (int64_t i = 0; i < n; ++i) {
    const SlotTiming& r = table[static_cast<size_t>(i)];
    if (!std::isfinite(r.tokens) || !(r.tokens > 0) || !std::isfinite(r.time_us) || r.time_us < 0) {
      fail("kernel table fit: row ", i, " is (tokens ", r.tokens, ", time ", r.time_us,
           " us); tokens must be > 0 and the time finite and >= 0");
    }
    if (r.tokens > kMaxSampleCount || r.time_us > kMaxSampleUs) {
      fail("kernel table fit: row ", i, " is (tokens ", r.tokens, ", time ", r.time_us,
           " us); a row is one slot's kernel: at most ", kMaxSampleCount, " tokens and ",
           kMaxSampleUs, " us (times are in microseconds)");
    }
    knees.push_back(r.tokens);
  }
  std::sort(knees.begin(), knees.end());
  knees.erase(std::unique(knees.begin(), knees.end()), knees.end());
  if (knees.size() < 2) {
    fail("kernel table fit: every row has ", knees.front(),
         " tokens (need at least 2 distinct token counts)");
  }
  // Columns 1, min(n, k), max(0, n - k); k past the largest count is the linear fit.
  const auto fit = [&](double knee, std::array<double, 3>& p) {
    std::array<std::array<double, 3>, 3> ata{};
    std::array<double, 3> atb{};
    for (const SlotTiming& r : table) {
      const std::array<double, 3> x{1.0, std::min(r.tokens, knee), std::max(0.0, r.tokens - knee)};
      for (int a = 0; a < 3; ++a) {
        for (int b = 0; b < 3; ++b) ata[a][b] += x[a] * x[b];
        atb[a] += x[a] * r.time_us;
      }
    }
    double best = std::numeric_limits<double>::infinity();
    for (int mask = 1; mask < 8; ++mask) {
      const std::array<bool, 3> use{(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
      std::array<double, 3> q{};
      if (!solve_subset(ata, atb, use, q) || q[0] < 0 || q[1] < 0 || q[2] < 0) continue;
      double sse = 0;
      for (const SlotTiming& r : table) {
        const double e = r.time_us - (q[0] + q[1] * std::min(r.tokens, knee) +
                                      q[2] * std::max(0.0, r.tokens - knee));
        sse += e * e;
      }
      if (sse < best) {
        best = sse;
        p = q;
      }
    }
    return best;
  };
  std::array<double, 3> best_p{};
  double best_knee = 0;
  double best_sse = fit(knees.back(), best_p);  // linear
  // A knee must beat the line by more than rounding: 1% of its error.
  for (size_t i = 0; i + 1 < knees.size(); ++i) {
    std::array<double, 3> p{};
    const double sse = fit(knees[i], p);
    if (sse < 0.99 * best_sse) {
      best_sse = sse;
      best_p = p;
      best_knee = knees[i];
    }
  }
  CostModel m;
  m.slot_us = best_p[0];
  m.token_us = best_p[1];
  if (best_knee > 0) {
    m.knee_tokens = best_knee;
    m.token_us_above = best_p[2];
  }
  m.source = fmt::format("fit of a kernel table of {} rows", n);
  m.validate();
  return m;
}

CostModel roofline_cost_model(const Roofline& f) {
  const auto required = [](std::string_view name, double v, std::string_view what) {
    if (!std::isfinite(v) || !(v > 0)) {
      fail("roofline: ", name, " is ", v, " (required: ", what, ", > 0)");
    }
  };
  required("hbm_bytes_per_s", f.hbm_bytes_per_s, "the memory bandwidth in bytes per second");
  required("peak_flops", f.peak_flops, "the dense FLOP/s of the experts' datatype");
  required("expert_bytes", f.expert_bytes, "the bytes of one expert's weights in one layer");
  required("flops_per_token", f.flops_per_token, "the FLOPs of one token through one expert");
  check_parameter("launch_us", f.launch_us);
  check_parameter("rank_us", f.rank_us);
  CostModel m;
  const double read_us = f.expert_bytes / f.hbm_bytes_per_s * 1e6;
  m.rank_us = f.rank_us;
  m.slot_us = f.launch_us + read_us;
  m.token_us = 0;
  m.token_us_above = f.flops_per_token / f.peak_flops * 1e6;
  m.knee_tokens = read_us / m.token_us_above;
  m.source = "roofline";
  m.validate();
  return m;
}

std::vector<std::string> cost_model_presets() {
  return {"h100-v3-decode", "h200-v3-decode", "tokens"};
}

bool is_cost_model_preset(std::string_view name) {
  for (const std::string& p : cost_model_presets()) {
    if (p == name) return true;
  }
  return false;
}

CostModel cost_model_preset(std::string_view name) {
  // DeepSeek-V3's routed expert: gate, up and down projections of 7168 x 2048, one byte each in
  // fp8 (the block scales, 10.5 KiB, left out); 2 FLOPs per weight per token.
  constexpr double kV3ExpertBytes = 3.0 * 7168 * 2048;
  constexpr double kV3Flops = 2 * kV3ExpertBytes;
  constexpr double kFp8DenseFlops = 1979e12;  // H100 / H200 SXM, fp8 tensor cores, dense
  CostModel m;
  if (name == "h100-v3-decode" || name == "h200-v3-decode") {
    const bool h100 = name == "h100-v3-decode";
    m = roofline_cost_model({.hbm_bytes_per_s = h100 ? 3.35e12 : 4.8e12,
                             .peak_flops = kFp8DenseFlops,
                             .expert_bytes = kV3ExpertBytes,
                             .flops_per_token = kV3Flops});
  } else if (name == "tokens") {
    m.token_us = 1;
  } else {
    std::string list;
    for (const std::string& p : cost_model_presets()) list += (list.empty() ? "" : ", ") + p;
    fail("cost model '", name, "' is not a preset (", list, ") nor a JSON file of parameters");
  }
  m.source = "preset " + std::string(name);
  return m;
}

CostModel cost_model_from_json(std::string_view text, std::string_view where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(where, " is not JSON: ", e.what());
  }
  if (!j.is_object()) fail(where, " is not a JSON object of cost model parameters");
  if (j.contains("preset")) {
    check_fields(j, {"preset"}, where, "a preset");
    if (!j["preset"].is_string()) fail(where, ": \"preset\" is ", j["preset"].dump(), " (a name)");
    return cost_model_preset(j["preset"].get<std::string>());
  }
  if (j.contains("roofline")) {
    check_fields(j, {"roofline", "source"}, where, "the model");
    const nlohmann::json& r = j["roofline"];
    if (!r.is_object()) fail(where, ": \"roofline\" is not an object of hardware figures");
    check_fields(r,
                 {"hbm_bytes_per_s", "peak_flops", "expert_bytes", "flops_per_token",
                  "launch_us", "rank_us"},
                 where, "\"roofline\"");
    Roofline f;
    read_number(r, "hbm_bytes_per_s", where, f.hbm_bytes_per_s);
    read_number(r, "peak_flops", where, f.peak_flops);
    read_number(r, "expert_bytes", where, f.expert_bytes);
    read_number(r, "flops_per_token", where, f.flops_per_token);
    read_number(r, "launch_us", where, f.launch_us);
    read_number(r, "rank_us", where, f.rank_us);
    CostModel m = roofline_cost_model(f);
    m.source = std::string(where) + " (roofline)";
    return m;
  }
  check_fields(j,
               {"rank_us", "slot_us", "token_us", "knee_tokens", "token_us_above", "noise",
                "heldout_error", "heldout_steps", "source"},
               where, "the model");
  // An object without a parameter ({}) would be the defaults' model, which nobody measured.
  bool any = false;
  for (const char* key : {"rank_us", "slot_us", "token_us", "knee_tokens", "token_us_above"}) {
    any = any || j.contains(key);
  }
  if (!any) {
    fail(where, " gives no cost model parameter (expected some of rank_us, slot_us, token_us, "
         "knee_tokens, token_us_above; or {\"preset\": NAME} or {\"roofline\": {...}})");
  }
  CostModel m;
  read_number(j, "rank_us", where, m.rank_us);
  read_number(j, "slot_us", where, m.slot_us);
  read_number(j, "token_us", where, m.token_us);
  read_number(j, "knee_tokens", where, m.knee_tokens);
  read_number(j, "token_us_above", where, m.token_us_above);
  read_number(j, "noise", where, m.noise);
  if (j.contains("heldout_error") && !j["heldout_error"].is_null()) {
    double e = 0;
    read_number(j, "heldout_error", where, e);
    m.heldout_error = e;
  }
  if (j.contains("heldout_steps")) {
    double steps = 0;
    read_number(j, "heldout_steps", where, steps);
    if (!(steps >= 0 && steps <= 1e15) || steps != std::floor(steps)) {
      fail(where, ": \"heldout_steps\" is ", steps, " (expected a whole number of steps >= 0)");
    }
    m.heldout_steps = static_cast<int64_t>(steps);
  }
  m.source = j.contains("source") && j["source"].is_string() ? j["source"].get<std::string>()
                                                             : std::string(where);
  m.validate();
  return m;
}

std::string cost_model_to_json(const CostModel& m) {
  nlohmann::json j = {{"rank_us", m.rank_us},
                      {"slot_us", m.slot_us},
                      {"token_us", m.token_us},
                      {"knee_tokens", m.knee_tokens},
                      {"token_us_above", m.token_us_above},
                      {"noise", m.noise}};
  if (m.heldout_error) {
    j["heldout_error"] = *m.heldout_error;
    j["heldout_steps"] = m.heldout_steps;
  }
  if (!m.source.empty()) j["source"] = m.source;
  return j.dump();
}

double least_expert_time_us(const CostModel& model, double tokens, int64_t replicas) {
  if (!(tokens > 0) || replicas < 1) return 0;
  double best = model.slot_time_us(tokens);
  for (int64_t j = 2; j <= replicas; ++j) {
    const auto jd = static_cast<double>(j);
    best = std::min(best, jd * model.slot_time_us(tokens / jd));
  }
  return best;
}

}  // namespace eplb::placement
