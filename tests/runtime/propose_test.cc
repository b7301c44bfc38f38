// A placement computed elsewhere (Rebalancer::propose) and maps whose width changes at a
// reconfigure (bind_maps again with the members' views):
//   - every rank proposes the same placement: planned, staged, agreed and installed as the
//     runtime's own, on threads and processes, async with random delays and sync (the harness
//     checks every slot's weights and every rank's tables at every step);
//   - a mismatch, or proposals made at different steps, fail that rebalance on every rank,
//     naming the first differing layer and slot (or the steps), and serving goes on with the
//     placement in force;
//   - bad proposals and a proposal while a rebalance installs are refused at the call, with
//     nothing queued;
//   - after a seat is lost, the members bind views of the members' width: written from then on
//     in the members' numbering, the old views never again, and a proposal at that width installs.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "runtime/harness.h"
#include "runtime/scenarios.h"

namespace eplb::runtime {
namespace {

using testing::Scenario;
using testing::weight_byte;

// A valid placement of `layers` x `physical` over `experts`, drawn from `seed` (every rank draws
// the same): every expert once, then random extra replicas, in a random order.
Placement random_placement(int64_t layers, int64_t experts, int64_t physical, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Placement p(layers, experts, physical);
  for (int64_t l = 0; l < layers; ++l) {
    std::vector<int32_t> row;
    for (int64_t e = 0; e < experts; ++e) row.push_back(static_cast<int32_t>(e));
    while (static_cast<int64_t>(row.size()) < physical) {
      row.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(experts)));
    }
    std::shuffle(row.begin(), row.end(), rng);
    std::copy(row.begin(), row.end(), p.phy2log.begin() + l * physical);
  }
  p.derive_from_phy2log();
  return p;
}

void expect_invalid(const std::function<void()>& call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one saying \"" << words << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

// The engine proposes a new placement every `every` steps while none is installing (the same
// decision on every rank: rebalancing() is the same everywhere); once a proposal's rebalance
// ended, the placement in force must be it. Returns the hook and logs what it proposed.
std::function<std::string(Rebalancer&, int, int64_t)> proposer(const Scenario& s, int64_t every) {
  struct State {
    std::mutex mu;
    std::vector<std::optional<Placement>> proposed;  // [rank] the last proposal
    std::vector<size_t> history;                     // [rank] history size when proposed
  };
  auto state = std::make_shared<State>();
  const int64_t ranks = s.config.layout.ranks;
  state->proposed.resize(static_cast<size_t>(ranks));
  state->history.resize(static_cast<size_t>(ranks));
  const Layout layout = s.config.layout;
  const int64_t layers = s.weights.layers;
  return [state, layout, layers, every](Rebalancer& rb, int rank, int64_t step) -> std::string {
    std::lock_guard<std::mutex> lock(state->mu);  // threads share the state, by rank
    std::optional<Placement>& last = state->proposed[static_cast<size_t>(rank)];
    const std::vector<RebalanceRecord> history = rb.history();
    std::string line;
    if (last && !rb.rebalancing() && history.size() > state->history[static_cast<size_t>(rank)]) {
      const RebalanceRecord& r = history.back();
      if (!r.proposed) return "error: not a proposal's rebalance";
      if (r.outcome == Outcome::kCompleted && rb.placement().phy2log != last->phy2log) {
        return "error: the proposal completed but another placement is in force";
      }
      line = detail::concat("proposal ended ", outcome_name(r.outcome));
      last.reset();
    }
    if (!last && !rb.rebalancing() && step % every == every - 1) {
      last = random_placement(layers, layout.experts, layout.physical, 1000 + step);
      state->history[static_cast<size_t>(rank)] = history.size();
      rb.propose(*last);
      line += detail::concat(" proposed at ", step);
    }
    return line;
  };
}

TEST(Propose, EveryRankInstallsTheEnginesPlacement) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    Scenario s = testing::skewed(detail::concat("propose-", mode_name(mode)), mode);
    s.config.interval = 0;  // no rebalance of the runtime's own
    s.delays = mode == Mode::kAsync;
    s.completed = 3;
    s.before_step_end = proposer(s, 12);
    const auto results = testing::run_scenario(s);
    testing::expect_consistent(s, results);
    const std::vector<RebalanceRecord>& history = results[0].history;
    EXPECT_GE(testing::count(results[0], Outcome::kCompleted), 3);
    for (const RebalanceRecord& r : history) {
      EXPECT_TRUE(r.proposed) << "rebalance " << r.index << " was not proposed";
      EXPECT_TRUE(r.outcome == Outcome::kCompleted) << r.error;
      EXPECT_GT(r.slots_moved, 0);
    }
  }
}

