// Elastic serving (docs/elastic.md): rank processes killed at random points of the protocol
// (the placement, a read, an install, a collective, a step), the survivors forming a new group
// through a membership board and reconfigure(), shrinking over the live seats and restoring the
// lost experts from the backup copies or the loader; a new process taking the seat back.
//
// Every step, on every member: every slot a dispatch table names holds the expert it is named
// for (weights encode layer, tensor, expert and byte), no table names a slot of a seat that is
// not a member, and every member's tables are the same (a hash compared through a communicator
// of the test's own). After the run: no expert is unavailable, every survivor completed a
// repair, and a seat taken back receives tokens again. A process that hangs is killed by the
// launcher's timeout, and the trial fails.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "eplb/control/communicator.h"
#include "eplb/control/elastic.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "runtime/harness.h"
#include "runtime/testing.h"

namespace eplb::runtime {
namespace {

using testing::weight_byte;

// Where the killed process ends itself.
enum class KillAt { kStep, kPlacement, kRead, kInstall, kControl };
constexpr KillAt kKillPoints[] = {KillAt::kStep, KillAt::kPlacement, KillAt::kRead,
                                  KillAt::kInstall, KillAt::kControl};
const char* kill_name(KillAt k) {
  switch (k) {
    case KillAt::kStep: return "step";
    case KillAt::kPlacement: return "placement";
    case KillAt::kRead: return "read";
    case KillAt::kInstall: return "install";
    case KillAt::kControl: return "collective";
  }
  return "?";
}

struct Trial {
  uint64_t seed = 1;
  int ranks = 4;
  int kill_seat = 1;
  KillAt point = KillAt::kStep;
  int64_t kill_step = 16;
  bool rejoin = false;
  int64_t rejoin_step = -1;
  int64_t steps = 96;
  Mode mode = Mode::kAsync;
  placement::Policy policy = placement::Policy::kSticky;
  int64_t copies = 2;
  bool loader = true;
  bool engine_weights = false;
  bool delays = false;

  std::string describe() const {
    std::ostringstream s;
    s << "seed " << seed << ": kill seat " << kill_seat << " at its first " << kill_name(point)
      << " from step " << kill_step << (rejoin ? ", rejoin at step " : "")
      << (rejoin ? std::to_string(rejoin_step) : "") << ", " << mode_name(mode) << ", "
      << placement::policy_name(policy) << ", " << copies << " backup copies"
      << (loader ? " + loader" : "") << (engine_weights ? ", engine weights" : "")
      << (delays ? ", delays" : "");
    return s.str();
  }
};

constexpr int64_t kLayers = 3;
constexpr int64_t kExperts = 16;
constexpr int64_t kTensorBytes = 40;

Trial random_trial(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Trial t;
  t.seed = seed;
  t.kill_seat = static_cast<int>(rng() % 4);
  t.point = kKillPoints[rng() % 5];
  t.kill_step = 8 * static_cast<int64_t>(1 + rng() % 3);  // at a trigger: a rebalance starts
  t.rejoin = rng() % 2 == 0;
  t.rejoin_step = t.kill_step + 24 + static_cast<int64_t>(rng() % 8);
  t.steps = t.rejoin ? t.rejoin_step + 40 : t.kill_step + 48;
  t.mode = rng() % 4 == 0 ? Mode::kSync : Mode::kAsync;
  t.policy = rng() % 2 == 0 ? placement::Policy::kSticky : placement::Policy::kBalanced;
  // Always recoverable: two copies, or one copy and the loader, or the loader alone.
  switch (rng() % 3) {
    case 0: t.copies = 2, t.loader = rng() % 2 == 0; break;
    case 1: t.copies = 1, t.loader = true; break;
    default: t.copies = 0, t.loader = true; break;
  }
  t.engine_weights = rng() % 3 == 0;
  t.delays = rng() % 2 == 0;
  return t;
}

void fill_expert(int64_t layer, int64_t tensor, int32_t expert, std::span<std::byte> bytes) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = weight_byte(layer, tensor, expert, static_cast<int64_t>(i));
  }
}

