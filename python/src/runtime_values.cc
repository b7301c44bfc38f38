// The runtime's values as Python sees them (runtime_values.h).

#include "runtime_values.h"

#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <string>

#include "eplb/core/error.h"
#include "eplb/routing/dispatch.h"

namespace eplb::python {
namespace {

int64_t int_of(const py::handle& value, const std::string& key) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) {
    fail("config['", key, "'] must be an integer, got ",
         py::str(py::repr(value)).cast<std::string>());
  }
  const auto index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) {
    fail("config['", key, "'] is ", py::str(index).cast<std::string>(),
         ", outside the 64-bit integer range");
  }
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

double float_of(const py::handle& value, const std::string& key) {
  if (PyBool_Check(value.ptr()) || !(PyFloat_Check(value.ptr()) || PyIndex_Check(value.ptr()))) {
    fail("config['", key, "'] must be a number, got ",
         py::str(py::repr(value)).cast<std::string>());
  }
  const double v = PyFloat_AsDouble(value.ptr());  // an int too large for a double: an error
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    fail("config['", key, "'] is ", py::str(py::repr(value)).cast<std::string>(),
         ", too large for a floating-point number");
  }
  return v;
}

std::string string_of(const py::handle& value, const std::string& key) {
  if (!py::isinstance<py::str>(value)) {
    fail("config['", key, "'] must be a string, got ",
         py::str(py::repr(value)).cast<std::string>());
  }
  return value.cast<std::string>();
}

bool bool_of(const py::handle& value, const std::string& key) {
  if (!PyBool_Check(value.ptr())) {
    fail("config['", key, "'] must be True or False, got ",
         py::str(py::repr(value)).cast<std::string>());
  }
  return value.cast<bool>();
}

constexpr const char* kConfigKeys =
    "experts, physical, ranks, nodes, groups, interval, window, policy, hierarchical, "
    "tolerance, thorough, min_gain, min_balancedness_gain, cost, lag, timeout_ms, mode, agreement, "
    "install, peers_per_round, "
    "dispatch, on_error, stall_warn_ms, balancedness_period, backup_copies, metric_labels";

}  // namespace