TEST(Propose, ProcessesWithTheEnginesWeights) {
  Scenario s = testing::as_processes(testing::skewed("propose-processes", Mode::kAsync), "shm");
  s.config.interval = 0;
  s.engine_weights = true;
  s.engine_maps = true;
  s.counters = Scenario::Counters::kPassSlots;
  s.completed = 2;
  s.before_step_end = proposer(s, 10);
  const auto results = testing::run_scenario(s);
  testing::expect_consistent(s, results);
  EXPECT_GE(testing::count(results[0], Outcome::kCompleted), 2);
}

// Rank 2 proposes another expert in layer 1 slot 5: every rank fails that rebalance at the same
// step, naming the slot, and keeps the placement in force; the same proposal later installs.
TEST(Propose, MismatchRefusedOnEveryRankNamingLayerAndSlot) {
  for (const Mode mode : {Mode::kAsync, Mode::kSync}) {
    Scenario s = testing::skewed(detail::concat("propose-mismatch-", mode_name(mode)), mode);
    s.config.interval = 0;
    s.config.on_error = OnError::kRaise;
    s.completed = 1;

    const Layout layout = s.config.layout;
    const int64_t layers = s.weights.layers;
    s.before_step_end = [layout, layers](Rebalancer& rb, int rank, int64_t step) {
      Placement p = random_placement(layers, layout.experts, layout.physical, 77);
      if (step == 5) {
        if (rank == 2) {  // another expert in layer 1 slot 5: swap it with one that differs
          auto row = p.layer_phy2log(1);
          const auto other = std::find_if(row.begin() + 6, row.end(),
                                          [&](int32_t e) { return e != row[5]; });
          std::swap(row[5], *other);
          p.derive_from_phy2log();
        }
        rb.propose(p);
        return std::string("proposed");
      }
      if (step == 40) {
        if (rb.placement().phy2log != trivial_placement(layers, layout.experts,
                                                        layout.physical).phy2log) {
          return std::string("error: the refused proposal changed the placement");
        }
        rb.propose(p);
        return std::string("proposed again");
      }
      return std::string();
    };
    const auto results = testing::run_scenario(s);
    testing::expect_consistent(s, results);
    for (const testing::RankResult& r : results) {
      ASSERT_GE(r.history.size(), 2u) << "rank " << r.rank;
      EXPECT_EQ(r.history[0].outcome, Outcome::kFailed);
      EXPECT_NE(r.history[0].error.find("layer 1 slot 5 holds expert"), std::string::npos)
          << "rank " << r.rank << ": " << r.history[0].error;
      EXPECT_EQ(r.history[0].layers_installed, 0);
      EXPECT_EQ(r.history[1].outcome, Outcome::kCompleted) << r.history[1].error;
      EXPECT_EQ(r.raised, 1) << "rank " << r.rank;  // on_error = raise, on every rank
    }
  }
}

// Ranks as threads with a loop of the test's own (the harness compares histories, whose
// trigger steps differ here by design). The loops run until what they wait for happened, a
// short pause per step giving the runtime's background threads the core on a busy machine;
// kMaxSteps only guards against a hang.
constexpr int64_t kMaxSteps = 200'000;
constexpr std::chrono::microseconds kPause{200};
struct ThreadRank {
  std::unique_ptr<control::Communicator> comm;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<Rebalancer> rb;
};

void fill_expert(int64_t layer, int64_t tensor, int32_t expert, std::span<std::byte> bytes) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = weight_byte(layer, tensor, expert, static_cast<int64_t>(i));
  }
}

// A rank's communicator and transport, and (`rebalancer`) its Rebalancer.
ThreadRank make_rank(const Config& config, const WeightSpec& spec, int rank, int size,
                     const std::string& rendezvous, bool rebalancer = true) {
  ThreadRank r;
  control::Options options;
  options.rank = rank;
  options.size = size;
  options.rendezvous = rendezvous;
  options.timeout = config.timeout;
  r.comm = control::connect("inproc", options);
  r.transport = transport::create("inproc", transport::Options{.rank = rank});
  if (rebalancer) {
    r.rb = std::make_unique<Rebalancer>(config, *r.comm, *r.transport, spec,
                                        trivial_placement(spec.layers, config.layout.experts,
                                                          config.layout.physical));
  }
  return r;
}

