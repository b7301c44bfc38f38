// Multi-rank tests of the runtime: ranks as threads (inproc control + inproc transport) and as
// processes (shm control + shm or ucx transport), async and sync, with random delays, a
// failing worker, a rank killed mid-rebalance, and shutdown mid-rebalance. The invariants
// checked at every step are listed in harness.h. Timings never decide a result. Single-rank
// tests of files and configuration are in runtime_config_test.cc.

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "runtime/harness.h"
#include "runtime/scenarios.h"

namespace eplb::runtime {
namespace {

using testing::as_processes;
using testing::Carrier;
using testing::count;
using testing::expect_consistent;
using testing::flame;
using testing::LoadSource;
using testing::moved_slots;
using testing::RankResult;
using testing::Scenario;
using testing::skewed;

class QuietLogs : public ::testing::Environment {
 public:
  // EPLB_TEST_LOG=info shows every rebalance's record.
  void SetUp() override {
    const char* level = std::getenv("EPLB_TEST_LOG");
    spdlog::set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
  }
};
const auto* const kQuiet = ::testing::AddGlobalTestEnvironment(new QuietLogs);

// ---------------------------------------------------------------- threads

TEST(RuntimeThreads, AsyncSkewedWithDelays) {
  Scenario s = skewed("async-skewed", Mode::kAsync);
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
  EXPECT_GT(moved_slots(results[0]), 0);
}

TEST(RuntimeThreads, CopyInstallKeepsWeightsInPlace) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    Scenario s = skewed(std::string("copy-install-") + std::string(mode_name(mode)), mode);
    s.config.install = Install::kCopy;
    s.installer = true;
    s.delays = true;
    const auto results = testing::run_scenario(s);
    expect_consistent(s, results);
    EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
    EXPECT_GT(moved_slots(results[0]), 0);
  }
}

// Installs into the engine's tensors write only the slots whose expert changes: over all
// ranks, slots moved x the bytes of an expert, for every completed rebalance.
void expect_engine_installs(const Scenario& s, const std::vector<RankResult>& results) {
  const RankResult& reference = results[0];
  for (size_t i = 0; i < reference.history.size(); ++i) {
    if (reference.history[i].outcome != Outcome::kCompleted) continue;
    int64_t written = 0;
    for (const RankResult& r : results) written += r.history.at(i).bytes_installed;
    EXPECT_EQ(written, reference.history[i].slots_moved * s.weights.expert_bytes())
        << "rebalance " << i;
  }
}

// The engine keeps its tensors: unaligned, with gaps between slots (never written), at
// addresses that never change, installs writing only what changes.
TEST(RuntimeThreads, EngineWeightsStayTheEngines) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    for (const int64_t pad : {int64_t{0}, int64_t{13}}) {
      Scenario s = skewed(std::string("engine-") + std::string(mode_name(mode)) + "-pad" +
                              std::to_string(pad),
                          mode);
      s.engine_weights = true;
      s.engine_pad = pad;
      s.delays = true;
      const auto results = testing::run_scenario(s);
      expect_consistent(s, results);
      EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
      EXPECT_GT(moved_slots(results[0]), 0);
      expect_engine_installs(s, results);
    }
  }
}

