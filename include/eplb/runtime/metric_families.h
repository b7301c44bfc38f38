#pragma once
// Metric families of one or more Rebalancers, moved between processes and merged: what
// `eplb run --metrics` does with the families of its rank processes. The families are
// prometheus-cpp's (Rebalancer::collect_metrics()).

#include <string>
#include <string_view>
#include <vector>

#include <prometheus/metric_family.h>

namespace eplb::runtime {

// The text exposition format (prometheus-cpp's TextSerializer).
std::string metrics_text(const std::vector<prometheus::MetricFamily>& families);

// JSON that families_from_json reads back to the same families (InvalidArgument naming what is
// malformed otherwise).
std::string families_to_json(const std::vector<prometheus::MetricFamily>& families);
std::vector<prometheus::MetricFamily> families_from_json(std::string_view json);

// One family per name, in order of first appearance, holding the metrics of every input
// family of that name (the ranks' metrics, told apart by their rank label). InvalidArgument
// when two families of one name disagree on their type.
std::vector<prometheus::MetricFamily> merge_families(
    const std::vector<std::vector<prometheus::MetricFamily>>& sets);

}  // namespace eplb::runtime