// Every slot of this rank holds its expert's weights.
std::string check_weights(const Rebalancer& rb, const WeightSpec& spec, const Layout& layout) {
  const int64_t spr = layout.slots_per_rank();
  for (int64_t l = 0; l < spec.layers; ++l) {
    for (int64_t t = 0; t < static_cast<int64_t>(spec.tensors.size()); ++t) {
      for (int64_t j = 0; j < spr; ++j) {
        const int32_t e = rb.phy2log(l)[rb.rank() * spr + j];
        const auto slot = rb.slot_weights(l, t, j);
        for (size_t i = 0; i < slot.size(); ++i) {
          if (slot[i] != weight_byte(l, t, e, static_cast<int64_t>(i))) {
            return detail::concat("seat ", rb.rank(), " layer ", l, " slot ", j,
                                  " does not hold expert ", e);
          }
        }
      }
    }
  }
  return "";
}

Config small_config(int64_t ranks, Mode mode) {
  Config c;
  c.layout = Layout{.experts = 8, .physical = 12, .ranks = ranks, .nodes = 1, .groups = 1};
  c.interval = 0;
  c.window = 4;
  c.lag = 2;
  c.mode = mode;
  c.timeout = std::chrono::milliseconds(10'000);
  c.stall_warn = std::chrono::milliseconds(0);
  c.balancedness_period = -1;
  return c;
}

WeightSpec small_spec() {
  WeightSpec spec;
  spec.layers = 2;
  spec.tensors = {{"w13", 24}, {"w2", 16}};
  return spec;
}

TEST(Propose, AtDifferentStepsRefusedOnEveryRank) {
  const Config config = small_config(3, Mode::kAsync);
  const WeightSpec spec = small_spec();
  const Placement p = random_placement(2, 8, 12, 5);
  std::vector<std::vector<RebalanceRecord>> histories(3);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        ThreadRank r = make_rank(config, spec, rank, 3, "propose-steps");
        r.rb->connect();
        fill_weights(*r.rb, fill_expert);
        // Until the proposal's rebalance has ended (the same step on every rank, however fast
        // the workers run; the bound only guards against a hang).
        for (int64_t step = 0; step < kMaxSteps; ++step) {
          if (step == (rank == 0 ? 4 : 5)) r.rb->propose(p);
          errors[rank] += check_weights(*r.rb, spec, config.layout);
          if (step > 5 && !r.rb->rebalancing() && !r.rb->history().empty()) break;
          r.rb->step_end();
          std::this_thread::sleep_for(kPause);
        }
        r.rb->shutdown();
        histories[rank] = r.rb->history();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    ASSERT_EQ(histories[rank].size(), 1u) << "rank " << rank;
    EXPECT_EQ(histories[rank][0].outcome, Outcome::kFailed);
    EXPECT_NE(histories[rank][0].error.find("proposed at different steps (4 to 5)"),
              std::string::npos)
        << histories[rank][0].error;
  }
}

