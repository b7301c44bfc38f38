// The runtime's metrics, watchdog and balancedness log: what the exposition says against what
// the history says, on rank threads; the watchdog's warning with a peer made to stall; the
// families moved between processes and merged. Timings never decide a result: the stall is
// many times stall_warn.

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "runtime/harness.h"
#include "runtime/cpu_wait.h"
#include "runtime/monitor.h"

namespace eplb::runtime {
namespace {

using testing::RankResult;
using testing::Scenario;

// One sample line of the text exposition: name, labels (as written), value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Sample> parse_exposition(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    EXPECT_NE(space, std::string::npos) << line;
    if (brace != std::string::npos && brace < space) {
      s.name = line.substr(0, brace);
      const size_t close = line.find('}', brace);
      std::string body = line.substr(brace + 1, close - brace - 1);
      size_t pos = 0;
      while (pos < body.size()) {
        const size_t eq = body.find('=', pos);
        const size_t end = body.find('"', eq + 2);
        s.labels[body.substr(pos, eq - pos)] = body.substr(eq + 2, end - eq - 2);
        pos = end + 2;  // past '",'
      }
    } else {
      s.name = line.substr(0, space);
    }
    s.value = std::stod(line.substr(space + 1));
    out.push_back(std::move(s));
  }
  return out;
}

// The sum of the samples named `name` whose labels include `where`.
double sum_of(const std::vector<Sample>& samples, const std::string& name,
              const std::map<std::string, std::string>& where = {}) {
  double total = 0;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : where) match = match && s.labels.count(k) && s.labels.at(k) == v;
    if (match) total += s.value;
  }
  return total;
}

bool has(const std::vector<Sample>& samples, const std::string& name,
         const std::map<std::string, std::string>& where = {}) {
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : where) match = match && s.labels.count(k) && s.labels.at(k) == v;
    if (match) return true;
  }
  return false;
}

Scenario four_ranks(const std::string& name) {
  Scenario s;
  s.name = name;
  s.config.layout = Layout{.experts = 8, .physical = 12, .ranks = 4, .nodes = 2, .groups = 1};
  s.config.interval = 4;
  s.config.window = 4;
  s.config.placement.policy = placement::Policy::kBalanced;
  s.config.timeout = std::chrono::milliseconds(20'000);
  s.weights.layers = 4;
  s.weights.tensors = {{"w13", 40}, {"w2", 24}};
  s.completed = 4;
  s.seed = testing::test_seed(5);
  return s;
}

TEST(RuntimeMetrics, TheExpositionSaysWhatTheHistorySays) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    Scenario s = four_ranks(std::string("metrics ") + std::string(mode_name(mode)));
    s.config.mode = mode;
    s.config.balancedness_period = 2;
    s.config.metric_labels = {{"model", "test-moe"}};
    const std::vector<RankResult> results = testing::run_scenario(s);
    int64_t slots = 0, remote = 0, local = 0, completed = 0;
    for (const RebalanceRecord& h : results[0].history) {
      if (h.outcome != Outcome::kCompleted) continue;
      ++completed;
      slots += h.slots_moved;
      remote += h.bytes_intra_node + h.bytes_inter_node;
      local += h.bytes_local_copy;
    }
    ASSERT_GE(completed, 1);
    double rank_slots = 0, rank_remote = 0, rank_local = 0, recorded = -1;
    for (const RankResult& r : results) {
      SCOPED_TRACE(::testing::Message() << s.name << " rank " << r.rank);
      for (const std::string& e : r.errors) ADD_FAILURE() << e;
      const std::vector<Sample> m = parse_exposition(r.metrics);
      const std::map<std::string, std::string> mine = {{"rank", std::to_string(r.rank)},
                                                       {"model", "test-moe"}};
      EXPECT_EQ(sum_of(m, "eplb_rebalances_total", {{"outcome", "completed"}}), completed);
      EXPECT_TRUE(has(m, "eplb_rebalances_total", {{"outcome", "failed"}}));
      // The harness's last step ends its loop before that step's step_end.
      EXPECT_EQ(sum_of(m, "eplb_steps_total", mine), static_cast<double>(r.steps - 1));
      EXPECT_GT(sum_of(m, "eplb_forward_stall_seconds_count"), 0);
      EXPECT_EQ(sum_of(m, "eplb_rebalance_duration_steps_count"),
                static_cast<double>(r.history.size()));
      EXPECT_EQ(sum_of(m, "eplb_rebalance_in_flight"), 0);  // after shutdown
      EXPECT_EQ(sum_of(m, "eplb_rebalance_phase", {{"phase", "idle"}}), 1);
      EXPECT_GT(sum_of(m, "eplb_bytes_held"), 0);
      for (const char* source : {"recorded", "predicted_before", "predicted_after"}) {
        ASSERT_TRUE(has(m, "eplb_balancedness", {{"source", source}})) << source;
        const double b = sum_of(m, "eplb_balancedness", {{"source", source}});
        EXPECT_GT(b, 0) << source;
        EXPECT_LE(b, 1) << source;
      }
      // The recorded window's figure is the all-reduced window's: the same on every rank. The
      // last measurement was at the last trigger (none while a rebalance is in flight), on
      // the same window and under the same placement, the one in force before it.
      const double here = sum_of(m, "eplb_balancedness", {{"source", "recorded"}});
      EXPECT_DOUBLE_EQ(here, r.history.back().balancedness_before);
      if (recorded >= 0) {
        EXPECT_EQ(here, recorded);
      }
      recorded = here;
      rank_slots += sum_of(m, "eplb_slots_moved_total");
      rank_remote += sum_of(m, "eplb_bytes_moved_total", {{"path", "intra_node"}}) +
                     sum_of(m, "eplb_bytes_moved_total", {{"path", "inter_node"}});
      rank_local += sum_of(m, "eplb_bytes_moved_total", {{"path", "local_copy"}});
    }
    // Each rank counts what it received; together, what every record says moved.
    EXPECT_EQ(rank_slots, static_cast<double>(slots));
    EXPECT_EQ(rank_remote, static_cast<double>(remote));
    EXPECT_EQ(rank_local, static_cast<double>(local));
  }
}