runtime::Config to_config(const py::dict& d, int world_size) {
  runtime::Config c;
  c.layout.ranks = world_size;
  bool has_experts = false, has_physical = false;
  for (const auto& [k, v] : d) {
    if (!py::isinstance<py::str>(k)) {
      fail("config keys must be strings, got ", py::str(py::repr(k)).cast<std::string>());
    }
    const std::string key = k.cast<std::string>();
    if (key == "experts") {
      c.layout.experts = int_of(v, key);
      has_experts = true;
    } else if (key == "physical") {
      c.layout.physical = int_of(v, key);
      has_physical = true;
    } else if (key == "ranks") {
      c.layout.ranks = int_of(v, key);
    } else if (key == "nodes") {
      c.layout.nodes = int_of(v, key);
    } else if (key == "groups") {
      c.layout.groups = int_of(v, key);
    } else if (key == "interval") {
      c.interval = int_of(v, key);
    } else if (key == "window") {
      c.window = int_of(v, key);
    } else if (key == "policy") {
      c.placement.policy = placement::parse_policy(string_of(v, key));
    } else if (key == "hierarchical") {
      c.placement.hierarchical = bool_of(v, key);
    } else if (key == "tolerance") {
      c.placement.tolerance = float_of(v, key);
    } else if (key == "thorough") {
      c.placement.thorough = bool_of(v, key);
    } else if (key == "min_gain") {
      c.min_gain = float_of(v, key);
    } else if (key == "min_balancedness_gain") {
      c.min_balancedness_gain = float_of(v, key);
    } else if (key == "cost") {
      if (!py::isinstance<placement::CostModel>(v)) {
        fail("config['cost'] must be an eplb.cost.CostModel (a preset, a fit or JSON: "
             "eplb.cost), got ", py::str(py::repr(v)).cast<std::string>());
      }
      c.cost = v.cast<placement::CostModel>();
    } else if (key == "lag") {
      c.lag = int_of(v, key);
    } else if (key == "timeout_ms") {
      c.timeout = std::chrono::milliseconds(int_of(v, key));
    } else if (key == "mode") {
      c.mode = runtime::parse_mode(string_of(v, key));
    } else if (key == "agreement") {
      c.agreement = runtime::parse_agreement(string_of(v, key));
    } else if (key == "peers_per_round") {
      c.peers_per_round = int_of(v, key);
    } else if (key == "dispatch") {
      c.dispatch = routing::parse_dispatch_policy(string_of(v, key));
    } else if (key == "install") {
      c.install = runtime::parse_install(string_of(v, key));
    } else if (key == "on_error") {
      c.on_error = runtime::parse_on_error(string_of(v, key));
    } else if (key == "stall_warn_ms") {
      c.stall_warn = std::chrono::milliseconds(int_of(v, key));
    } else if (key == "balancedness_period") {
      c.balancedness_period = int_of(v, key);
    } else if (key == "backup_copies") {
      c.backup.copies = int_of(v, key);  // Backup::loader is C++ only: see runtime.py
    } else if (key == "metric_labels") {
      if (!py::isinstance<py::dict>(v)) {
        fail("config['metric_labels'] must be a dict of label name -> value, got ",
             py::str(py::repr(v)).cast<std::string>());
      }
      for (const auto& [name, value] : v.cast<py::dict>()) {
        if (!py::isinstance<py::str>(name) || !py::isinstance<py::str>(value)) {
          fail("config['metric_labels'] must map strings to strings, got ",
               py::str(py::repr(name)).cast<std::string>(), ": ",
               py::str(py::repr(value)).cast<std::string>());
        }
        c.metric_labels[name.cast<std::string>()] = value.cast<std::string>();
      }
    } else {
      fail("unknown config key '", key, "' (known: ", kConfigKeys, ")");
    }
  }
  if (!has_experts) fail("config needs 'experts' (logical experts per layer)");
  if (!has_physical)
    fail("config needs 'physical' (physical slots per layer, experts + redundant)");
  if (c.layout.ranks != world_size) {
    fail("config['ranks'] ", c.layout.ranks, " differs from world_size ", world_size,
         " (the layout's ranks are the control group's size)");
  }
  c.validate();
  return c;
}

py::dict config_dict(const runtime::Config& c) {
  py::dict d;
  d["experts"] = c.layout.experts;
  d["physical"] = c.layout.physical;
  d["ranks"] = c.layout.ranks;
  d["nodes"] = c.layout.nodes;
  d["groups"] = c.layout.groups;
  d["interval"] = c.interval;
  d["window"] = c.window;
  d["policy"] = std::string(placement::policy_name(c.placement.policy));
  d["hierarchical"] = c.placement.hierarchical;
  d["tolerance"] = c.placement.tolerance;
  d["thorough"] = c.placement.thorough;
  d["min_gain"] = c.min_gain;
  d["min_balancedness_gain"] = c.min_balancedness_gain;
  d["cost"] = c.cost ? py::cast(*c.cost) : py::none();
  d["lag"] = c.lag;
  d["timeout_ms"] = static_cast<int64_t>(c.timeout.count());
  d["mode"] = std::string(runtime::mode_name(c.mode));
  d["agreement"] = std::string(runtime::agreement_name(c.agreement));
  d["peers_per_round"] = c.peers_per_round;
  d["dispatch"] = std::string(routing::dispatch_policy_name(c.dispatch));
  d["install"] = std::string(runtime::install_name(c.install));
  d["on_error"] = c.on_error == runtime::OnError::kRaise ? "raise" : "log";
  d["stall_warn_ms"] = static_cast<int64_t>(c.stall_warn.count());
  d["balancedness_period"] = c.balancedness_period;
  d["backup_copies"] = c.backup.copies;
  py::dict labels;
  for (const auto& [name, value] : c.metric_labels) labels[py::str(name)] = value;
  d["metric_labels"] = labels;
  return d;
}

