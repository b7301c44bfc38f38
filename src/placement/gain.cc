// What a rebalance buys and what it costs (placement/gain.h).

#include "eplb/placement/gain.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::placement {

void check_min_gain(double min_gain, std::string_view what) {
  if (!std::isfinite(min_gain) || min_gain < 0) {
    fail(what, " is ", min_gain,
         " (must be a finite number >= 0: a rebalance must be predicted to save at least "
         "min_gain times its price; 0 skips none)");
  }
}

void RebalancePrice::validate() const {
  const auto check = [](std::string_view name, double v) {
    if (!std::isfinite(v) || v < 0) {
      fail("rebalance price: ", name, " is ", v, " (must be a finite number >= 0)");
    }
  };
  check("bytes", bytes);
  check("bytes_per_s", bytes_per_s);
  check("stall_us", stall_us);
}

double modeled_step_us(const CostModel& model, const LoadMatrix& load, const Placement& placement,
                       const Layout& layout, std::span<const uint8_t> usable) {
  if (load.experts != layout.experts || placement.experts != layout.experts ||
      placement.physical != layout.physical || placement.layers != load.layers ||
      load.values.size() != static_cast<size_t>(load.layers * load.experts)) {
    fail("modeled step time: load [", load.layers, " x ", load.experts, "], placement [",
         placement.layers, " x ", placement.physical, "] and layout ", layout.describe(),
         " do not fit together");
  }
  const int64_t physical = layout.physical, spr = layout.slots_per_rank();
  if (!usable.empty() && usable.size() != static_cast<size_t>(load.layers * physical)) {
    fail("modeled step time: usable has ", usable.size(), " entries, expected ",
         load.layers * physical, " (layers x physical)");
  }
  const auto serves = [&](int64_t l, int64_t p) {
    return usable.empty() || usable[static_cast<size_t>(l * physical + p)] != 0;
  };
  std::vector<int64_t> replicas(static_cast<size_t>(layout.experts));
  std::vector<double> times;
  double total = 0;
  for (int64_t l = 0; l < load.layers; ++l) {
    const std::span<const double> w = load.row(l);
    const int32_t* slots = placement.phy2log.data() + l * physical;
    double layer_load = 0;
    for (const double v : w) layer_load += v;
    if (!(layer_load > 0)) continue;  // dense
    std::fill(replicas.begin(), replicas.end(), 0);
    for (int64_t p = 0; p < physical; ++p) {
      if (serves(l, p)) ++replicas[static_cast<size_t>(slots[p])];
    }
    times.clear();
    for (int64_t g = 0; g < layout.ranks; ++g) {
      double t = model.rank_us;
      bool any = false;
      for (int64_t p = g * spr; p < (g + 1) * spr; ++p) {
        if (!serves(l, p)) continue;
        any = true;
        const auto e = static_cast<size_t>(slots[p]);
        t += model.slot_time_us(w[e] / static_cast<double>(replicas[e]));
      }
      if (any) times.push_back(t);
    }
    total += model.layer_time_us(times);
  }
  return total;
}

GainDecision decide_rebalance(double current_us, double proposed_us, int64_t steps,
                              const RebalancePrice& price, double min_gain) {
  check_min_gain(min_gain);
  price.validate();
  if (steps < 1) fail("rebalance gain: steps is ", steps, " (the interval, at least 1 step)");
  for (const auto& [name, v] : {std::pair{"current_us", current_us}, {"proposed_us", proposed_us}}) {
    if (!std::isfinite(v) || v < 0) {
      fail("rebalance gain: ", name, " is ", v, " (a modeled time: finite and >= 0)");
    }
  }
  GainDecision d;
  d.current_us = current_us;
  d.proposed_us = proposed_us;
  d.steps = steps;
  d.gain_us = (current_us - proposed_us) * static_cast<double>(steps);
  d.priced = price.known();
  d.price_us = d.priced ? price.us() : 0.0;
  d.min_gain = min_gain;
  if (min_gain == 0 || !d.priced) return d;
  if (d.gain_us < min_gain * d.price_us) {
    d.rebalance = false;
    const std::string moves =
        price.bytes > 0 ? fmt::format("{:.4g} MB to move at {:.4g} GB/s", price.bytes / 1e6,
                                      price.bytes_per_s / 1e9)
                        : std::string("no bytes to move");
    d.reason = fmt::format(
        "predicted gain {:.4g} us over the next {} steps (modeled MoE time per step {:.4g} -> "
        "{:.4g} us) is below min_gain {:.4g} x the price {:.4g} us ({}, stall {:.4g} us)",
        d.gain_us, steps, current_us, proposed_us, min_gain, d.price_us, moves, price.stall_us);
  }
  return d;
}

}  // namespace eplb::placement
