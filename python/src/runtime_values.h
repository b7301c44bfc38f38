#pragma once
// The runtime's values as Python sees them: its Config from a dict keyed by the C++ field names,
// and back; a RebalanceRecord as a dict; metric families as plain lists. Used by runtime.cc.

#include <prometheus/metric_family.h>

#include <vector>

#include "bindings.h"
#include "eplb/runtime/rebalancer.h"

namespace eplb::python {

// A runtime::Config from a dict whose keys are the C++ field names (the layout's flattened in,
// timeout as timeout_ms). `ranks` defaults to the world size. InvalidArgument naming an unknown
// key or a value of the wrong type.
runtime::Config to_config(const py::dict& d, int world_size);
py::dict config_dict(const runtime::Config& c);
py::dict record_dict(const runtime::RebalanceRecord& r);
// Metric families as plain Python values: [{"name", "help", "type", "samples": [(name,
// labels, value)]}], the samples named as the text exposition names them (a histogram's
// _bucket with its "le", _count, _sum).
py::list metric_families_list(const std::vector<prometheus::MetricFamily>& families);

}  // namespace eplb::python
