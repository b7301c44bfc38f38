// Bindings of the cost model (placement/cost.h): the model, its fits, the roofline, presets and
// JSON. `eplb.cost` wraps them.

#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "eplb/core/error.h"
#include "eplb/migration/migration.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/gain.h"

namespace eplb::python {
namespace {

std::vector<double> to_doubles(const py::array_t<double, py::array::c_style | py::array::forcecast>& a,
                               const char* what) {
  if (a.ndim() != 1) fail(what, " must be a 1-D array, got ", a.ndim(), " dimensions");
  return {a.data(), a.data() + a.size()};
}

// placement::decide_rebalance on placements and loads (eplb.should_rebalance wraps it).
py::dict should_rebalance(const LoadArray& load, const IndexArray& current,
                          const IndexArray& proposed, int64_t ranks, int64_t interval,
                          double window_steps, double pull_bytes_per_s, double stall_us,
                          double min_gain, const std::optional<placement::CostModel>& cost,
                          int64_t nodes, int64_t expert_bytes, double bytes_to_move) {
  LoadMatrix per_step = to_load(load);
  const Placement before = to_placement(current, per_step.experts, "current", true);
  const Placement after = to_placement(proposed, per_step.experts, "proposed", true);
  if (before.layers != per_step.layers || after.layers != per_step.layers ||
      after.physical != before.physical) {
    fail("should_rebalance: load [", per_step.layers, ", ", per_step.experts, "], current [",
         before.layers, ", ", before.physical, "] and proposed [", after.layers, ", ",
         after.physical, "] must have the same layers, and the placements the same slots");
  }
  const Layout layout{.experts = per_step.experts, .physical = before.physical, .ranks = ranks,
                      .nodes = nodes, .groups = 1};
  placement::check_min_gain(min_gain);
  if (!(window_steps >= 1) || !std::isfinite(window_steps)) {
    fail("should_rebalance: window_steps is ", window_steps,
         " (the steps the load sums, a finite number >= 1)");
  }
  const placement::CostModel model = cost ? *cost : placement::cost_model_preset("tokens");
  double bytes = bytes_to_move;
  placement::GainDecision d;
  {
    py::gil_scoped_release release;
    layout.validate();
    per_step.validate();
    model.validate();
    for (double& v : per_step.values) v /= window_steps;
    if (bytes < 0) {  // not given: the planner's remote reads
      if (expert_bytes < 1) {
        fail("should_rebalance: give bytes_to_move, or expert_bytes (the bytes of one expert's "
             "weights in one layer, >= 1) to plan the moves; got expert_bytes ", expert_bytes);
      }
      migration::MigrationOptions options;
      options.expert_bytes = expert_bytes;
      bytes = static_cast<double>(
          migration::plan_migration(before, after, layout, options).totals.bytes_total);
    }
    const double current_us = placement::modeled_step_us(model, per_step, before, layout);
    const double proposed_us = placement::modeled_step_us(model, per_step, after, layout);
    d = placement::decide_rebalance(
        current_us, proposed_us, interval,
        {.bytes = bytes, .bytes_per_s = pull_bytes_per_s, .stall_us = stall_us}, min_gain);
  }
  py::dict out;
  out["rebalance"] = d.rebalance;
  out["current_us"] = d.current_us;
  out["proposed_us"] = d.proposed_us;
  out["steps"] = d.steps;
  out["gain_us"] = d.gain_us;
  out["price_us"] = d.price_us;
  out["priced"] = d.priced;
  out["bytes"] = bytes;
  out["min_gain"] = d.min_gain;
  out["reason"] = d.reason;
  return out;
}

}  // namespace

void bind_cost(py::module_& m) {
  using placement::CostModel;
  py::class_<CostModel>(m, "CostModel",
                        "What one rank pays for one MoE layer of one step, in microseconds: "
                        "rank_us + sum over its activated slots of slot_us + token_us * "
                        "min(n, knee) + token_us_above * max(0, n - knee) (no knee: "
                        "knee_tokens 0).")
      .def(py::init([](double rank_us, double slot_us, double token_us, double knee_tokens,
                       double token_us_above, double noise, const std::string& source) {
             CostModel c;
             c.rank_us = rank_us;
             c.slot_us = slot_us;
             c.token_us = token_us;
             c.knee_tokens = knee_tokens;
             c.token_us_above = token_us_above;
             c.noise = noise;
             c.source = source;
             c.validate();
             return c;
           }),
           py::arg("rank_us") = 0.0, py::arg("slot_us") = 0.0, py::arg("token_us") = 1.0,
           py::arg("knee_tokens") = 0.0, py::arg("token_us_above") = 0.0,
           py::arg("noise") = 0.0, py::arg("source") = std::string("python"))
      .def_readwrite("rank_us", &CostModel::rank_us)
      .def_readwrite("slot_us", &CostModel::slot_us)
      .def_readwrite("token_us", &CostModel::token_us)
      .def_readwrite("knee_tokens", &CostModel::knee_tokens)
      .def_readwrite("token_us_above", &CostModel::token_us_above)
      .def_readwrite("noise", &CostModel::noise)
      .def_readwrite("source", &CostModel::source)
      .def_readwrite("heldout_error", &CostModel::heldout_error)
      .def_readwrite("heldout_steps", &CostModel::heldout_steps)
      .def("layer_time_us",
           [](const CostModel& c, const std::vector<double>& rank_times_us) {
             return c.layer_time_us(rank_times_us);
           },
           py::arg("rank_times_us"))
      .def("describe_heldout", &CostModel::describe_heldout)
      .def("validate", &CostModel::validate)
      .def("slot_time_us", &CostModel::slot_time_us, py::arg("tokens"))
      .def("rank_time_us",
           [](const CostModel& c, const std::vector<int64_t>& slot_tokens) {
             return c.rank_time_us(slot_tokens);
           },
           py::arg("slot_tokens"))
      .def("describe", &CostModel::describe)
      .def("to_json", [](const CostModel& c) { return placement::cost_model_to_json(c); })
      .def("__repr__", [](const CostModel& c) { return "CostModel(" + c.describe() + ")"; });

  // The samples of fit_cost_model(_or_tokens)'s arrays; a shape that does not fit is an error
  // either way (only the fit itself falls back).
  using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
  using Steps = std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>>;
  const auto cost_samples = [](const Doubles& slots, const Doubles& tokens, const Doubles& time_us,
                               const Steps& steps) {
    const std::vector<double> s = to_doubles(slots, "slots"), t = to_doubles(tokens, "tokens"),
                              y = to_doubles(time_us, "time_us");
    if (s.size() != t.size() || s.size() != y.size()) {
      fail("fit_cost_model: slots, tokens and time_us have ", s.size(), ", ", t.size(), " and ",
           y.size(), " entries (one per sample each)");
    }
    std::vector<int64_t> step(s.size(), -1);
    if (steps) {
      if (steps->ndim() != 1 || static_cast<size_t>(steps->size()) != s.size()) {
        fail("fit_cost_model: steps must be a 1-D array of ", s.size(),
             " entries (the step of each sample), got ", steps->size());
      }
      for (size_t i = 0; i < s.size(); ++i) {
        step[i] = steps->data()[i];
        if (step[i] < 0) fail("fit_cost_model: steps[", i, "] is ", step[i], " (must be >= 0)");
      }
    }
    std::vector<placement::CostSample> samples;
    for (size_t i = 0; i < s.size(); ++i) samples.push_back({s[i], t[i], y[i], step[i]});
    return samples;
  };
  m.def(
      "fit_cost_model",
      [cost_samples](const Doubles& slots, const Doubles& tokens, const Doubles& time_us,
                     const Steps& steps) {
        const std::vector<placement::CostSample> samples =
            cost_samples(slots, tokens, time_us, steps);
        py::gil_scoped_release release;
        return placement::fit_cost_model(samples);
      },
      py::arg("slots"), py::arg("tokens"), py::arg("time_us"), py::arg("steps") = std::nullopt);
  m.def(
      "fit_cost_model_or_tokens",
      [cost_samples](const Doubles& slots, const Doubles& tokens, const Doubles& time_us,
                     const Steps& steps) {
        const std::vector<placement::CostSample> samples =
            cost_samples(slots, tokens, time_us, steps);
        std::string why;
        placement::CostModel model;
        {
          py::gil_scoped_release release;
          model = placement::fit_cost_model_or_tokens(samples, &why);
        }
        return py::make_tuple(model, why);
      },
      py::arg("slots"), py::arg("tokens"), py::arg("time_us"), py::arg("steps") = std::nullopt);
  m.def(
      "fit_slot_table",
      [](const py::array_t<double, py::array::c_style | py::array::forcecast>& tokens,
         const py::array_t<double, py::array::c_style | py::array::forcecast>& time_us) {
        const std::vector<double> t = to_doubles(tokens, "tokens"), y = to_doubles(time_us, "time_us");
        if (t.size() != y.size()) {
          fail("fit_slot_table: tokens and time_us have ", t.size(), " and ", y.size(),
               " entries (one per row each)");
        }
        std::vector<placement::SlotTiming> table;
        for (size_t i = 0; i < t.size(); ++i) table.push_back({t[i], y[i]});
        return placement::fit_slot_table(table);
      },
      py::arg("tokens"), py::arg("time_us"));
  m.def(
      "roofline_cost_model",
      [](double hbm_bytes_per_s, double peak_flops, double expert_bytes, double flops_per_token,
         double launch_us, double rank_us) {
        return placement::roofline_cost_model({.hbm_bytes_per_s = hbm_bytes_per_s,
                                               .peak_flops = peak_flops,
                                               .expert_bytes = expert_bytes,
                                               .flops_per_token = flops_per_token,
                                               .launch_us = launch_us,
                                               .rank_us = rank_us});
      },
      py::arg("hbm_bytes_per_s") = 0.0, py::arg("peak_flops") = 0.0,
      py::arg("expert_bytes") = 0.0, py::arg("flops_per_token") = 0.0,
      py::arg("launch_us") = 0.0, py::arg("rank_us") = 0.0);
  m.def("cost_model_preset", [](const std::string& name) {
    return placement::cost_model_preset(name);
  }, py::arg("name"));
  m.def("cost_model_presets", &placement::cost_model_presets);
  m.def("should_rebalance", &should_rebalance, py::arg("load"), py::arg("current"),
        py::arg("proposed"), py::arg("ranks"), py::arg("interval"), py::arg("window_steps"),
        py::arg("pull_bytes_per_s"), py::arg("stall_us"), py::arg("min_gain"), py::arg("cost"),
        py::arg("nodes"), py::arg("expert_bytes"), py::arg("bytes_to_move"));
  m.def(
      "cost_model_from_json",
      [](const std::string& text, const std::string& where) {
        return placement::cost_model_from_json(text, where);
      },
      py::arg("text"), py::arg("where") = std::string("cost model"));
}

}  // namespace eplb::python
