#pragma once
// The scenarios the runtime's suites share (runtime_test.cc, engine_seams_test.cc) and the check
// that every rank of a run agrees with every other.

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/harness.h"

namespace eplb::runtime::testing {

// A skewed synthetic load on 4 thread ranks: 4 layers x 8 experts in 12 slots, 2 nodes.
Scenario skewed(const std::string& name, Mode mode);
// The FLAME trace on 4 thread ranks: 8 layers x 64 experts in 72 slots.
Scenario flame(const std::string& name, Mode mode);
// The same scenario with the ranks as processes (shm control, the given transport).
Scenario as_processes(Scenario s, const std::string& transport);

// Every rank ran cleanly, and every rank's per-step log (tables hash, history) is the same.
void expect_consistent(const Scenario& s, const std::vector<RankResult>& results);

int64_t count(const RankResult& r, Outcome outcome);
int64_t moved_slots(const RankResult& r);

}  // namespace eplb::runtime::testing
