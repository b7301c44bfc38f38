#pragma once
// A test load history for the simulator suites: per-step counts floor(base x Poisson(mean)),
// each expert's base drawn once from lognormal(0, 1).

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "eplb/stats/load_file.h"

namespace eplb::sim {

inline stats::LoadHistory random_history(std::mt19937& rng, int64_t steps, int64_t layers,
                                         int64_t experts, int noise_mean) {
  stats::LoadHistory h;
  h.steps = steps;
  h.layers = layers;
  h.experts = experts;
  std::lognormal_distribution<double> skew(0, 1);
  std::vector<double> base(static_cast<size_t>(layers * experts));
  for (double& b : base) b = skew(rng);
  std::poisson_distribution<int> noise(noise_mean);
  for (int64_t s = 0; s < steps; ++s) {
    for (size_t i = 0; i < base.size(); ++i) h.values.push_back(std::floor(base[i] * noise(rng)));
  }
  return h;
}

}  // namespace eplb::sim