TEST(RuntimeThreads, EngineWeightsWithAnInstaller) {
  Scenario s = skewed("engine-installer", Mode::kAsync);
  s.engine_weights = true;
  s.engine_pad = 8;
  s.installer = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

TEST(RuntimeConfig, InstallNames) {
  EXPECT_EQ(parse_install("swap"), Install::kSwap);
  EXPECT_EQ(parse_install("copy"), Install::kCopy);
  EXPECT_EQ(install_name(Install::kCopy), "copy");
  try {
    parse_install("move");
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'move' (choose swap or copy)"), std::string::npos);
  }
}

TEST(RuntimeThreads, SyncSkewedWithDelays) {
  Scenario s = skewed("sync-skewed", Mode::kSync);
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
  for (const auto& h : results[0].history) EXPECT_EQ(h.steps, 0) << "sync ends where it starts";
}

TEST(RuntimeThreads, AsyncFlameStickyLagOne) {
  Scenario s = flame("async-flame", Mode::kAsync);
  s.config.placement.policy = placement::Policy::kSticky;
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

TEST(RuntimeThreads, AsyncTwoPeersPerRoundLagThree) {
  Scenario s = skewed("async-k2", Mode::kAsync);
  s.config.peers_per_round = 2;
  s.config.lag = 3;
  s.config.dispatch = routing::DispatchPolicy::kWeighted;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

// A worker that throws on one rank fails the rebalance on every rank at the same step; the
// control plane stays healthy and later rebalances complete.
TEST(RuntimeThreads, WorkerFailureIsAbandonedEverywhere) {
  Scenario s = skewed("worker-failure", Mode::kAsync);
  s.fail_rank = 2;
  s.fail_at = 3;
  s.completed = 3;
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_EQ(count(results[0], Outcome::kFailed), 1);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
  for (const auto& r : results) {
    for (const auto& h : r.history) {
      if (h.outcome == Outcome::kFailed) {
        EXPECT_NE(h.error.find("rank 2"), std::string::npos) << h.error;
      }
    }
  }
}

TEST(RuntimeThreads, SyncWorkerFailureRaisesEverywhere) {
  Scenario s = skewed("sync-raise", Mode::kSync);
  s.config.on_error = OnError::kRaise;
  s.fail_rank = 1;
  s.fail_at = 2;
  s.completed = 2;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  for (const auto& r : results) EXPECT_EQ(r.raised, 1) << "rank " << r.rank;
}

TEST(RuntimeThreads, AsyncWorkerFailureRaisesEverywhere) {
  Scenario s = skewed("async-raise", Mode::kAsync);
  s.config.on_error = OnError::kRaise;
  s.fail_rank = 3;
  s.fail_at = 1;
  s.completed = 2;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  for (const auto& r : results) EXPECT_EQ(r.raised, 1) << "rank " << r.rank;
}

// Every rank shuts down at the same step while a rebalance runs: no hang, no thread left, and
// the rebalance is recorded as cancelled.
TEST(RuntimeThreads, ShutdownMidRebalance) {
  Scenario s = skewed("shutdown", Mode::kAsync);
  s.stop_mid_rebalance = true;
  s.completed = 1;
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  for (const auto& r : results) {
    ASSERT_FALSE(r.history.empty());
    EXPECT_EQ(r.history.back().outcome, Outcome::kCancelled);
  }
}

// A worker that throws something that is not a std::exception fails the rebalance on every
// rank like any worker error (it used to end the process from the worker thread).
TEST(RuntimeThreads, AsyncWorkerThrowingNonStdExceptionFailsEverywhere) {
  Scenario s = skewed("async-not-std", Mode::kAsync);
  s.fail_rank = 1;
  s.fail_at = 2;
  s.fail_not_std = true;
  s.completed = 2;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_EQ(count(results[0], Outcome::kFailed), 1);
  for (const auto& h : results[1].history) {
    if (h.outcome == Outcome::kFailed) {
      EXPECT_NE(h.error.find("not a std::exception"), std::string::npos) << h.error;
    }
  }
}

// The same in sync mode, where it used to escape step_end with the rebalance left open (no
// rebalance ever triggered again, and the peers waited out their timeout).
TEST(RuntimeThreads, SyncReadThrowingNonStdExceptionFailsEverywhere) {
  Scenario s = skewed("sync-not-std", Mode::kSync);
  s.config.on_error = OnError::kRaise;
  s.fail_rank = 2;
  s.fail_at = 2;
  s.fail_not_std = true;
  s.completed = 2;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  for (const auto& r : results) {
    EXPECT_EQ(r.raised, 1) << "rank " << r.rank;
    EXPECT_EQ(count(r, Outcome::kFailed), 1) << "rank " << r.rank;
  }
}

// A rank fails at its placement while another is still placing: every rank's record of the
// failed rebalance must be the same (plan figures included), whatever point each worker had
// reached. They used to be filled from each rank's own plan when it had one.
TEST(RuntimeThreads, FailureWhileAPeerIsPlacingRecordsTheSameEverywhere) {
  Scenario s = skewed("fail-placing", Mode::kAsync);
  s.fail_rank = 0;
  s.fail_placement = true;
  s.slow_placement_rank = 2;
  s.completed = 2;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);  // the per-step logs include layers moved and installed
  EXPECT_EQ(count(results[0], Outcome::kFailed), 1);
  for (const auto& r : results) {
    for (const auto& h : r.history) {
      if (h.outcome == Outcome::kFailed) {
        EXPECT_EQ(h.slots_moved, 0) << "rank " << r.rank;
      }
    }
  }
}

// A predicted balancedness gain below min_balancedness_gain skips the rebalance on every rank at
// the same step, and nothing moves.
TEST(RuntimeThreads, MinBalancednessGainSkipsEverywhere) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    Scenario s = skewed(std::string("min-gain-") + std::string(mode_name(mode)), mode);
    s.config.min_balancedness_gain = 1;  // no placement gains a whole unit of balancedness
    // Until two skips (however long each takes to agree on under random delays); a completed
    // one would run the loop to max_steps and fail the count below.
    s.completed = 0;
    s.skipped = 2;
    s.delays = true;
    const auto results = testing::run_scenario(s);
    expect_consistent(s, results);
    EXPECT_GE(count(results[0], Outcome::kSkipped), 2);
    EXPECT_EQ(count(results[0], Outcome::kCompleted), 0);
    for (const auto& h : results[0].history) {
      if (h.outcome == Outcome::kCancelled) continue;  // the loop may end mid-rebalance
      EXPECT_NE(h.error.find("below min_balancedness_gain"), std::string::npos) << h.error;
    }
  }
}

