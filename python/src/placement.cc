// Bindings of the placement layer: place(), the metrics and the lower bound.

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "eplb/core/error.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"

namespace eplb::python {
namespace {

py::array_t<double> doubles(const std::vector<double>& v) {
  return py::array_t<double>(static_cast<py::ssize_t>(v.size()), v.data());
}

// -> (phy2log [L][P], log2phy [L][E][max_replicas], replica_count [L][E]), all int64.
py::tuple place(const LoadArray& weight, int64_t physical, int64_t ranks, int64_t nodes,
                int64_t groups, const std::string& policy,
                const std::optional<IndexArray>& previous, double tolerance, bool hierarchical,
                bool thorough, const std::vector<int64_t>& live_ranks) {
  const LoadMatrix load = to_load(weight);
  const Layout layout{.experts = load.experts,
                      .physical = physical,
                      .ranks = ranks,
                      .nodes = nodes,
                      .groups = groups};
  placement::PolicyOptions options;
  options.policy = placement::parse_policy(policy);
  options.hierarchical = hierarchical;
  options.thorough = thorough;
  options.tolerance = tolerance;
  for (const int64_t rank : live_ranks) {
    // Range and order are the library's checks; this only keeps the cast exact.
    if (rank < 0 || rank >= ranks) fail("live rank ", rank, " is outside [0, ", ranks, ")");
    options.live_ranks.push_back(static_cast<int32_t>(rank));
  }
  std::optional<Placement> prev;
  if (previous) {
    // An expert may lack a slot in the placement in force (it lived on ranks that are gone):
    // the policy gives it one, so only the slots' expert ids are checked here.
    prev = to_placement(*previous, load.experts, "previous", false);
    options.previous = &*prev;
  }

  Placement out;
  {
    py::gil_scoped_release release;
    out = placement::place(load, layout, options);
  }
  return py::make_tuple(to_numpy(out.phy2log.data(), {out.layers, out.physical}),
                        to_numpy(out.log2phy.data(), {out.layers, out.experts, out.max_replicas}),
                        to_numpy(out.replica_count.data(), {out.layers, out.experts}));
}

// -> dict of evaluate()'s figures (the per-layer ones as float64 arrays).
py::dict evaluate(const LoadArray& weight, const IndexArray& phy2log, int64_t ranks) {
  const LoadMatrix load = to_load(weight);
  if (phy2log.ndim() == 2 && phy2log.shape(0) != load.layers) {
    fail("phy2log has ", phy2log.shape(0), " layers but weight has ", load.layers);
  }
  const Placement placement = to_placement(phy2log, load.experts, "phy2log", true);
  const Layout layout{.experts = load.experts,
                      .physical = placement.physical,
                      .ranks = ranks,
                      .nodes = 1,
                      .groups = 1};
  placement::PlacementMetrics metrics;
  {
    py::gil_scoped_release release;
    metrics = placement::evaluate(load, placement, layout);
  }
  py::dict out;
  out["balancedness"] = doubles(metrics.balancedness);
  out["lower_bound_balancedness"] = doubles(metrics.lower_bound_balancedness);
  out["mean_rank_load"] = doubles(metrics.mean_rank_load);
  out["max_rank_load"] = doubles(metrics.max_rank_load);
  out["balancedness_mean"] = metrics.balancedness_mean;
  out["balancedness_step"] = metrics.balancedness_step;
  out["lower_bound_mean"] = metrics.lower_bound_mean;
  return out;
}

// -> the lower bound of each layer's max rank load, float64 [L].
py::array_t<double> lower_bound(const LoadArray& weight, int64_t physical, int64_t ranks) {
  const LoadMatrix load = to_load(weight);
  const Layout layout{
      .experts = load.experts, .physical = physical, .ranks = ranks, .nodes = 1, .groups = 1};
  std::vector<double> bound(static_cast<size_t>(load.layers));
  {
    py::gil_scoped_release release;
    load.validate();
    for (int64_t l = 0; l < load.layers; ++l) {
      bound[l] = placement::layer_lower_bound(load.row(l), layout);
    }
  }
  return doubles(bound);
}

}  // namespace

void bind_placement(py::module_& m) {
  m.def("place", &place, py::arg("weight"), py::arg("physical"), py::arg("ranks"), py::arg("nodes"),
        py::arg("groups"), py::arg("policy"), py::arg("previous"), py::arg("tolerance"),
        py::arg("hierarchical"), py::arg("thorough") = false,
        py::arg("live_ranks") = std::vector<int64_t>{},
        "placement::place(): (phy2log [L][P], log2phy [L][E][max], replica_count [L][E]); "
        "live_ranks, ascending, empty for every rank.");
  m.def("evaluate", &evaluate, py::arg("weight"), py::arg("phy2log"), py::arg("ranks"),
        "placement::evaluate() as a dict.");
  m.def("lower_bound", &lower_bound, py::arg("weight"), py::arg("physical"), py::arg("ranks"),
        "placement::layer_lower_bound() of every layer, float64 [L].");
}

}  // namespace eplb::python