// Rebalancers sharing a registry need labels that tell them apart; the same labels twice are
// refused with the reason, and a Rebalancer's metrics leave the registry with it.
TEST(RuntimeMetrics, ARegistrySharedByTwoRebalancers) {
  auto registry = std::make_shared<prometheus::Registry>();
  const auto make = [&](const std::string& rendezvous) {
    control::Options options;
    options.rendezvous = rendezvous;
    return control::connect("inproc", options);
  };
  Config c;
  c.layout = Layout{.experts = 4, .physical = 4, .ranks = 1, .nodes = 1, .groups = 1};
  c.registry = registry;
  const WeightSpec spec{.layers = 1, .tensors = {{"w", 8}}};
  auto comm_a = make("eplb-metrics-shared-a-" + std::to_string(::getpid()));
  auto comm_b = make("eplb-metrics-shared-b-" + std::to_string(::getpid()));
  auto transport_a = transport::create("inproc", {});
  auto transport_b = transport::create("inproc", {});
  Config a = c, b = c;
  a.metric_labels = {{"model", "a"}};
  b.metric_labels = {{"model", "b"}};
  {
    Rebalancer ra(a, *comm_a, *transport_a, spec, trivial_placement(1, 4, 4));
    Rebalancer rb(b, *comm_b, *transport_b, spec, trivial_placement(1, 4, 4));
    const std::vector<Sample> m = parse_exposition(metrics_text(registry->Collect()));
    EXPECT_TRUE(has(m, "eplb_steps_total", {{"model", "a"}, {"rank", "0"}}));
    EXPECT_TRUE(has(m, "eplb_steps_total", {{"model", "b"}, {"rank", "0"}}));
    try {
      Rebalancer again(a, *comm_a, *transport_a, spec, trivial_placement(1, 4, 4));
      ADD_FAILURE() << "the same labels twice in one registry were accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("model=a, rank=0"), std::string::npos) << e.what();
    }
  }
  // Both gone: their places are free again.
  EXPECT_FALSE(has(parse_exposition(metrics_text(registry->Collect())), "eplb_steps_total"));
  Rebalancer after(a, *comm_a, *transport_a, spec, trivial_placement(1, 4, 4));
  EXPECT_TRUE(has(parse_exposition(after.metrics_text()), "eplb_steps_total", {{"model", "a"}}));
}