TEST(Propose, BadProposalsAndProposalsWhileInstallingAreRefused) {
  Config config = small_config(1, Mode::kAsync);
  config.placement.policy = placement::Policy::kDeepseek;  // 12 slots on the one rank
  const WeightSpec spec = small_spec();
  ThreadRank r = make_rank(config, spec, 0, 1, "propose-bad");
  Rebalancer& rb = *r.rb;
  expect_invalid([&] { rb.propose(random_placement(2, 8, 12, 1)); }, "needs connect() first");
  rb.connect();
  fill_weights(rb, fill_expert);
  const Placement before = rb.placement();

  expect_invalid([&] { rb.propose(random_placement(3, 8, 12, 1)); }, "3 layers, the runtime 2");
  expect_invalid([&] { rb.propose(random_placement(2, 8, 11, 1)); },
                 "the placement is 2 layers x 11 slots; expected 2 x 12");
  expect_invalid([&] { rb.propose(random_placement(2, 7, 12, 1)); },
                 "the placement has 7 experts, the layout 8");
  Placement out_of_range = random_placement(2, 8, 12, 1);
  out_of_range.phy2log[12 + 3] = 8;
  expect_invalid([&] { rb.propose(out_of_range); },
                 "layer 1 slot 3 holds expert 8, outside [0, 8)");
  out_of_range.phy2log[12 + 3] = -1;
  expect_invalid([&] { rb.propose(out_of_range); }, "layer 1 slot 3 holds expert -1");
  Placement missing = trivial_placement(2, 8, 12);
  for (int64_t p = 0; p < 12; ++p) {
    if (missing.phy2log[p] == 6) missing.phy2log[p] = 0;
  }
  expect_invalid([&] { rb.propose(missing); }, "layer 0 has no slot for expert 6");

  // Nothing was queued: the next step_end starts nothing.
  rb.step_end();
  EXPECT_FALSE(rb.rebalancing());
  EXPECT_TRUE(rb.history().empty());

  // A second proposal before step_end replaces the first; while it installs, a third is
  // refused; the placement in force serves meanwhile.
  const Placement first = random_placement(2, 8, 12, 2), second = random_placement(2, 8, 12, 3);
  rb.propose(first);
  rb.propose(second);
  rb.step_end();
  ASSERT_TRUE(rb.rebalancing());
  expect_invalid([&] { rb.propose(first); }, "rebalance 0 (triggered at step 2) is still "
                                             "installing at step 2");
  for (int64_t i = 0; i < kMaxSteps && rb.rebalancing(); ++i) {
    EXPECT_EQ(check_weights(rb, spec, config.layout), "");
    rb.step_end();
    std::this_thread::sleep_for(kPause);
  }
  ASSERT_FALSE(rb.rebalancing());
  ASSERT_EQ(rb.history().size(), 1u);
  EXPECT_EQ(rb.history()[0].outcome, Outcome::kCompleted) << rb.history()[0].error;
  EXPECT_TRUE(rb.history()[0].proposed);
  EXPECT_EQ(rb.placement().phy2log, second.phy2log);
  EXPECT_EQ(check_weights(rb, spec, config.layout), "");
  // The placement in force, proposed again: nothing to move.
  rb.propose(second);
  rb.step_end();
  for (int64_t i = 0; i < kMaxSteps && rb.rebalancing(); ++i) {
    rb.step_end();
    std::this_thread::sleep_for(kPause);
  }
  ASSERT_EQ(rb.history().size(), 2u);
  EXPECT_EQ(rb.history()[1].outcome, Outcome::kSkipped);
  EXPECT_NE(rb.history()[1].error.find("equals the one in force"), std::string::npos);
  (void)before;
  rb.shutdown();
  expect_invalid([&] { rb.propose(first); }, "after shutdown()");
}

IntTensor view(std::vector<int64_t>& v, std::vector<int64_t> shape) {
  return IntTensor{.data = v.data(), .type = IntTensor::Type::kInt64, .shape = std::move(shape),
                   .strides = {}};
}

