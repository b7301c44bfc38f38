// Where a run starts from: a placement file, a load file, or the trivial placement; and the
// helper that fills the arena expert by expert.

#include <algorithm>

#include "eplb/core/error.h"
#include "eplb/placement/policy.h"
#include "eplb/runtime/initial_placement.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/placement_file.h"

namespace eplb::runtime {

Placement placement_from_file(const std::string& path, const Layout& layout) {
  layout.validate();
  stats::PlacementFile file = stats::read_placement(path, layout.experts);
  const Placement& p = file.placement;
  if (p.experts != layout.experts || p.physical != layout.physical) {
    fail("placement file '", path, "' has ", p.experts, " experts and ", p.physical,
         " physical slots per layer but the layout is ", layout.describe());
  }
  if (file.ranks != 0 && file.ranks != layout.ranks) {
    fail("placement file '", path, "' was made for ", file.ranks, " ranks but the layout has ",
         layout.ranks);
  }
  p.validate();
  return std::move(file.placement);
}

Placement placement_from_load(const std::string& path, const Config& config) {
  config.layout.validate();
  stats::LoadReadOptions read_options;
  read_options.experts = config.layout.experts;
  const LoadMatrix load = stats::read_load(path, read_options);
  if (load.experts != config.layout.experts) {
    fail("load file '", path, "' has ", load.experts, " experts per layer but the layout is ",
         config.layout.describe());
  }
  const Placement trivial = trivial_placement(load.layers, load.experts, config.layout.physical);
  placement::PolicyOptions options = config.placement;
  options.previous = &trivial;
  return placement::place(load, config.layout, options);
}

void fill_weights(Rebalancer& rebalancer,
                  const std::function<void(int64_t, int64_t, int32_t, std::span<std::byte>)>& fill) {
  const WeightSpec& spec = rebalancer.weight_spec();
  const int64_t spr = rebalancer.config().layout.slots_per_rank();
  const int64_t first = rebalancer.rank() * spr;
  for (int64_t l = 0; l < spec.layers; ++l) {
    const auto phy2log = rebalancer.phy2log(l);
    for (int64_t t = 0; t < static_cast<int64_t>(spec.tensors.size()); ++t) {
      for (int64_t j = 0; j < spr; ++j) {
        fill(l, t, phy2log[first + j], rebalancer.slot_weights(l, t, j));
      }
    }
  }
}

}  // namespace eplb::runtime
