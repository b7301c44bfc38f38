// The load recorder at DeepSeek-V3's shape (58 MoE layers x 256 experts, vLLM's default window
// of 1000 steps), per step on the forward thread: one rank's ids recorded in every layer, then
// step_end(). BM_StepEnd* alone is the fold of a closed step into the ring and window sum;
// BM_StepEndInt64Ring is the same fold into an int64 ring (the layout before the ring held int32),
// measured in the same run, for the ratio. The memory each holds is in the counters.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "eplb/stats/recorder.h"

namespace {

using eplb::stats::LoadRecorder;

constexpr int64_t kLayers = 58, kExperts = 256, kWindow = 1000, kTopK = 8;

std::vector<int32_t> ids_of_step(int64_t tokens) {
  std::mt19937_64 rng(3);
  std::vector<int32_t> ids(static_cast<size_t>(tokens * kTopK));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % kExperts);
  return ids;
}

void BM_RecordAndStepEnd(benchmark::State& state) {
  const std::vector<int32_t> ids = ids_of_step(state.range(0));
  LoadRecorder rec(kLayers, kExperts, kWindow);
  for (auto _ : state) {
    for (int64_t l = 0; l < kLayers; ++l) rec.record(l, ids);
    rec.step_end();
  }
  state.counters["bytes"] =
      static_cast<double>(LoadRecorder::bytes_for(kLayers, kExperts, kWindow));
}
BENCHMARK(BM_RecordAndStepEnd)->Arg(16)->Arg(256)->Unit(benchmark::kMicrosecond);

void BM_StepEnd(benchmark::State& state) {
  LoadRecorder rec(kLayers, kExperts, kWindow);
  const std::vector<int64_t> counts(kExperts, 3);
  for (auto _ : state) {
    state.PauseTiming();
    for (int64_t l = 0; l < kLayers; ++l) rec.record_counts(l, counts);
    state.ResumeTiming();
    rec.step_end();
  }
  state.counters["bytes"] =
      static_cast<double>(LoadRecorder::bytes_for(kLayers, kExperts, kWindow));
}
BENCHMARK(BM_StepEnd)->Unit(benchmark::kMicrosecond);

void BM_StepEndInt64Ring(benchmark::State& state) {
  const size_t cells = kLayers * kExperts;
  std::vector<int64_t> current(cells), sum(cells), ring(cells * kWindow);
  int64_t slot = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::fill(current.begin(), current.end(), 3);
    state.ResumeTiming();
    int64_t* r = ring.data() + static_cast<size_t>(slot) * cells;
    for (size_t i = 0; i < cells; ++i) {
      sum[i] += current[i] - r[i];
      r[i] = current[i];
      current[i] = 0;
    }
    slot = (slot + 1) % kWindow;
    benchmark::DoNotOptimize(sum.data());
  }
  state.counters["bytes"] = static_cast<double>((ring.size() + 2 * cells) * sizeof(int64_t));
}
BENCHMARK(BM_StepEndInt64Ring)->Unit(benchmark::kMicrosecond);

}  // namespace