// Three seats; seat 1 leaves. Seats 0 and 2 reconfigure, bind views of the members' width
// (8 slots of 12: seat 0's, then seat 2's), and from then on those are written in the members'
// numbering at every install while the full-width views bound before stay as they were; a
// proposal at the members' width installs.
TEST(Rebind, MapsOfTheMembersWidthAfterAReconfigure) {
  Config config = small_config(3, Mode::kAsync);
  config.backup.copies = 2;
  const WeightSpec spec = small_spec();
  const int64_t L = spec.layers, E = 8, P = 12, spr = 4;
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int seat = 0; seat < 3; ++seat) {
    threads.emplace_back([&, seat] {
      const auto error = [&](auto&&... parts) {
        if (errors[seat].empty()) errors[seat] = detail::concat("seat ", seat, ": ", parts...);
      };
      try {
        ThreadRank r = make_rank(config, spec, seat, 3, "rebind");
        Rebalancer& rb = *r.rb;
        rb.connect();
        fill_weights(rb, fill_expert);
        rb.fill_backup(fill_expert);
        std::vector<int64_t> wide(L * P, -9), wide_log2phy(L * E * (P - E + 1), -9);
        rb.bind_maps({{MapKind::kPhysicalToLogical, view(wide, {L, P}), "physical_to_logical_map"},
                      {MapKind::kLogicalToPhysical, view(wide_log2phy, {L, E, P - E + 1}),
                       "logical_to_physical_map"}});
        for (int64_t step = 0; step < 3; ++step) rb.step_end();
        if (seat == 1) {  // leaves: its peers go on without it
          rb.shutdown();
          return;
        }
        ThreadRank next = make_rank(config, spec, seat == 0 ? 0 : 1, 2, "rebind-2", false);
        const Membership members{{0, 2}};
        rb.reconfigure(*next.comm, *next.transport, members);
        // The engine's re-sliced views: the members' 8 slots. A view of neither width is
        // refused, naming both; nothing is bound by it.
        std::vector<int64_t> bad(L * 7, -9);
        try {
          rb.bind_maps({{MapKind::kPhysicalToLogical, view(bad, {L, 7}),
                         "physical_to_logical_map"}});
          error("a view 7 slots wide was bound");
        } catch (const InvalidArgument& e) {
          if (std::string(e.what()).find("expected [2, 12] (layers, physical slots) or [2, 8] "
                                         "(the slots of the group's 2 members") ==
              std::string::npos) {
            error("unexpected message: ", e.what());
          }
        }
        const std::vector<int64_t> wide_then = wide, wide_log2phy_then = wide_log2phy;
        const int64_t R = P - E + 1;  // the layout's bound, at the members' width too
        std::vector<int64_t> narrow(L * 8, -9), narrow_log2phy(L * E * R, -9), count(L * E, -9);
        rb.bind_maps({{MapKind::kPhysicalToLogical, view(narrow, {L, 8}), "physical_to_logical_map"},
                      {MapKind::kLogicalToPhysical, view(narrow_log2phy, {L, E, R}),
                       "logical_to_physical_map"},
                      {MapKind::kReplicaCount, view(count, {L, E}), "logical_replica_count"}});
        // A proposal at the members' width: the engine's policy over its 8 slots.
        const Placement proposal = random_placement(L, E, 8, 9);
        bool proposed = false;
        for (int64_t step = 0; step < kMaxSteps; ++step) {
          // The narrow views are the placement and tables in force, in the members' numbering.
          const auto seat_slot = [&](int64_t i) { return (i / spr == 0 ? 0 : 2) * spr + i % spr; };
          for (int64_t l = 0; l < L; ++l) {
            const auto phy2log = rb.phy2log(l);
            for (int64_t i = 0; i < 8; ++i) {
              if (narrow[l * 8 + i] != phy2log[seat_slot(i)]) error("narrow phy2log at ", l, ",", i);
            }
            for (int64_t e = 0; e < E; ++e) {
              const auto replicas = rb.dispatch(l).replicas(e);
              if (count[l * E + e] != static_cast<int64_t>(replicas.size())) error("count");
              for (int64_t k = 0; k < R; ++k) {
                const int64_t want = k < static_cast<int64_t>(replicas.size())
                                         ? (replicas[k] / spr == 0 ? 0 : spr) + replicas[k] % spr
                                         : -1;
                if (narrow_log2phy[(l * E + e) * R + k] != want) error("narrow log2phy ", l, e, k);
              }
            }
          }
          if (wide != wide_then || wide_log2phy != wide_log2phy_then) {
            error("a view bound before the rebind was written at step ", rb.step());
          }
          if (!rb.rebalancing() && !rb.any_unavailable()) {
            const std::string weights = check_weights(rb, spec, config.layout);
            if (!weights.empty()) error(weights);
          }
          if (!proposed && !rb.rebalancing() && !rb.history().empty() &&
              rb.history().back().repair) {
            rb.propose(proposal);
            proposed = true;
          } else if (proposed && !rb.rebalancing() && rb.history().back().proposed) {
            break;
          }
          rb.step_end();
          std::this_thread::sleep_for(kPause);
        }
        const std::vector<RebalanceRecord> history = rb.history();
        if (history.empty() || !history.back().proposed ||
            history.back().outcome != Outcome::kCompleted) {
          error("the proposal at the members' width did not complete");
        }
        for (int64_t l = 0; l < L; ++l) {
          for (int64_t i = 0; i < 8; ++i) {
            if (narrow[l * 8 + i] != proposal.phy2log[l * 8 + i]) error("not the proposal");
          }
        }
        rb.shutdown();
      } catch (const std::exception& e) {
        error(e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace eplb::runtime
