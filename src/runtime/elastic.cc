#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/routing/dispatch.h"
#include "eplb/transport/transport.h"
#include "runtime/config.h"
#include "runtime/impl.h"

// Rebalancer::Impl's elastic serving (docs/elastic.md): reconfigure() onto a new group, the
// slots that lost their weights, and the backup copies that restore them.
//
// Ownership. reconfigure() runs on the forward thread. Before it touches anything the worker
// and the control thread share, it cancels the rebalance in flight, waits for the worker to be
// idle and stops the control thread (which runs what was queued, failing fast on a broken
// communicator), so that comm_ and the weight store's regions, peers and backup tables are
// written while no other runtime thread reads them. The monitor thread reads none of them;
// a window of the old group that fails late is told apart by its group number (group_state.h).

namespace eplb::runtime {

Membership Membership::all(int64_t ranks) {
  Membership m;
  for (int64_t g = 0; g < ranks; ++g) m.seats.push_back(static_cast<int32_t>(g));
  return m;
}

void Membership::validate(const Layout& layout) const {
  if (seats.empty()) fail("membership: no seats (a group needs at least one member)");
  if (static_cast<int64_t>(seats.size()) > layout.ranks) {
    fail("membership: ", seats.size(), " seats but the layout has ", layout.ranks, " ranks");
  }
  std::vector<uint8_t> seen(static_cast<size_t>(layout.ranks), 0);
  for (size_t g = 0; g < seats.size(); ++g) {
    const int32_t s = seats[g];
    if (s < 0 || s >= layout.ranks) {
      fail("membership: member ", g, " has seat ", s, ", outside [0, ", layout.ranks,
           ") (the layout's ranks)");
    }
    if (seen[s]) fail("membership: seat ", s, " is listed twice (each seat has one member)");
    seen[s] = 1;
  }
}

// ---------------------------------------------------------------- reconfigure
void Rebalancer::Impl::reconfigure(control::Communicator& communicator,
                                   transport::Transport& transport,
                                   const Membership& membership) {
  EPLB_CHECK(!shut_down_, "reconfigure() after shutdown()");
  EPLB_CHECK(lifecycle_ != Lifecycle::kBuilt,
             "reconfigure() needs connect() first (a rank that joins is built with the "
             "joining constructor)");
  const Layout& layout = config_.layout;
  membership.validate(layout);
  EPLB_CHECK_EQ(static_cast<int64_t>(communicator.size()),
                static_cast<int64_t>(membership.seats.size()),
                "the new communicator's size must equal the membership's seats");
  EPLB_CHECK_EQ(transport.rank(), communicator.rank(),
                "the transport and the communicator must be of the same rank");
  const int32_t seat = membership.seats[static_cast<size_t>(communicator.rank())];
  if (seat != seat_) {
    fail("reconfigure: this rank holds seat ", seat_, " but the membership puts it (rank ",
         communicator.rank(), " of the new group) in seat ", seat,
         ": a member keeps its seat, list it at its own position");
  }
  if (transport.capabilities().device_memory && !config_.installer) {
    fail("the ", transport.backend(), " transport keeps the weights in device memory: set "
         "Config::installer");
  }
  if (&communicator == comm_ ||
      (lifecycle_ != Lifecycle::kJoining && &transport == &weights_.transport())) {
    fail("reconfigure: pass a communicator and a transport built for the new group (these are "
         "the ones in use)");
  }
  const bool joining = lifecycle_ == Lifecycle::kJoining;

  // Step 1: nothing runs any more on the old group. A rebalance in flight is abandoned here on
  // every member alike (installed layers stay: what each slot holds is exchanged below).
  if (protocol_.active()) {
    AsyncProtocol::cancel_worker(*protocol_.active());
    if (records_.open) {
      records_.open->outcome = Outcome::kFailed;
      records_.open->error = "reconfigure() while the rebalance ran";
      close_open(std::nullopt);
      publish_open();
    }
    protocol_.finish(false);
  }
  protocol_.drop_agreements();
  // A proposal not started yet was made for the old group: the engine proposes again.
  if (proposals_.take()) {
    spdlog::warn("eplb runtime rank {}: reconfigure() at step {} drops the placement proposed "
                 "for the old group; propose again for the new one", seat_, step_);
  }
  if (!joining) worker_.wait_idle();  // the cancelled job let go
  // Until the new group is in place no rebalance may start: a reconfigure that throws below
  // leaves the Rebalancer serving its tables, waiting for another reconfigure().
  protocol_.set_control_broken(true);
  if (control_) {
    control_->stop();
    control_.reset();
  }
  group_.next_group();

  // Step 2: eplb's regions in the new transport, then the exchange. Until it succeeds the old
  // regions stay the live ones (weights() still serves them): a reconfigure that throws leaves
  // this rank as it was, on the communicator and transport the caller must keep until one
  // succeeds.
  if (!joining && transport.capabilities().device_memory != weights_.device_memory()) {
    fail("reconfigure: the new ", transport.backend(), " transport keeps its memory ",
         transport.capabilities().device_memory ? "on the device" : "on the host",
         " but the ", weights_.transport().backend(), " transport in use does not: the "
         "weights cannot change sides");
  }
  control::Communicator* const old_comm = comm_;
  const WeightStore::Regions old = weights_.regions();
  comm_ = &communicator;
  try {
    weights_.allocate(transport);
    exchange_membership(membership, joining);
  } catch (...) {
    comm_ = old_comm;
    weights_.restore(old);
    throw;
  }

  // Step 3: the arena's layers move in layer order (so that every member's buffer map is the
  // identity again), after the engine's queued work that may still write them; then the
  // backup copy.
  if (!joining) weights_.move_from(old);

  // Step 4: the threads on the new group.
  protocol_.set_control_broken(false);
  start_control_thread();
  if (joining) {
    start_worker_thread();
    lifecycle_ = Lifecycle::kConnected;
  }
  metrics_->set_bytes_held(weights_.publish_bytes_held());
  const int64_t unavailable_total = unavailable_count();
  metrics_->on_reconfigure(static_cast<int64_t>(group_.members().size()));
  metrics_->set_unavailable(unavailable_total);
  spdlog::info("eplb runtime rank {}: reconfigured at step {} ({}): {} of {} seats serve, {} "
               "slots lost, {} experts unavailable (all layers){}",
               seat_, step_, joining ? "joined" : "group changed",
               group_.members().size(), layout.ranks, group_.lost_slots(), unavailable_total,
               group_.repair_pending() ? "; a repair rebalance starts at the next step" : "");
}

// The exchange of reconfigure(): descriptors and every member's slots; adopts the group's
// state.
void Rebalancer::Impl::exchange_membership(const Membership& membership, bool joining) {
  const Layout& layout = config_.layout;
  const int64_t spr = layout.slots_per_rank();
  const int64_t P = layout.physical;
  const size_t own = static_cast<size_t>(spec_.layers * spr);
  struct Head {
    uint64_t fingerprint;
    int32_t seat, joining, backup_filled, region, backup_region, repair;
    int64_t step, next_index;
  };
  transport::Transport& transport = weights_.transport();
  const WeightStore::Regions& regions = weights_.regions();
  const std::vector<std::byte> descriptor = transport.export_descriptor();
  std::vector<std::byte> mine(sizeof(Head) + own * sizeof(int32_t) + own + descriptor.size());
  Head head{};
  head.fingerprint = config_fingerprint(config_, spec_);
  head.seat = seat_;
  head.joining = joining ? 1 : 0;
  head.backup_filled = weights_.backup_filled() ? 1 : 0;
  head.region = regions.arena.id;
  head.backup_region = regions.backup.bytes > 0 ? regions.backup.id : -1;
  head.repair = group_.repair_pending() ? 1 : 0;
  head.step = step_;
  head.next_index = records_.next_index();
  std::memcpy(mine.data(), &head, sizeof head);
  auto* slots = reinterpret_cast<int32_t*>(mine.data() + sizeof head);
  auto* valid = reinterpret_cast<uint8_t*>(mine.data() + sizeof head + own * sizeof(int32_t));
  for (int64_t l = 0; l < spec_.layers; ++l) {
    for (int64_t j = 0; j < spr; ++j) {
      const int64_t p = l * P + seat_ * spr + j;
      slots[l * spr + j] = phy2log_[p];
      valid[l * spr + j] = joining ? 0 : group_.usable()[static_cast<size_t>(p)];
    }
  }
  std::memcpy(mine.data() + sizeof head + own * (sizeof(int32_t) + 1), descriptor.data(),
              descriptor.size());
  const std::vector<control::Bytes> all = comm_->all_gather(mine, config_.timeout);

  // Check and read every member's part.
  std::vector<Head> heads(all.size());
  int64_t step = -1;
  int64_t next_index = records_.next_index();
  for (size_t g = 0; g < all.size(); ++g) {
    EPLB_CHECK_GE(all[g].size(), sizeof(Head) + own * (sizeof(int32_t) + 1),
                  "reconfigure: short message from rank ", g);
    std::memcpy(&heads[g], all[g].data(), sizeof(Head));
    const Head& h = heads[g];
    if (h.fingerprint != head.fingerprint) {
      fail("reconfigure: member ", g, " (seat ", h.seat, ") has a different configuration or "
           "weight spec than seat ", seat_, " (layout, interval, window, policy, lag, mode, "
           "backup and tensor sizes must be the same on every rank)");
    }
    if (h.seat != membership.seats[g]) {
      fail("reconfigure: member ", g, " says it holds seat ", h.seat, " but this rank's "
           "membership puts seat ", membership.seats[g], " there: every member must pass the "
           "same membership");
    }
    if (!h.joining) {
      if (step >= 0 && h.step != step) {
        fail("reconfigure: the members were called at different steps (", step, " and ", h.step,
             " at seat ", h.seat, "): call it on every member after the same step_end()");
      }
      step = h.step;
    }
    next_index = std::max(next_index, h.next_index);
  }
  if (step < 0) {
    fail("reconfigure: every member is joining, so no member holds any weights: a group needs "
         "at least one rank that served before");
  }
  // Descriptors, then one small read from every member proves the connections now.
  weights_.clear_peers();
  std::vector<int32_t> members;
  const bool engine = spec_.engine_weights();
  for (size_t g = 0; g < all.size(); ++g) {
    const Head& h = heads[g];
    if (engine && h.region != regions.arena.id) {
      fail("reconfigure: seat ", h.seat, " registered its regions in another order than seat ",
           seat_, " (staging region ", h.region, " against ", regions.arena.id,
           "): give the Rebalancer a transport of its own");
    }
    weights_.set_peer(h.seat, static_cast<int>(g), h.region,
                      h.backup_filled ? h.backup_region : -1);
    members.push_back(h.seat);
    if (static_cast<int>(g) != comm_->rank()) {
      const size_t at = sizeof(Head) + own * (sizeof(int32_t) + 1);
      transport.import_descriptor(static_cast<int>(g),
                                  std::span<const std::byte>(all[g]).subspan(at));
    }
  }
  std::sort(members.begin(), members.end());
  weights_.probe_peers(config_.timeout);

  // What every slot holds: a member's own report (the truth, whatever each member believed of
  // the others); the slots of lost seats and of joining members hold nothing usable and are
  // given the experts that are nowhere else first, so that the placement stays valid.
  std::vector<int32_t> phy2log(static_cast<size_t>(spec_.layers * P), -1);
  std::vector<uint8_t> usable(static_cast<size_t>(spec_.layers * P), 0);
  for (size_t g = 0; g < all.size(); ++g) {
    if (heads[g].joining) continue;
    const auto* s = reinterpret_cast<const int32_t*>(all[g].data() + sizeof(Head));
    const auto* v = reinterpret_cast<const uint8_t*>(all[g].data() + sizeof(Head) +
                                                     own * sizeof(int32_t));
    const int64_t seat = heads[g].seat;
    for (int64_t l = 0; l < spec_.layers; ++l) {
      for (int64_t j = 0; j < spr; ++j) {
        const int32_t e = s[l * spr + j];
        if (e < 0 || e >= layout.experts) {
          fail("reconfigure: seat ", seat, " reports expert ", e, " in layer ", l, " slot ", j);
        }
        phy2log[l * P + seat * spr + j] = e;
        usable[l * P + seat * spr + j] = v[l * spr + j] != 0;
      }
    }
  }
  std::vector<uint8_t> present(static_cast<size_t>(layout.experts));
  for (int64_t l = 0; l < spec_.layers; ++l) {
    std::fill(present.begin(), present.end(), 0);
    for (int64_t p = 0; p < P; ++p) {
      if (phy2log[l * P + p] >= 0) present[phy2log[l * P + p]] = 1;
    }
    int32_t next_missing = 0;
    for (int64_t p = 0; p < P; ++p) {
      int32_t& e = phy2log[l * P + p];
      if (e >= 0) continue;
      while (next_missing < layout.experts && present[next_missing]) ++next_missing;
      if (next_missing < layout.experts) {
        e = next_missing;
        present[next_missing] = 1;
      } else {
        e = static_cast<int32_t>(p % layout.experts);
      }
    }
    if (next_missing < layout.experts &&
        std::find(present.begin(), present.end(), 0) != present.end()) {
      fail("reconfigure: layer ", l, " has experts in no slot at all (the members' reports "
           "are inconsistent)");
    }
  }
  // A repair when a member slot holds nothing, or the group is not what it was: the placement
  // then follows the members (a smaller group is rebalanced over the survivors at once).
  // The same on every member: from exchanged values only (a member whose last repair failed
  // alone still asks for one, so every member starts it).
  bool all_usable = true;
  for (int64_t p = 0; p < spec_.layers * P; ++p) {
    all_usable = all_usable && (usable[p] || !weights_.member(static_cast<int>((p % P) / spr)));
  }
  const bool any_joining =
      std::any_of(heads.begin(), heads.end(), [](const Head& h) { return h.joining != 0; });
  const bool any_repair =
      std::any_of(heads.begin(), heads.end(), [](const Head& h) { return h.repair != 0; });
  const bool repair = any_repair || !all_usable || any_joining ||
                      static_cast<int64_t>(members.size()) < layout.ranks;
  group_.adopt(std::move(members), std::move(usable), repair);
  phy2log_ = std::move(phy2log);
  step_ = step;
  records_.set_next_index(next_index);
  protocol_.publish_step(step_);
  const Placement now = placement();
  // Maps numbered as the old members' slots say nothing true of the new group's (an engine
  // that re-slices its maps binds the new views next).
  if (const std::vector<std::string> names = maps_.unbind_other_members(compact_slots());
      !names.empty()) {
    std::string list;
    for (const std::string& name : names) list += (list.empty() ? "" : ", ") + name;
    spdlog::info("eplb runtime rank {}: the maps bound at the old group's width ({}) are no "
                 "longer written; bind_maps() again with views of the new group's width",
                 seat_, list);
  }
  for (int64_t l = 0; l < spec_.layers; ++l) {
    tables_[l] = build_tables(now, l);
    write_maps(l);
  }
}

// ---------------------------------------------------------------- lost slots
std::vector<int32_t> Rebalancer::Impl::unavailable(int64_t layer) const {
  EPLB_CHECK(layer >= 0 && layer < spec_.layers, "unavailable: layer ", layer, " is outside [0, ",
             spec_.layers, ")");
  return routing::unavailable_experts(tables_[layer]);
}

int64_t Rebalancer::Impl::unavailable_count() const {
  int64_t n = 0;
  for (const routing::DispatchTables& t : tables_) {
    n += std::count(t.replica_count.begin(), t.replica_count.end(), 0);
  }
  return n;
}

bool Rebalancer::Impl::any_unavailable() const {
  for (const routing::DispatchTables& t : tables_) {
    if (std::find(t.replica_count.begin(), t.replica_count.end(), 0) != t.replica_count.end()) {
      return true;
    }
  }
  return false;
}

}  // namespace eplb::runtime
