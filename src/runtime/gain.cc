// A rebalance only when it pays, the runtime's half (gain.h).

#include "runtime/gain.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "eplb/core/error.h"

namespace eplb::runtime {
namespace {

int64_t fixed(double v) { return std::llround(v * kGainUnit); }

}  // namespace

void GainBook::on_record(const RebalanceRecord& record, Mode mode) {
  if (record.outcome != Outcome::kCompleted || record.bytes_read <= 0 || !(record.read_ms > 0)) {
    return;
  }
  bytes_read_ = record.bytes_read;
  read_ns_ = std::llround(record.read_ms * 1e6);
  const double stall_ms =
      mode == Mode::kSync ? std::max(0.0, record.stall_total_ms - record.read_ms)
                          : record.stall_total_ms;
  stall_ns_ = std::llround(stall_ms * 1e6);
}

void GainBook::append(std::vector<int64_t>& window, int64_t window_steps) const {
  window.push_back(1);
  window.push_back(window_steps);
  window.push_back(bytes_read_);
  window.push_back(read_ns_);
  window.push_back(stall_ns_);
  if (!model_) {
    window.insert(window.end(), 7, 0);
    return;
  }
  const placement::CostModel& m = *model_;
  window.push_back(1);
  for (const double v :
       {m.rank_us, m.slot_us, m.token_us, m.knee_tokens, m.token_us_above, m.noise}) {
    window.push_back(fixed(v));
  }
}

GainFigures take_gain_figures(std::vector<int64_t>& window, int64_t loads) {
  GainFigures f;
  if (static_cast<int64_t>(window.size()) != loads + kGainTail) {
    window.resize(static_cast<size_t>(std::min<int64_t>(loads, static_cast<int64_t>(window.size()))));
    return f;
  }
  const int64_t* t = window.data() + loads;
  f.ranks = t[0];
  if (f.ranks > 0) {
    const auto n = static_cast<double>(f.ranks);
    f.window_steps = static_cast<double>(t[1]) / n;
    const double read_s = static_cast<double>(t[3]) / 1e9 / n;  // the mean rank's
    f.bytes_per_s = read_s > 0 ? static_cast<double>(t[2]) / read_s : 0.0;
    f.stall_us = static_cast<double>(t[4]) / 1e3 / n;
    if (t[5] > 0) {
      const auto m = static_cast<double>(t[5]);  // ranks with a model
      const auto mean = [&](int64_t i) { return static_cast<double>(t[i]) / kGainUnit / m; };
      placement::CostModel model;
      model.rank_us = mean(6);
      model.slot_us = mean(7);
      model.token_us = mean(8);
      model.knee_tokens = mean(9);
      model.token_us_above = mean(10);
      model.noise = std::min(1.0, mean(11));
      model.source = "the mean of the ranks' models";
      // The mean of valid models is one, but for rounding: where it is not, the tokens preset.
      try {
        model.validate();
        f.model = std::move(model);
      } catch (const InvalidArgument&) {
      }
    }
  }
  window.resize(static_cast<size_t>(loads));
  return f;
}

std::optional<placement::GainDecision> check_gain(const LoadMatrix& window, const Placement& before,
                                                  const Placement& after,
                                                  std::span<const uint8_t> usable_before,
                                                  std::span<const uint8_t> usable_after,
                                                  int64_t bytes, const GainFigures& figures,
                                                  const Config& config) {
  if (config.min_gain == 0) return std::nullopt;
  const placement::CostModel model =
      figures.model ? *figures.model : placement::cost_model_preset("tokens");
  LoadMatrix per_step = window;
  const double steps = std::max(1.0, figures.window_steps);
  for (double& v : per_step.values) v /= steps;
  const double current = placement::modeled_step_us(model, per_step, before, config.layout,
                                                    usable_before);
  const double proposed = placement::modeled_step_us(model, per_step, after, config.layout,
                                                     usable_after);
  const placement::RebalancePrice price{.bytes = static_cast<double>(bytes),
                                        .bytes_per_s = figures.bytes_per_s,
                                        .stall_us = figures.stall_us};
  return placement::decide_rebalance(current, proposed, config.interval, price, config.min_gain);
}

}  // namespace eplb::runtime