TEST(RuntimeMetrics, TheEnginesRegistryHoldsEveryRank) {
  Scenario s = four_ranks("engine registry");
  s.config.registry = std::make_shared<prometheus::Registry>();
  s.completed = 1;
  const std::vector<RankResult> results = testing::run_scenario(s);
  for (const RankResult& r : results) {
    for (const std::string& e : r.errors) ADD_FAILURE() << e;
    // Read from the shared registry while this rank still ran: its own series there, in
    // the one family every rank's metrics join (a HELP line per name).
    const std::vector<Sample> m = parse_exposition(r.metrics);
    EXPECT_TRUE(has(m, "eplb_steps_total", {{"rank", std::to_string(r.rank)}})) << r.rank;
    size_t helps = 0, pos = 0;
    while ((pos = r.metrics.find("# HELP eplb_steps_total ", pos)) != std::string::npos) {
      ++helps;
      ++pos;
    }
    EXPECT_EQ(helps, 1u);
  }
  // The Rebalancers are gone, and their metrics with them.
  EXPECT_FALSE(has(parse_exposition(metrics_text(s.config.registry->Collect())),
                   "eplb_steps_total"));
}

// A peer made to stall in its placement: the watchdog warns on that rank (phase placement) and
// on the others (waiting for the plan), and the metric counts it.
TEST(RuntimeMetrics, TheWatchdogWarnsOfAStalledRebalance) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256);
  spdlog::default_logger()->sinks().push_back(sink);
  Scenario s = four_ranks("watchdog");
  s.config.stall_warn = std::chrono::milliseconds(40);
  s.slow_placement_rank = 2;
  s.slow_placement_ms = 600;  // 15 x stall_warn
  s.completed = 1;
  const std::vector<RankResult> results = testing::run_scenario(s);
  spdlog::default_logger()->sinks().pop_back();
  for (const RankResult& r : results) {
    for (const std::string& e : r.errors) ADD_FAILURE() << e;
    const std::vector<Sample> m = parse_exposition(r.metrics);
    EXPECT_GE(sum_of(m, "eplb_watchdog_warnings_total"), 1) << "rank " << r.rank;
    EXPECT_EQ(sum_of(m, "eplb_rebalance_stalled"), 0) << "rank " << r.rank;  // it ended
  }
  bool slow = false, waiting = false;
  int64_t warnings = 0;
  for (const std::string& line : sink->last_formatted()) {
    if (line.find("has made no progress") == std::string::npos) continue;
    ++warnings;
    slow = slow || (line.find("rank 2:") != std::string::npos &&
                    line.find("phase placement") != std::string::npos);
    // Its peers have the plan and may have staged a layer: either way they wait for rank 2.
    waiting = waiting || (line.find("rank 0:") != std::string::npos &&
                          line.find("phase agreeing") != std::string::npos &&
                          line.find("waiting for every rank") != std::string::npos);
  }
  EXPECT_TRUE(slow) << "no warning of rank 2 in its placement";
  EXPECT_TRUE(waiting) << "no warning of rank 0 waiting for every rank";
  // Again at most every stall_warn: 600 ms allow ~15 per rank, never one per tick.
  EXPECT_LE(warnings, 4 * 20);
}

TEST(RuntimeMetrics, TheWatchdogNamesThePeersOfARead) {
  PhaseTracker progress;
  progress.start(3, 40);
  progress.note(2, Phase::kReading, 9);  // an older rebalance's worker: ignored
  EXPECT_EQ(progress.snapshot().phase, Phase::kWindow);
  progress.note(3, Phase::kReading, 7, {1, 5});
  const std::string text = describe_stall(progress.snapshot(), 0, 12.5);
  EXPECT_NE(text.find("rebalance 3 (triggered at step 40)"), std::string::npos) << text;
  EXPECT_NE(text.find("12.5 s in phase reading: reading layer 7 from ranks 1, 5"),
            std::string::npos)
      << text;
  progress.finish();
  EXPECT_FALSE(progress.snapshot().active);
  progress.note(3, Phase::kPlacement);  // after the end: nothing in flight to note
  EXPECT_EQ(progress.snapshot().phase, Phase::kIdle);
}

