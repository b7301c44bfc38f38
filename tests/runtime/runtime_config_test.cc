// Single-rank tests of the runtime: the files it writes and starts from (load windows,
// placement files) and the configuration it refuses, each with the rule it breaks (bad values,
// a device arena without an installer, ranks that differ in their plan options, the external
// agreement driven by hand). The multi-rank protocol is in runtime_test.cc.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/placement_file.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "eplb/runtime/initial_placement.h"
#include "runtime/harness.h"

namespace eplb::runtime {
namespace {

// ---------------------------------------------------------------- single rank, files

class RuntimeFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("eplb-runtime-files-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

Config one_rank_config() {
  Config c;
  c.layout = Layout{.experts = 4, .physical = 4, .ranks = 1, .nodes = 1, .groups = 1};
  c.interval = 1000;
  c.window = 3;
  return c;
}

TEST_F(RuntimeFiles, SaveStatsWritesTheWindowInEveryFormat) {
  control::Options options;
  options.rendezvous = "eplb-rt-files-" + std::to_string(::getpid());
  auto comm = control::connect("inproc", options);
  auto transport = transport::create("inproc", {});
  const Config config = one_rank_config();
  WeightSpec spec{.layers = 2, .tensors = {{"w", 8}}};
  Rebalancer rb(config, *comm, *transport, spec, trivial_placement(2, 4, 4));
  EXPECT_THROW(rb.save_stats(path("none.json")), InvalidArgument);  // before connect too
  rb.connect();
  for (int step = 0; step < 5; ++step) {
    const std::vector<int32_t> ids = {0, 1, 1, static_cast<int32_t>(step % 4)};
    rb.record(0, ids);
    rb.record_counts(1, std::vector<int64_t>{step, 0, 0, 1});
    rb.step_end();
  }
  rb.save_stats(path("load.json"));
  rb.save_stats(path("sglang.json"), stats::LoadFormat::kSglang);
  for (const std::string name : {"load.json", "sglang.json"}) {
    const stats::LoadHistory h = stats::read_load_history(path(name));
    EXPECT_EQ(h.format, name == "load.json" ? stats::LoadFormat::kEplb : stats::LoadFormat::kSglang);
    ASSERT_EQ(h.steps, 3);  // the window
    ASSERT_EQ(h.layers, 2);
    ASSERT_EQ(h.experts, 4);
    for (int s = 0; s < 3; ++s) {
      const int step = s + 2;
      EXPECT_EQ(h.step(s)[0], 1 + (step % 4 == 0));
      EXPECT_EQ(h.step(s)[1], 2 + (step % 4 == 1));
      EXPECT_EQ(h.step(s)[4], step);
      EXPECT_EQ(h.step(s)[7], 1);
    }
  }
  // vLLM's format and CSV too (CSV holds the window's sum); a trace cannot be written.
  rb.save_stats(path("vllm.json"), stats::LoadFormat::kVllm);
  EXPECT_EQ(stats::read_load_history(path("vllm.json")).steps, 3);
  rb.save_stats(path("x.csv"), stats::LoadFormat::kCsv);
  EXPECT_EQ(stats::read_load(path("x.csv")).values,
            stats::read_load(path("load.json")).values);
  EXPECT_THROW(rb.save_stats(path("x.trace"), stats::LoadFormat::kTrace), InvalidArgument);
  // The saved window seeds the next run: a placement from the load.
  Config two_ranks = config;
  two_ranks.layout = Layout{.experts = 4, .physical = 6, .ranks = 2, .nodes = 1, .groups = 1};
  const Placement p = placement_from_load(path("load.json"), two_ranks);
  EXPECT_EQ(p.layers, 2);
  EXPECT_NO_THROW(p.validate());
  rb.shutdown();
}

TEST_F(RuntimeFiles, StartsFromEplbAndSglangPlacementFiles) {
  const Layout layout{.experts = 4, .physical = 6, .ranks = 2, .nodes = 1, .groups = 1};
  Placement p(2, 4, 6);
  p.phy2log = {0, 1, 2, 3, 0, 1, 3, 2, 1, 0, 3, 3};
  p.derive_from_phy2log();
  stats::write_placement(path("p.json"), p, layout);
  EXPECT_EQ(placement_from_file(path("p.json"), layout).phy2log, p.phy2log);
  {
    std::ofstream out(path("sglang.json"));
    out << R"({"physical_to_logical_map": [[0,1,2,3,0,1],[3,2,1,0,3,3]]})";
  }
  EXPECT_EQ(placement_from_file(path("sglang.json"), layout).phy2log, p.phy2log);
  const Layout other{.experts = 4, .physical = 8, .ranks = 2, .nodes = 1, .groups = 1};
  EXPECT_THROW(placement_from_file(path("p.json"), other), InvalidArgument);
}

TEST(RuntimeConfig, RejectsBadValuesWithTheRule) {
  const auto message = [](const Config& c) {
    try {
      c.validate();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  Config c = one_rank_config();
  c.lag = 0;
  EXPECT_NE(message(c).find("lag 0"), std::string::npos);
  c = one_rank_config();
  c.interval = -1;
  EXPECT_NE(message(c).find("interval -1 is outside [0, "), std::string::npos);
  c = one_rank_config();
  c.interval = 0;  // no rebalance of the runtime's own: proposals and repairs only
  EXPECT_EQ(message(c), "");
  c = one_rank_config();
  c.peers_per_round = 0;
  EXPECT_NE(message(c).find("peers_per_round 0"), std::string::npos);
  // min_gain: a finite factor >= 0; min_balancedness_gain in [-1, 1]; the model valid.
  for (const double g : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    c = one_rank_config();
    c.min_gain = g;
    EXPECT_NE(message(c).find("min_gain is "), std::string::npos) << g << ": " << message(c);
  }
  c = one_rank_config();
  c.min_balancedness_gain = 2;
  EXPECT_NE(message(c).find("min_balancedness_gain 2 must be in [-1, 1]"), std::string::npos);
  c = one_rank_config();
  c.cost = placement::cost_model_preset("tokens");
  c.cost->slot_us = -1;
  EXPECT_NE(message(c).find("slot_us is -1"), std::string::npos) << message(c);
  EXPECT_EQ(parse_mode("sync"), Mode::kSync);
  EXPECT_THROW(parse_mode("fast"), InvalidArgument);
  EXPECT_THROW(parse_on_error("ignore"), InvalidArgument);

  control::Options options;
  options.rendezvous = "eplb-rt-config-" + std::to_string(::getpid());
  auto comm = control::connect("inproc", options);
  auto transport = transport::create("inproc", {});
  WeightSpec spec{.layers = 2, .tensors = {{"w", 8}}};
  // A placement of the wrong shape, and a layout of the wrong size, are refused up front.
  EXPECT_THROW(Rebalancer(one_rank_config(), *comm, *transport, spec, trivial_placement(3, 4, 4)),
               InvalidArgument);
  Config two = one_rank_config();
  two.layout.ranks = 2;
  EXPECT_THROW(Rebalancer(two, *comm, *transport, spec, trivial_placement(2, 4, 4)),
               InvalidArgument);
  WeightSpec empty{.layers = 2, .tensors = {}};
  EXPECT_THROW(Rebalancer(one_rank_config(), *comm, *transport, empty, trivial_placement(2, 4, 4)),
               InvalidArgument);
  // A model handed over while serving is checked too.
  Rebalancer rb(one_rank_config(), *comm, *transport, spec, trivial_placement(2, 4, 4));
  placement::CostModel bad;
  bad.token_us = -2;
  try {
    rb.set_cost_model(bad);
    ADD_FAILURE() << "set_cost_model took a negative token_us";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("token_us is -2"), std::string::npos) << e.what();
  }
}

// A transport whose arena is device memory (inproc underneath, claiming device_memory).
class DeviceLikeTransport final : public transport::Transport {
 public:
  DeviceLikeTransport() : inner_(transport::create("inproc", {})) {}
  std::string_view backend() const override { return "device-like"; }
  int rank() const override { return inner_->rank(); }
  transport::Capabilities capabilities() const override {
    auto c = inner_->capabilities();
    c.device_memory = true;
    return c;
  }
  transport::Region allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  transport::Region register_memory(void* data, std::size_t bytes) override {
    return inner_->register_memory(data, bytes);
  }
  std::vector<std::byte> export_descriptor() const override {
    return inner_->export_descriptor();
  }
  void import_descriptor(int peer, std::span<const std::byte> d) override {
    inner_->import_descriptor(peer, d);
  }
  bool one_sided_to(int peer) const override { return inner_->one_sided_to(peer); }
  std::unique_ptr<transport::Batch> post(std::span<const transport::Read> reads) override {
    return inner_->post(reads);
  }
  void close() override { inner_->close(); }

 private:
  std::unique_ptr<transport::Transport> inner_;
};

// Weights in device memory without an Installer would be overwritten under the engine's
// queued work (or memcpy'd as host memory): connect() refuses, naming what to set.
TEST(RuntimeConfig, DeviceArenaNeedsAnInstaller) {
  control::Options options;
  options.rendezvous = "eplb-rt-device-" + std::to_string(::getpid());
  auto comm = control::connect("inproc", options);
  DeviceLikeTransport transport;
  WeightSpec spec{.layers = 2, .tensors = {{"w", 8}}};
  Rebalancer rb(one_rank_config(), *comm, transport, spec, trivial_placement(2, 4, 4));
  try {
    rb.connect();
    ADD_FAILURE() << "connect() accepted a device arena without an installer";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Config::installer"), std::string::npos) << e.what();
  }
}

// Every value that decides the plan or the protocol is compared at connect(): a rank with
// another min_gain (or tolerance, or agreement) would skip a rebalance that its peers install.
TEST(RuntimeConfig, ConnectRefusesRanksThatDifferInPlanOptions) {
  const auto differ = [](const std::function<void(Config&)>& change) {
    static int runs = 0;
    const std::string rendezvous = "eplb-rt-fingerprint-" + std::to_string(::getpid()) + "-" +
                                   std::to_string(runs++);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        control::Options options;
        options.rank = r;
        options.size = 2;
        options.rendezvous = rendezvous;
        options.timeout = std::chrono::milliseconds(20'000);
        auto comm = control::connect("inproc", options);
        auto transport = transport::create("inproc", {.rank = r});
        Config config = one_rank_config();
        config.layout = Layout{.experts = 4, .physical = 6, .ranks = 2, .nodes = 1, .groups = 1};
        if (r == 1) change(config);
        Rebalancer rb(config, *comm, *transport, WeightSpec{.layers = 2, .tensors = {{"w", 8}}},
                      trivial_placement(2, 4, 6));
        try {
          rb.connect();
        } catch (const InvalidArgument& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    return errors;
  };
  for (const auto& change : std::vector<std::function<void(Config&)>>{
           [](Config& c) { c.min_gain = 0.01; }, [](Config& c) { c.min_balancedness_gain = 0.01; },
           [](Config& c) { c.placement.tolerance = 0.02; },
           [](Config& c) { c.placement.thorough = true; },
           [](Config& c) { c.agreement = Agreement::kExternal; }}) {
    for (const std::string& e : differ(change)) {
      EXPECT_NE(e.find("different configuration"), std::string::npos) << "[" << e << "]";
    }
  }
  for (const std::string& e : differ([](Config&) {})) EXPECT_EQ(e, "");
}

// What the runtime could only fail on later (a rank of more slots than experts must hold two
// replicas of one, a lag or timeout that sizes buffers or overflows a deadline) is refused at
// construction, with the rule.
TEST(RuntimeConfig, RefusesWhatCouldOnlyFailLater) {
  const auto message = [](const std::function<void(Config&)>& change) {
    Config c = one_rank_config();
    change(c);
    try {
      c.validate();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message([](Config& c) {
              c.layout = Layout{.experts = 8, .physical = 12, .ranks = 1, .nodes = 1, .groups = 1};
            }),
            "each rank holds 12 slots (E=8 P=12 G=1 N=1 groups=1) but only 8 experts exist, so a "
            "rank would hold two replicas of one expert (need physical / ranks <= 8 with the "
            "sticky policy)");
  EXPECT_EQ(message([](Config& c) {
              c.layout = Layout{.experts = 8, .physical = 12, .ranks = 1, .nodes = 1, .groups = 1};
              c.placement.policy = placement::Policy::kDeepseek;  // packs two replicas on a rank
            }),
            "accepted");
  EXPECT_NE(message([](Config& c) { c.lag = 2147483647; })
                .find("lag 2147483647 is outside [1, 1024]"),
            std::string::npos);
  EXPECT_NE(message([](Config& c) { c.timeout = std::chrono::milliseconds::max(); })
                .find("is outside [1, 86400000] ms"),
            std::string::npos);
  EXPECT_NE(message([](Config& c) {
              c.placement.policy = placement::Policy::kDeepseek;
              c.placement.thorough = true;
            }).find("thorough applies to the balanced and sticky policies, not deepseek"),
            std::string::npos);
  EXPECT_EQ(message([](Config& c) { c.placement.thorough = true; }), "accepted");
  EXPECT_EQ(message([](Config&) {}), "accepted");
  // A window is checked against the memory it needs when the recorder is made.
  EXPECT_THROW(stats::LoadRecorder(58, 256, int64_t{1} << 40), InvalidArgument);
  EXPECT_THROW(stats::LoadRecorder::bytes_for(kMaxLayers, kMaxExperts, int64_t{1} << 62),
               InvalidArgument);
}

// The external agreement on one rank, by hand: the contribution is kNoAgreement while no
// rebalance runs, the rebalance ends on the results handed in, a result that is not a minimum
// fails it, and misuse is refused with the rule.
TEST(RuntimeConfig, ExternalAgreementByHand) {
  Config bad = one_rank_config();
  bad.agreement = Agreement::kExternal;
  bad.mode = Mode::kSync;
  EXPECT_THROW(bad.validate(), InvalidArgument);
  EXPECT_EQ(parse_agreement("external"), Agreement::kExternal);
  EXPECT_THROW(parse_agreement("engine"), InvalidArgument);

  const auto run = [](bool honest) {
    control::Options options;
    options.rendezvous = "eplb-rt-external-" + std::to_string(::getpid()) + (honest ? "h" : "d");
    auto comm = control::connect("inproc", options);
    auto transport = transport::create("inproc", {});
    Config config = one_rank_config();
    config.layout = Layout{.experts = 4, .physical = 4, .ranks = 1, .nodes = 1, .groups = 1};
    config.placement.policy = placement::Policy::kBalanced;
    config.interval = 4;
    config.window = 4;
    config.lag = 1;
    config.min_balancedness_gain = -1;
    config.timeout = std::chrono::milliseconds(20'000);
    config.agreement = Agreement::kExternal;
    Rebalancer rb(config, *comm, *transport, WeightSpec{.layers = 2, .tensors = {{"w", 8}}},
                  trivial_placement(2, 4, 4));
    rb.connect();
    EXPECT_EQ(rb.agreement_contribution(), kNoAgreement);
    EXPECT_THROW(rb.agreement_result(1, 0), InvalidArgument);  // step 1 has not ended
    // Steps are short here: the worker (which may wait for a core) can take many of them to
    // place; the rebalance ends when it ends, whatever the number of steps.
    for (int step = 0; step < 200'000 && rb.history().empty(); ++step) {
      if (step > 8) std::this_thread::sleep_for(std::chrono::microseconds(50));
      rb.record_counts(0, std::vector<int64_t>{1, 2, 50, 900});
      rb.record_counts(1, std::vector<int64_t>{700, 3, 90, 1});
      rb.step_end();
      const int64_t mine = rb.agreement_contribution();
      EXPECT_EQ(mine == kNoAgreement, !rb.rebalancing()) << "step " << rb.step();
      // One rank: the minimum is its own value; a dishonest engine reduces with max + 1.
      rb.agreement_result(rb.step(), honest || mine == kNoAgreement ? mine : mine + 1);
    }
    const std::vector<RebalanceRecord> history = rb.history();
    EXPECT_EQ(rb.control_broken(), !honest);
    rb.shutdown();
    return history;
  };
  const std::vector<RebalanceRecord> honest = run(true);
  ASSERT_EQ(honest.size(), 1u);
  // One rank cannot move much (a rank holds no two replicas of an expert): the rebalance ends
  // on the results handed in, installed or skipped as the plan says (the multi-rank tests
  // install through the same path).
  EXPECT_TRUE(honest[0].outcome == Outcome::kCompleted || honest[0].outcome == Outcome::kSkipped)
      << outcome_name(honest[0].outcome) << ": " << honest[0].error;
  const std::vector<RebalanceRecord> dishonest = run(false);
  ASSERT_EQ(dishonest.size(), 1u);
  EXPECT_EQ(dishonest[0].outcome, Outcome::kFailed);
  EXPECT_NE(dishonest[0].error.find("must be the minimum"), std::string::npos)
      << dishonest[0].error;

  // An internal agreement takes no result.
  control::Options options;
  options.rendezvous = "eplb-rt-internal-" + std::to_string(::getpid());
  auto comm = control::connect("inproc", options);
  auto transport = transport::create("inproc", {});
  Rebalancer rb(one_rank_config(), *comm, *transport,
                WeightSpec{.layers = 2, .tensors = {{"w", 8}}}, trivial_placement(2, 4, 4));
  rb.connect();
  rb.step_end();
  EXPECT_THROW(rb.agreement_result(1, 0), InvalidArgument);
  rb.shutdown();
}

}  // namespace
}  // namespace eplb::runtime