Config trial_config(const Trial& t) {
  Config c;
  c.layout = Layout{.experts = kExperts, .physical = kExperts + 8, .ranks = t.ranks, .nodes = 1,
                    .groups = 1};
  c.interval = 8;
  c.window = 8;
  c.lag = 2;
  c.mode = t.mode;
  c.placement.policy = t.policy;
  c.timeout = std::chrono::milliseconds(5'000);
  c.balancedness_period = -1;
  c.stall_warn = std::chrono::milliseconds(0);
  c.backup.copies = t.copies;
  if (t.loader) c.backup.loader = fill_expert;
  return c;
}

// One member's view of the group it serves with.
struct Group {
  std::unique_ptr<control::Communicator> communicator, check;
  std::unique_ptr<transport::Transport> transport;
  std::vector<int32_t> seats;
  int64_t epoch = 0;
};

Group connect_group(const std::string& rendezvous, const control::MembershipBoard::View& view,
                    int seat) {
  Group g;
  control::Options o;
  o.rank = view.rank_of(seat);
  o.size = static_cast<int>(view.seats.size());
  o.rendezvous = rendezvous + "-e" + std::to_string(view.epoch);
  o.timeout = std::chrono::milliseconds(10'000);
  g.communicator = control::connect("shm", o);
  o.group = "check";
  g.check = control::connect("shm", o);
  g.transport = transport::create("shm", transport::Options{.rank = o.rank});
  g.seats = view.seats;
  g.epoch = view.epoch;
  return g;
}

uint64_t tables_hash(const Rebalancer& rb) {
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&](const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  for (int64_t l = 0; l < kLayers; ++l) {
    const routing::DispatchTables& t = rb.dispatch(l);
    mix(t.log2phy.data(), t.log2phy.size() * sizeof(int32_t));
    mix(t.replica_count.data(), t.replica_count.size() * sizeof(int32_t));
    const auto row = rb.phy2log(l);
    mix(row.data(), row.size() * sizeof(int32_t));
  }
  return h;
}

// The slots the tables name: on a member, holding the expert they are named for.
void check_slots(Rebalancer& rb, const std::vector<int32_t>& seats,
                 std::vector<std::string>& errors, int64_t step) {
  const Layout& layout = rb.config().layout;
  const int64_t spr = layout.slots_per_rank();
  for (int64_t l = 0; l < kLayers; ++l) {
    const routing::DispatchTables& t = rb.dispatch(l);
    for (int64_t e = 0; e < kExperts; ++e) {
      for (const int32_t slot : t.replicas(e)) {
        const int32_t seat = static_cast<int32_t>(slot / spr);
        if (std::find(seats.begin(), seats.end(), seat) == seats.end()) {
          errors.push_back("step " + std::to_string(step) + " layer " + std::to_string(l) +
                           ": expert " + std::to_string(e) + " routed to slot " +
                           std::to_string(slot) + " of seat " + std::to_string(seat) +
                           ", which is not a member");
          continue;
        }
        if (seat != rb.rank()) continue;
        if (rb.phy2log(l)[slot] != e) {
          errors.push_back("step " + std::to_string(step) + ": tables and phy2log disagree");
          continue;
        }
        const auto bytes = rb.slot_weights(l, 0, slot % spr);
        for (size_t i = 0; i < bytes.size(); ++i) {
          if (bytes[i] != weight_byte(l, 0, e, static_cast<int64_t>(i))) {
            errors.push_back("step " + std::to_string(step) + " layer " + std::to_string(l) +
                             " slot " + std::to_string(slot) + " does not hold expert " +
                             std::to_string(e) + "'s weights");
            break;
          }
        }
      }
    }
  }
}

// The engine's map tensors (vLLM's layout), bound to the Rebalancer: after every reconfigure and
// install they must say what the tables say, lost slots left out.
struct BoundMaps {
  int64_t E = kExperts, P = 0, R = 0;
  std::vector<int64_t> phy2log, log2phy, count;

  void bind(Rebalancer& rb) {
    P = rb.config().layout.physical;
    R = P - E + 1;
    phy2log.assign(static_cast<size_t>(kLayers * P), -7);
    log2phy.assign(static_cast<size_t>(kLayers * E * R), -7);
    count.assign(static_cast<size_t>(kLayers * E), -7);
    const auto view = [](std::vector<int64_t>& v, std::vector<int64_t> shape) {
      return IntTensor{.data = v.data(), .type = IntTensor::Type::kInt64, .shape = shape,
                       .strides = {}};
    };
    rb.bind_maps({{MapKind::kPhysicalToLogical, view(phy2log, {kLayers, P}), "phy2log"},
                  {MapKind::kLogicalToPhysical, view(log2phy, {kLayers, E, R}), "log2phy"},
                  {MapKind::kReplicaCount, view(count, {kLayers, E}), "logcnt"}});
  }

  void check(const Rebalancer& rb, std::vector<std::string>& errors, int64_t step) const {
    for (int64_t l = 0; l < kLayers; ++l) {
      const routing::DispatchTables& t = rb.dispatch(l);
      const auto row = rb.phy2log(l);
      bool same = std::equal(row.begin(), row.end(), phy2log.begin() + l * P);
      for (int64_t e = 0; same && e < E; ++e) {
        const auto replicas = t.replicas(e);
        same = count[l * E + e] == t.replica_count[e];
        for (int64_t i = 0; same && i < R; ++i) {
          same = log2phy[(l * E + e) * R + i] ==
                 (i < static_cast<int64_t>(replicas.size()) ? replicas[i] : -1);
        }
      }
      if (!same) {
        errors.push_back("step " + std::to_string(step) + " layer " + std::to_string(l) +
                         ": the engine's bound maps differ from the tables");
        return;
      }
    }
  }
};

// Skewed loads whose hot experts move every 16 steps.
void record_loads(Rebalancer& rb, int64_t step) {
  std::vector<int64_t> counts(kExperts);
  for (int64_t l = 0; l < kLayers; ++l) {
    for (int64_t e = 0; e < kExperts; ++e) {
      const uint64_t h = mix64(static_cast<uint64_t>((l * 131 + e) * 7919 + step / 16));
      counts[e] = 1 + (h % 5 == 0 ? 40 : static_cast<int64_t>(h % 4));
    }
    rb.record_counts(l, counts);
  }
}

int rank_body(const Trial& t, control::MembershipBoard& board, const std::string& rendezvous,
              const std::string& dir, int seat, bool joining) {
  std::vector<std::string> errors;
  Config config = trial_config(t);
  std::atomic<bool> armed{false};
  const bool victim = !joining && seat == t.kill_seat;
  const std::function<void(DelayPoint)> hook = [&armed, victim, point = t.point, delays = t.delays,
                       seed = t.seed](DelayPoint p) {
    const bool match = (point == KillAt::kPlacement && p == DelayPoint::kPlacement) ||
                       (point == KillAt::kRead && p == DelayPoint::kRead) ||
                       (point == KillAt::kInstall && p == DelayPoint::kInstall) ||
                       (point == KillAt::kControl && p == DelayPoint::kControl);
    if (victim && match && armed.load()) ::kill(::getpid(), SIGKILL);
    if (delays) {
      thread_local std::mt19937_64 rng(seed ^ std::hash<std::thread::id>()(
                                                  std::this_thread::get_id()));
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
    }
  };
  WeightSpec spec{.layers = kLayers, .tensors = {{"w", kTensorBytes}}};
  std::vector<std::vector<std::byte>> own;
  if (t.engine_weights) {
    const int64_t spr = config.layout.slots_per_rank();
    for (int64_t l = 0; l < kLayers; ++l) {
      own.emplace_back(static_cast<size_t>(spr * (kTensorBytes + 8)));
      spec.engine.push_back({.base = own.back().data(), .stride = kTensorBytes + 8});
    }
  }
  Group group;
  std::unique_ptr<Rebalancer> rb;
  if (joining) {
    rb = std::make_unique<Rebalancer>(config, spec, seat);
    RebalancerTesting::set_delay_hook(*rb, hook);
    board.set_ready(seat, true);
    control::MembershipBoard::View view = board.view();
    while (!view.has(seat)) view = board.wait_newer(view.epoch, std::chrono::seconds(60));
    group = connect_group(rendezvous, view, seat);
    rb->reconfigure(*group.communicator, *group.transport, Membership{view.seats});
  } else {
    group = connect_group(rendezvous, board.view(), seat);
    rb = std::make_unique<Rebalancer>(config, *group.communicator, *group.transport, spec,
                                      trivial_placement(kLayers, kExperts,
                                                        config.layout.physical));
    RebalancerTesting::set_delay_hook(*rb, hook);
    rb->connect();
    fill_weights(*rb, fill_expert);
  }
  rb->fill_backup(fill_expert);
  BoundMaps maps;
  maps.bind(*rb);
  const auto regroup = [&](const control::MembershipBoard::View& view) {
    Group next = connect_group(rendezvous, view, seat);
    rb->reconfigure(*next.communicator, *next.transport, Membership{view.seats});
    group = std::move(next);
  };
  // Serving goes on past t.steps until every member has completed the repair of the last
  // reconfigure (the members decide it together, so they stop at the same step): how long a
  // repair takes is the machine's business, never the test's.
  int64_t step = rb->step();
  int64_t regroups = 0;
  int64_t repaired_after = -1;  // the step of the last reconfigure
  const auto repaired = [&] {
    for (const RebalanceRecord& r : rb->history()) {
      if (r.repair && r.outcome == Outcome::kCompleted && r.trigger_step > repaired_after) {
        return true;
      }
    }
    return false;
  };
  const int64_t limit = t.steps + 20'000;
  for (;;) {
    if (victim) {
      if (step >= t.kill_step) armed.store(true);
      // A point this rank never reached (no read to make, say) ends it at a step instead.
      if ((t.point == KillAt::kStep && step == t.kill_step) || step >= t.kill_step + 24) {
        ::kill(::getpid(), SIGKILL);
      }
    }
    if (t.rejoin && step == t.rejoin_step &&
        std::find(group.seats.begin(), group.seats.end(), t.kill_seat) == group.seats.end()) {
      board.wait_ready(t.kill_seat, std::chrono::seconds(60));
      board.add(t.kill_seat, group.epoch);
      control::MembershipBoard::View view = board.view();
      if (view.epoch <= group.epoch) view = board.wait_newer(group.epoch, std::chrono::seconds(60));
      regroup(view);
      repaired_after = step;
      ++regroups;
    }
    check_slots(*rb, group.seats, errors, step);
    maps.check(*rb, errors, step);
    const auto h = static_cast<int64_t>(tables_hash(*rb) >> 1);
    const bool rejoined =
        !t.rejoin ||
        std::find(group.seats.begin(), group.seats.end(), t.kill_seat) != group.seats.end();
    const bool done = step >= t.steps && rejoined && !rb->any_unavailable() && repaired();
    std::vector<int64_t> v = {h, -h, step, -step, done ? 0 : 1};
    try {
      group.check->all_reduce(v, control::ReduceOp::kMax);
    } catch (const Error&) {
      // A member is gone: the step is served again by the group the board names next.
      regroup(board.wait_newer(group.epoch, std::chrono::seconds(60)));
      repaired_after = step;
      ++regroups;
      continue;
    }
    if (v[0] != h || v[1] != -h) {
      errors.push_back("step " + std::to_string(step) + ": the members' tables differ");
    }
    if (v[2] != step || v[3] != -step) {
      errors.push_back("step " + std::to_string(step) + ": the members are at different steps");
    }
    record_loads(*rb, step);  // once the step is served: a step served again counts once
    if (v[4] == 0) break;  // every member done
    if (step >= limit) {
      errors.push_back("the repair did not complete within " + std::to_string(limit) + " steps");
      break;
    }
    rb->step_end();
    ++step;
    if (step % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // The end: everything served, every survivor repaired, a seat taken back receives tokens.
  for (int64_t l = 0; l < kLayers; ++l) {
    if (!rb->unavailable(l).empty()) {
      errors.push_back("layer " + std::to_string(l) + " still has unavailable experts");
    }
  }
  if (!repaired()) errors.push_back("no repair rebalance completed after the last reconfigure");
  if (t.rejoin) {
    const int64_t spr = rb->config().layout.slots_per_rank();
    bool routed = false;
    for (int64_t l = 0; l < kLayers; ++l) {
      for (const int32_t slot : rb->dispatch(l).log2phy) routed = routed || slot / spr == t.kill_seat;
    }
    if (!routed) errors.push_back("the seat taken back receives no tokens");
  }
  if (!joining && regroups == 0) errors.push_back("never reconfigured");
  rb->shutdown();
  std::ofstream out(dir + "/seat" + std::to_string(seat) + (joining ? "-joined" : "") + ".txt");
  for (const std::string& e : errors) out << e << "\n";
  if (!errors.empty()) {  // what happened, for the failure message
    for (const RebalanceRecord& r : rb->history()) {
      out << "  rebalance " << r.index << (r.repair ? " (repair)" : "") << " steps "
          << r.trigger_step << "-" << r.end_step << ": " << outcome_name(r.outcome) << " "
          << r.error << "\n";
    }
  }
  out << "done\n";
  return errors.empty() ? 0 : 1;
}

void run_trial(const Trial& t) {
  SCOPED_TRACE(t.describe());
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("eplb-elastic-" + std::to_string(::getpid()) + "-" +
                           std::to_string(t.seed));
  std::filesystem::create_directories(dir);
  const std::string rendezvous =
      "eplb-elastic-test-" + std::to_string(::getpid()) + "-" + std::to_string(t.seed);
  control::MembershipBoard board(t.ranks);
  bool respawned = false;
  control::ForkOptions options;
  options.timeout = std::chrono::seconds(180);
  options.grace = std::chrono::seconds(20);
  const std::vector<control::RankExit> exits = control::fork_elastic(
      t.ranks,
      [&](int seat, bool joining) { return rank_body(t, board, rendezvous, dir, seat, joining); },
      board,
      [&](int seat) {
        if (!t.rejoin || seat != t.kill_seat || respawned) return false;
        respawned = true;
        return true;
      },
      options);
  int kills = 0;
  for (size_t i = 0; i < exits.size(); ++i) {
    const control::RankExit& e = exits[i];
    const bool joined = i >= static_cast<size_t>(t.ranks);
    if (!joined && e.rank == t.kill_seat && e.signal == SIGKILL && !e.killed_by_launcher) {
      ++kills;
      continue;
    }
    std::ifstream in(dir + "/seat" + std::to_string(e.rank) + (joined ? "-joined" : "") + ".txt");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(e.ok()) << e.describe() << "\n" << text;
    EXPECT_NE(text.find("done"), std::string::npos) << "seat " << e.rank << " left no result";
  }
  EXPECT_EQ(kills, 1);
  EXPECT_EQ(exits.size(), static_cast<size_t>(t.ranks + (t.rejoin ? 1 : 0)));
  std::filesystem::remove_all(dir);
}

int64_t trials_from_env(int64_t fallback) {
  const char* v = std::getenv("EPLB_ELASTIC_TRIALS");
  return v != nullptr ? std::max<int64_t>(std::atoll(v), 1) : fallback;
}

// Each kill point once, shrink only, then with a rejoin: the short version of the trials.
TEST(RuntimeElastic, EveryKillPointShrinksAndGrowsBack) {
  uint64_t seed = testing::test_seed(100);
  for (const KillAt point : kKillPoints) {
    for (const bool rejoin : {false, true}) {
      Trial t = random_trial(seed++);
      t.point = point;
      t.rejoin = rejoin;
      t.steps = rejoin ? t.rejoin_step + 40 : t.kill_step + 48;
      run_trial(t);
    }
  }
}

// Random trials (EPLB_ELASTIC_TRIALS, default 40: with the test above, 50 kills a run).
TEST(RuntimeElastic, RandomKillTrials) {
  const uint64_t first = testing::test_seed(1000);
  const int64_t trials = trials_from_env(40);
  for (int64_t i = 0; i < trials; ++i) run_trial(random_trial(first + static_cast<uint64_t>(i)));
}

TEST(RuntimeElastic, MembershipIsChecked) {
  const Layout layout{.experts = 4, .physical = 8, .ranks = 4, .nodes = 1, .groups = 1};
  EXPECT_NO_THROW(Membership::all(4).validate(layout));
  EXPECT_THROW((Membership{{0, 0}}.validate(layout)), InvalidArgument);
  EXPECT_THROW((Membership{{0, 4}}.validate(layout)), InvalidArgument);
  EXPECT_THROW((Membership{{}}.validate(layout)), InvalidArgument);
  Config c;
  c.layout = layout;
  EXPECT_THROW(Rebalancer(c, WeightSpec{.layers = 1, .tensors = {{"w", 8}}}, 4), InvalidArgument);
  c.backup.copies = 5;
  EXPECT_THROW(c.validate(), InvalidArgument);
}

}  // namespace
}  // namespace eplb::runtime
