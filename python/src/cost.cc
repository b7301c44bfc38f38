// Bindings of the cost model (placement/cost.h): the model, its fits, the roofline, presets and
// JSON. `eplb.cost` wraps them.

#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "eplb/core/error.h"
#include "eplb/placement/cost.h"

namespace eplb::python {
namespace {

std::vector<double> to_doubles(const py::array_t<double, py::array::c_style | py::array::forcecast>& a,
                               const char* what) {
  if (a.ndim() != 1) fail(what, " must be a 1-D array, got ", a.ndim(), " dimensions");
  return {a.data(), a.data() + a.size()};
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
                       double token_us_above, const std::string& source) {
             CostModel c;
             c.rank_us = rank_us;
             c.slot_us = slot_us;
             c.token_us = token_us;
             c.knee_tokens = knee_tokens;
             c.token_us_above = token_us_above;
             c.source = source;
             c.validate();
             return c;
           }),
           py::arg("rank_us") = 0.0, py::arg("slot_us") = 0.0, py::arg("token_us") = 1.0,
           py::arg("knee_tokens") = 0.0, py::arg("token_us_above") = 0.0,
           py::arg("source") = std::string("python"))
      .def_readwrite("rank_us", &CostModel::rank_us)
      .def_readwrite("slot_us", &CostModel::slot_us)
      .def_readwrite("token_us", &CostModel::token_us)
      .def_readwrite("knee_tokens", &CostModel::knee_tokens)
      .def_readwrite("token_us_above", &CostModel::token_us_above)
      .def_readwrite("source", &CostModel::source)
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

  m.def(
      "fit_cost_model",
      [](const py::array_t<double, py::array::c_style | py::array::forcecast>& slots,
         const py::array_t<double, py::array::c_style | py::array::forcecast>& tokens,
         const py::array_t<double, py::array::c_style | py::array::forcecast>& time_us) {
        const std::vector<double> s = to_doubles(slots, "slots"), t = to_doubles(tokens, "tokens"),
                                  y = to_doubles(time_us, "time_us");
        if (s.size() != t.size() || s.size() != y.size()) {
          fail("fit_cost_model: slots, tokens and time_us have ", s.size(), ", ", t.size(),
               " and ", y.size(), " entries (one per sample each)");
        }
        std::vector<placement::CostSample> samples;
        for (size_t i = 0; i < s.size(); ++i) samples.push_back({s[i], t[i], y[i]});
        py::gil_scoped_release release;
        return placement::fit_cost_model(samples);
      },
      py::arg("slots"), py::arg("tokens"), py::arg("time_us"));
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
  m.def(
      "cost_model_from_json",
      [](const std::string& text, const std::string& where) {
        return placement::cost_model_from_json(text, where);
      },
      py::arg("text"), py::arg("where") = std::string("cost model"));
}

}  // namespace eplb::python
