#pragma once
// What every rank must agree on before serving, as one number: the fingerprint connect()
// compares across ranks (config.cc, with the Config and WeightSpec checks and the names).

#include <cstdint>

#include "eplb/runtime/rebalancer.h"

namespace eplb::runtime {

// FNV-1a over the layout, the protocol's options and the tensor sizes and strides.
uint64_t config_fingerprint(const Config& c, const WeightSpec& w);

}  // namespace eplb::runtime