TEST(RuntimeMetrics, FamiliesTravelAsJsonAndMerge) {
  // A Rebalancer's own families (histograms with +Inf buckets among them), through JSON and
  // back, as eplb run moves them from its rank processes.
  {
    control::Options options;
    options.rendezvous = "eplb-metrics-json-" + std::to_string(::getpid());
    auto comm = control::connect("inproc", options);
    auto transport = transport::create("inproc", {});
    Config c;
    c.layout = Layout{.experts = 4, .physical = 4, .ranks = 1, .nodes = 1, .groups = 1};
    const WeightSpec spec{.layers = 1, .tensors = {{"w", 8}}};
    Rebalancer rb(c, *comm, *transport, spec, trivial_placement(1, 4, 4));
    const std::vector<prometheus::MetricFamily> f = rb.collect_metrics();
    EXPECT_EQ(metrics_text(families_from_json(families_to_json(f))), metrics_text(f));
  }
  std::vector<std::vector<prometheus::MetricFamily>> sets;
  // Two registries of two ranks' shapes, through JSON and back.
  for (int rank = 0; rank < 2; ++rank) {
    prometheus::Registry registry;
    auto& c = prometheus::BuildCounter().Name("x_total").Help("x").Labels(
        {{"rank", std::to_string(rank)}}).Register(registry);
    c.Add({{"outcome", "completed"}}).Increment(rank + 1);
    auto& h = prometheus::BuildHistogram().Name("y_seconds").Help("y").Register(registry);
    h.Add({{"rank", std::to_string(rank)}}, prometheus::Histogram::BucketBoundaries{0.1, 1})
        .Observe(0.5);
    const std::vector<prometheus::MetricFamily> f = registry.Collect();
    const std::vector<prometheus::MetricFamily> back = families_from_json(families_to_json(f));
    EXPECT_EQ(metrics_text(back), metrics_text(f));
    sets.push_back(back);
  }
  const std::string merged = metrics_text(merge_families(sets));
  const std::vector<Sample> m = parse_exposition(merged);
  EXPECT_EQ(sum_of(m, "x_total"), 3);
  EXPECT_EQ(sum_of(m, "y_seconds_count"), 2);
  EXPECT_EQ(merged.find("# TYPE x_total"), merged.rfind("# TYPE x_total"));
  EXPECT_THROW(families_from_json("[{\"name\": 1}]"), InvalidArgument);
  sets[1][0].type = prometheus::MetricType::Gauge;
  EXPECT_THROW(merge_families(sets), InvalidArgument);
}

TEST(RuntimeMetrics, ConfigRefusesBadMetricSettings) {
  Config c;
  c.layout = Layout{.experts = 8, .physical = 8, .ranks = 2, .nodes = 1, .groups = 1};
  c.validate();
  Config bad = c;
  bad.stall_warn = std::chrono::milliseconds(-1);
  EXPECT_THROW(bad.validate(), InvalidArgument);
  bad = c;
  bad.balancedness_period = -2;
  EXPECT_THROW(bad.validate(), InvalidArgument);
  for (const char* label : {"rank", "", "1x", "__x", "a-b", "outcome", "le", "source"}) {
    bad = c;
    bad.metric_labels = {{label, "v"}};
    EXPECT_THROW(bad.validate(), InvalidArgument) << label;
  }
  bad = c;
  bad.metric_labels = {{"model", "anything goes here"}};
  bad.validate();
}

// The wait the stall leaves out: monotonic, never more than the wall time, and seen when two
// busy threads share one core (each must wait while the other runs; how long does not matter).
TEST(RunQueueWait, GrowsWhenAThreadSharesItsCore) {
  const int64_t first = run_queue_wait_ns();
  if (first < 0) GTEST_SKIP() << "this kernel reports no per-thread run queue wait";
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> measured{-1}, wall_ns{0};
  const auto spin_on = [&](bool measure) {
    if (pthread_setaffinity_np(pthread_self(), sizeof(one), &one) != 0) return;
    const int64_t before = run_queue_wait_ns();
    const auto start = std::chrono::steady_clock::now();
    volatile uint64_t x = 0;
    // Long enough for several time slices of the other thread, however fast the machine.
    while (!stop.load(std::memory_order_relaxed)) x = x + 1;
    if (measure) {
      measured = run_queue_wait_ns() - before;
      wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - start).count();
    }
  };
  std::thread a(spin_on, true), b(spin_on, false);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop = true;
  a.join();
  b.join();
  if (measured.load() < 0) GTEST_SKIP() << "threads cannot be pinned to one core here";
  EXPECT_GT(measured.load(), 0);
  EXPECT_LE(measured.load(), wall_ns.load());
  EXPECT_GE(run_queue_wait_ns(), first);  // this thread's own count never goes back
}

}  // namespace
}  // namespace eplb::runtime