// A rebalance only when it pays (Config::min_gain): the first one, with no pull bandwidth
// measured yet, is not priced and goes ahead; the ones after it are priced from its reads, and
// under a factor no gain reaches every priced one is skipped, on every rank at the same step
// with the same figures (expect_consistent compares them bit for bit), and counted.
TEST(RuntimeThreads, MinGainSkipsWhatDoesNotPay) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    Scenario s = skewed(std::string("min-gain-price-") + std::string(mode_name(mode)), mode);
    s.config.min_gain = 1e12;
    placement::CostModel model;
    model.slot_us = 10;
    model.token_us = 1;
    s.config.cost = model;
    // Until the first (unpriced) rebalance has completed and two priced ones were skipped,
    // however many steps the agreements take under random delays.
    s.completed = 1;
    s.skipped = 2;
    s.delays = true;
    const auto results = testing::run_scenario(s);
    expect_consistent(s, results);
    const std::vector<RebalanceRecord>& history = results[0].history;
    ASSERT_FALSE(history.empty());
    const RebalanceRecord& first = history.front();
    EXPECT_EQ(first.outcome, Outcome::kCompleted) << first.error;
    EXPECT_TRUE(first.gain_checked);
    EXPECT_FALSE(first.priced);
    EXPECT_GT(first.moe_us_before, 0);
    int64_t below = 0;
    for (size_t i = 1; i < history.size(); ++i) {
      const RebalanceRecord& h = history[i];
      if (h.outcome == Outcome::kCancelled || !h.gain_checked) continue;
      EXPECT_TRUE(h.priced) << "rebalance " << i;
      if (h.price_us > 0) {
        EXPECT_TRUE(h.below_min_gain) << "rebalance " << i;
        EXPECT_EQ(h.outcome, Outcome::kSkipped);
        EXPECT_NE(h.error.find("is below min_gain"), std::string::npos) << h.error;
        EXPECT_EQ(h.slots_moved, 0);
      }
      below += h.below_min_gain ? 1 : 0;
    }
    EXPECT_GE(below, 1);
    EXPECT_NE(results[0].metrics.find("eplb_rebalances_below_min_gain_total{rank=\"0\"} " +
                                      std::to_string(below)),
              std::string::npos)
        << results[0].metrics;
  }
}