py::dict record_dict(const runtime::RebalanceRecord& r) {
  py::dict d;
  d["index"] = r.index;
  d["trigger_step"] = r.trigger_step;
  d["end_step"] = r.end_step;
  d["outcome"] = std::string(runtime::outcome_name(r.outcome));
  d["error"] = r.error;
  d["placement_ms"] = r.placement_ms;
  d["balancedness_before"] = r.balancedness_before;
  d["balancedness_after"] = r.balancedness_after;
  d["layers_moved"] = r.layers_moved;
  d["layers_installed"] = r.layers_installed;
  d["slots_moved"] = r.slots_moved;
  d["bytes_intra_node"] = r.bytes_intra_node;
  d["bytes_inter_node"] = r.bytes_inter_node;
  d["bytes_local_copy"] = r.bytes_local_copy;
  d["rounds"] = r.rounds;
  d["bytes_installed"] = r.bytes_installed;
  d["bytes_restored"] = r.bytes_restored;
  d["repair"] = r.repair;
  d["proposed"] = r.proposed;
  d["steps"] = r.steps;
  d["seconds"] = r.seconds;
  d["stall_total_ms"] = r.stall_total_ms;
  d["stall_max_ms"] = r.stall_max_ms;
  d["stall_preempted_ms"] = r.stall_preempted_ms;
  d["bytes_read"] = r.bytes_read;
  d["read_ms"] = r.read_ms;
  d["gain_checked"] = r.gain_checked;
  d["below_min_gain"] = r.below_min_gain;
  d["priced"] = r.priced;
  d["moe_us_before"] = r.moe_us_before;
  d["moe_us_after"] = r.moe_us_after;
  d["gain_us"] = r.gain_us;
  d["price_us"] = r.price_us;
  return d;
}

py::list metric_families_list(const std::vector<prometheus::MetricFamily>& families) {
  const auto labels_of = [](const prometheus::ClientMetric& m) {
    py::dict d;
    for (const auto& l : m.label) d[py::str(l.name)] = l.value;
    return d;
  };
  py::list out;
  for (const prometheus::MetricFamily& f : families) {
    py::list samples;
    for (const prometheus::ClientMetric& m : f.metric) {
      switch (f.type) {
        case prometheus::MetricType::Counter:
          samples.append(py::make_tuple(f.name, labels_of(m), m.counter.value));
          break;
        case prometheus::MetricType::Gauge:
          samples.append(py::make_tuple(f.name, labels_of(m), m.gauge.value));
          break;
        case prometheus::MetricType::Untyped:
          samples.append(py::make_tuple(f.name, labels_of(m), m.untyped.value));
          break;
        case prometheus::MetricType::Histogram:
          for (const auto& b : m.histogram.bucket) {
            py::dict l = labels_of(m);
            l["le"] =
                std::isinf(b.upper_bound) ? std::string("+Inf") : fmt::format("{}", b.upper_bound);
            samples.append(
                py::make_tuple(f.name + "_bucket", l, static_cast<double>(b.cumulative_count)));
          }
          samples.append(py::make_tuple(f.name + "_count", labels_of(m),
                                        static_cast<double>(m.histogram.sample_count)));
          samples.append(py::make_tuple(f.name + "_sum", labels_of(m), m.histogram.sample_sum));
          break;
        case prometheus::MetricType::Summary:
          samples.append(py::make_tuple(f.name + "_count", labels_of(m),
                                        static_cast<double>(m.summary.sample_count)));
          samples.append(py::make_tuple(f.name + "_sum", labels_of(m), m.summary.sample_sum));
          break;
      }
    }
    const char* type = f.type == prometheus::MetricType::Counter     ? "counter"
                       : f.type == prometheus::MetricType::Gauge     ? "gauge"
                       : f.type == prometheus::MetricType::Histogram ? "histogram"
                       : f.type == prometheus::MetricType::Summary   ? "summary"
                                                                     : "untyped";
    py::dict d;
    d["name"] = f.name;
    d["help"] = f.help;
    d["type"] = type;
    d["samples"] = samples;
    out.append(d);
  }
  return out;
}

}  // namespace eplb::python
