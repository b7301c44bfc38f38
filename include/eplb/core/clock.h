#pragma once
// Milliseconds between two points of the steady clock, for the figures eplb reports (stalls,
// durations). Defined once here.

#include <chrono>

namespace eplb {

using SteadyClock = std::chrono::steady_clock;

inline double ms_between(SteadyClock::time_point from, SteadyClock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

inline double ms_since(SteadyClock::time_point from) { return ms_between(from, SteadyClock::now()); }

}  // namespace eplb