// ---------------------------------------------------------------- external agreement

// The engine carries the agreement on its own collective: here a min-reduction shared by the
// rank threads, whose results each rank's delivery thread hands in late and out of the
// forward thread's rhythm (random delays), so that step_end sometimes waits for them.
TEST(RuntimeThreads, ExternalAgreementWithDelays) {
  Scenario s = skewed("external", Mode::kAsync);
  s.carrier = Carrier::kSharedMemory;
  s.delays = true;
  s.delay_max_us = 1000;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
  EXPECT_GT(moved_slots(results[0]), 0);
}

TEST(RuntimeThreads, ExternalAgreementFlameLagOneAndThree) {
  for (const int64_t lag : {1, 3}) {
    Scenario s = flame("external-flame-lag" + std::to_string(lag), Mode::kAsync);
    s.config.placement.policy = placement::Policy::kSticky;
    s.config.lag = lag;
    s.carrier = Carrier::kSharedMemory;
    s.delays = true;
    const auto results = testing::run_scenario(s);
    expect_consistent(s, results);
    EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
  }
}

// A worker failure travels through the engine's collective like through the control plane.
TEST(RuntimeThreads, ExternalAgreementWorkerFailureIsAbandonedEverywhere) {
  Scenario s = skewed("external-failure", Mode::kAsync);
  s.carrier = Carrier::kSharedMemory;
  s.fail_rank = 3;
  s.fail_at = 4;
  s.completed = 3;
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_EQ(count(results[0], Outcome::kFailed), 1);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

// The engine's collective stops delivering mid-run: every rank gives up on the missing result
// at the same step (after its timeout), abandons the rebalance with complete layers, triggers
// no more rebalances, and keeps serving with identical tables.
TEST(RuntimeThreads, ExternalAgreementMissingResultFailsEverywhere) {
  Scenario s = skewed("external-missing", Mode::kAsync);
  s.carrier = Carrier::kSharedMemory;
  s.config.timeout = std::chrono::milliseconds(1'500);
  s.completed = 0;  // however many rebalances completed before, on every rank alike
  s.drop_results_from = 40;
  s.steps_after_failure = 20;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  for (const auto& r : results) {
    ASSERT_FALSE(r.history.empty());
    EXPECT_EQ(r.history.back().outcome, Outcome::kFailed) << "rank " << r.rank;
    EXPECT_NE(r.history.back().error.find("agreement_result"), std::string::npos)
        << r.history.back().error;
  }
}

// ---------------------------------------------------------------- processes

TEST(RuntimeProcesses, ShmAsyncFlameWithDelays) {
  Scenario s = as_processes(flame("shm-async", Mode::kAsync), "shm");
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

TEST(RuntimeProcesses, CopyInstallOverShm) {
  Scenario s = as_processes(skewed("copy-install-shm", Mode::kAsync), "shm");
  s.config.install = Install::kCopy;
  s.installer = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

// Processes reading each other's engine-allocated memory: shm through cross-memory attach,
// hybrid through its shm half, UCX through its mapping of the memory.
TEST(RuntimeProcesses, EngineWeightsOverEveryTransport) {
  for (const std::string transport : {"shm", "hybrid", "ucx"}) {
    if (!transport::has_backend(transport)) continue;
    Scenario s = as_processes(flame("engine-" + transport, Mode::kAsync), transport);
    s.engine_weights = true;
    s.engine_pad = transport == "shm" ? 5 : 0;
    s.delays = transport == "shm";
    const auto results = testing::run_scenario(s);
    if (!results.empty() && !results[0].skipped.empty()) continue;
    expect_consistent(s, results);
    EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed) << transport;
    expect_engine_installs(s, results);
  }
}

TEST(RuntimeProcesses, ShmSyncSkewed) {
  Scenario s = as_processes(skewed("shm-sync", Mode::kSync), "shm");
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

TEST(RuntimeProcesses, UcxAsyncSkewed) {
  if (!transport::has_backend("ucx")) GTEST_SKIP() << "built without UCX";
  // No UCX context in this process before the fork: each rank creates its own.
  Scenario s = as_processes(skewed("ucx-async", Mode::kAsync), "ucx");
  s.completed = 3;
  const auto results = testing::run_scenario(s);
  if (!results[0].skipped.empty()) GTEST_SKIP() << "UCX cannot start here: " << results[0].skipped;
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

// Processes, with the agreement carried by the harness's own per-step all-reduce (standing for
// a collective the engine runs anyway), handed in from the forward thread before step_end.
TEST(RuntimeProcesses, ShmExternalAgreementOnTheEnginesCollective) {
  Scenario s = as_processes(flame("shm-external", Mode::kAsync), "shm");
  s.carrier = Carrier::kHarnessCollective;
  s.delays = true;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
}

// A rank SIGKILLs itself mid-rebalance. The survivors abandon it at the same step (identical
// logs), keep every installed layer, keep serving with identical tables, and trigger no more
// rebalances on the broken control plane.
TEST(RuntimeProcesses, RankKilledMidRebalance) {
  Scenario s = as_processes(flame("kill", Mode::kAsync), "shm");
  s.config.timeout = std::chrono::milliseconds(5'000);
  s.kill_rank = 3;
  s.kill_after = 1;
  s.completed = 1;
  s.compare_through_control = false;
  const auto results = testing::run_scenario(s);
  expect_consistent(s, results);
  for (const auto& r : results) {
    if (r.rank == s.kill_rank) continue;
    ASSERT_FALSE(r.history.empty());
    EXPECT_EQ(r.history.back().outcome, Outcome::kFailed) << "rank " << r.rank;
    EXPECT_GE(count(r, Outcome::kCompleted), 1);
  }
}

// ---------------------------------------------------------------- soak (not in the default run)

// Hundreds of rebalances with random delays, threads and processes, async and sync, internal
// and external agreement.
// Run: EPLB_RUNTIME_SOAK=1 eplb_runtime_tests --gtest_filter='RuntimeSoak.*'
TEST(RuntimeSoak, HundredsOfRebalancesWithDelays) {
  const char* env = std::getenv("EPLB_RUNTIME_SOAK");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set EPLB_RUNTIME_SOAK=1 to run";
  const int64_t rebalances = std::getenv("EPLB_RUNTIME_SOAK_REBALANCES")
                                 ? std::atoll(std::getenv("EPLB_RUNTIME_SOAK_REBALANCES"))
                                 : 150;
  const uint64_t base = testing::test_seed(1000);
  int64_t total = 0;
  // Rounds: threads async, threads sync, processes async, processes sync, and threads async
  // with the external agreement (shared-memory reduction, results handed in late).
  for (int round = 0; round < 5; ++round) {
    const Mode mode = round % 2 == 0 ? Mode::kAsync : Mode::kSync;
    Scenario s = round < 2 || round == 4 ? skewed("soak", mode)
                                         : as_processes(flame("soak-p", mode), "shm");
    if (round == 4) s.carrier = Carrier::kSharedMemory;
    s.seed = base + static_cast<uint64_t>(round);
    s.delays = true;
    s.delay_max_us = 200;
    s.completed = rebalances;
    s.max_steps = 100'000;
    const auto results = testing::run_scenario(s);
    expect_consistent(s, results);
    EXPECT_GE(count(results[0], Outcome::kCompleted), s.completed);
    total += count(results[0], Outcome::kCompleted);
  }
  std::printf("soak: %lld rebalances completed on every rank, invariants held at every step\n",
              static_cast<long long>(total));
}

}  // namespace
}  // namespace eplb::runtime
