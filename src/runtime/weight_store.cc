// The weight store (weight_store.h).

#include "runtime/weight_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "runtime/failure.h"

namespace eplb::runtime {
namespace {

// The arena of `spec` on `layout`, once its sizes are known to fit.
ArenaLayout checked_arena(const WeightSpec& spec, const Layout& layout) {
  const int64_t layer_bytes = checked_mul(spec.expert_bytes(), layout.slots_per_rank(),
                                          "the bytes of one layer on a rank");
  checked_mul(layer_bytes, spec.layers + 1, "the bytes of a rank's weights and staging");
  return ArenaLayout(spec, layout.slots_per_rank());
}

}  // namespace

WeightStore::WeightStore(const Config& config, const WeightSpec& spec, int seat,
                         transport::Transport* transport)
    : config_(config),
      spec_(spec),
      seat_(seat),
      arena_(checked_arena(spec, config.layout)),
      backup_(config.layout, spec, config.backup.copies),
      map_(spec.engine_weights() ? 0 : spec.layers) {  // engine: the staging layer, buffer 0
  if (spec_.engine_weights()) check_engine_slots_apart();
  regions_.transport = transport;
  regions_.peer_of_seat.resize(static_cast<size_t>(config_.layout.ranks));
  for (int g = 0; g < config_.layout.ranks; ++g) regions_.peer_of_seat[g] = g;
}

void WeightStore::check_engine_slots_apart() const {
  const int64_t spr = config_.layout.slots_per_rank();
  struct Slot {
    uintptr_t begin, end;
    int64_t layer, tensor;
  };
  std::vector<Slot> slots;
  for (int64_t l = 0; l < spec_.layers; ++l) {
    for (int64_t t = 0; t < arena_.tensors(); ++t) {
      const int64_t stride = spec_.stride(l, t);
      checked_mul(stride, spr, "the bytes of a tensor");
      const auto base = reinterpret_cast<uintptr_t>(spec_.memory(l, t).base);
      for (int64_t j = 0; j < spr; ++j) {
        const uintptr_t begin = base + static_cast<uintptr_t>(j * stride);
        slots.push_back({begin, begin + static_cast<uintptr_t>(arena_.tensor_bytes(t)), l, t});
      }
    }
  }
  // Ties broken by layer and tensor, so the message is the same on every run.
  std::sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) {
    return std::tie(a.begin, a.layer, a.tensor) < std::tie(b.begin, b.layer, b.tensor);
  });
  for (size_t i = 1; i < slots.size(); ++i) {
    if (slots[i].begin < slots[i - 1].end) {
      fail("weight spec: layer ", slots[i - 1].layer, " tensor '",
           spec_.tensors[static_cast<size_t>(slots[i - 1].tensor)].name, "' and layer ",
           slots[i].layer, " tensor '", spec_.tensors[static_cast<size_t>(slots[i].tensor)].name,
           "' overlap in memory: every slot of every layer and tensor needs bytes of its own");
    }
  }
}

// ---------------------------------------------------------------- regions
void WeightStore::allocate(transport::Transport& transport) {
  const bool engine = spec_.engine_weights();
  if (transport.capabilities().device_memory &&
      (config_.backup.copies > 0 || config_.backup.loader)) {
    fail<NotSupported>("Config::backup: the ", transport.backend(), " transport keeps the "
                       "weights in device memory, and the backup copies and loader are host "
                       "memory only; use a host transport or no backup");
  }
  regions_.transport = &transport;
  regions_.arena = transport.allocate(
      static_cast<size_t>(engine ? arena_.layer_bytes() : arena_.total_bytes()));
  if (engine) register_engine_tensors();
  const int64_t backup_bytes = backup_.bytes(seat_);
  regions_.backup = backup_bytes > 0 ? transport.allocate(static_cast<size_t>(backup_bytes))
                                     : transport::Region{};
}

// The engine's tensors, one transport region each, right after the staging region.
void WeightStore::register_engine_tensors() {
  transport::Transport& transport = *regions_.transport;
  if (!transport.capabilities().register_memory) {
    fail<NotSupported>("the ", transport.backend(), " transport cannot serve reads from "
                       "memory the engine allocated (register_memory); use a transport that "
                       "can (shm, ucx, hybrid, inproc) or let eplb allocate the arena");
  }
  const int64_t spr = config_.layout.slots_per_rank();
  EngineTensors& engine = regions_.engine;
  engine.tensors = arena_.tensors();
  engine.at.clear();
  for (int64_t l = 0; l < spec_.layers; ++l) {
    for (int64_t t = 0; t < arena_.tensors(); ++t) {
      const TensorMemory& m = spec_.memory(l, t);
      const int64_t stride = spec_.stride(l, t);
      const int64_t bytes = (spr - 1) * stride + arena_.tensor_bytes(t);
      const transport::Region r = transport.register_memory(m.base, static_cast<size_t>(bytes));
      EPLB_CHECK_EQ(r.id, regions_.arena.id + 1 + static_cast<int>(engine.at.size()),
                    "the engine's regions follow the staging region");
      engine.at.push_back({r.id, static_cast<std::byte*>(m.base), stride});
    }
  }
}

int64_t WeightStore::publish_bytes_held() {
  const auto bytes = static_cast<int64_t>(regions_.arena.bytes);
  bytes_held_.store(bytes, std::memory_order_release);
  return bytes;
}

void WeightStore::clear_peers() {
  const auto ranks = static_cast<size_t>(config_.layout.ranks);
  regions_.peer_region.assign(ranks, -1);
  regions_.peer_backup_region.assign(ranks, -1);
  regions_.peer_of_seat.assign(ranks, -1);
}

void WeightStore::set_peer(int seat, int peer, int region, int backup_region) {
  regions_.peer_of_seat[static_cast<size_t>(seat)] = peer;
  regions_.peer_region[static_cast<size_t>(seat)] = region;
  regions_.peer_backup_region[static_cast<size_t>(seat)] = backup_region;
}

void WeightStore::probe_peers(std::chrono::milliseconds timeout) const {
  // In the arena, the last buffer: a peer that is past reconfigure's exchange copies its layers
  // into buffers 0 .. layers - 1 of its new region (move_from), never into that one.
  const bool engine = spec_.engine_weights();
  constexpr size_t kProbe = 8;
  const auto at = static_cast<uint64_t>(engine ? 0 : arena_.offset(spec_.layers, 0, 0));
  const size_t bytes = std::min<size_t>(
      kProbe, static_cast<size_t>(engine ? arena_.tensor_bytes(0) : arena_.layer_bytes()));
  const int self = regions_.transport->rank();
  std::vector<std::byte> probe(kProbe * regions_.peer_of_seat.size());
  std::vector<transport::Read> reads;
  for (size_t seat = 0; seat < regions_.peer_of_seat.size(); ++seat) {
    const int peer = regions_.peer_of_seat[seat];
    if (peer < 0 || peer == self) continue;
    reads.push_back({.peer = peer,
                     .region = engine ? regions_.engine.at.front().region
                                      : regions_.peer_region[seat],
                     .offset = at,
                     .dst = probe.data() + kProbe * seat,
                     .bytes = bytes});
  }
  if (!reads.empty()) regions_.transport->post(reads)->wait(timeout);
}

void WeightStore::move_from(const Regions& old) {
  if (!spec_.engine_weights()) {
    if (config_.installer) config_.installer->wait_marked(config_.timeout);
    const auto bytes = static_cast<size_t>(arena_.layer_bytes());
    std::vector<transport::Read> copies;
    for (int64_t l = 0; l < spec_.layers; ++l) {
      const int64_t from = arena_.offset(map_.buffer_of_layer[l], 0, 0);
      std::byte* to = regions_.arena.data + arena_.offset(l, 0, 0);
      if (old.transport->capabilities().device_memory) {
        copies.push_back({.peer = old.transport->rank(), .region = old.arena.id,
                          .offset = static_cast<uint64_t>(from), .dst = to, .bytes = bytes});
      } else {
        std::memcpy(to, old.arena.data + from, bytes);
      }
    }
    if (!copies.empty()) old.transport->post(copies)->wait(config_.timeout);
    map_ = BufferMap(spec_.layers);
  }
  if (old.backup.bytes > 0 && regions_.backup.bytes == old.backup.bytes) {
    std::memcpy(regions_.backup.data, old.backup.data, old.backup.bytes);
  }
}

bool WeightStore::device_memory() const {
  return regions_.transport != nullptr && regions_.transport->capabilities().device_memory;
}

// ---------------------------------------------------------------- weights
std::span<std::byte> WeightStore::weights(int64_t layer, int64_t tensor) const {
  EPLB_CHECK(allocated(), "weights() needs connect() first (it allocates the arena; a joining "
             "rank: reconfigure())");
  EPLB_CHECK(layer >= 0 && layer < spec_.layers, "weights: layer ", layer, " is outside [0, ",
             spec_.layers, ")");
  EPLB_CHECK(tensor >= 0 && tensor < arena_.tensors(), "weights: tensor ", tensor,
             " is outside [0, ", arena_.tensors(), ")");
  const int64_t spr = config_.layout.slots_per_rank();
  if (spec_.engine_weights()) {
    const EngineTensors::Tensor& e = regions_.engine.of(layer, tensor);
    return {e.base, static_cast<size_t>((spr - 1) * e.stride + arena_.tensor_bytes(tensor))};
  }
  return {regions_.arena.data + arena_.offset(map_.buffer_of_layer[layer], tensor, 0),
          static_cast<size_t>(arena_.tensor_bytes(tensor) * spr)};
}

std::span<std::byte> WeightStore::slot_weights(int64_t layer, int64_t tensor,
                                               int64_t slot) const {
  const int64_t spr = config_.layout.slots_per_rank();
  EPLB_CHECK(slot >= 0 && slot < spr, "slot_weights: slot ", slot, " is outside [0, ", spr,
             ")");
  const std::span<std::byte> all = weights(layer, tensor);
  const int64_t stride = spec_.engine_weights() ? regions_.engine.of(layer, tensor).stride
                                                : arena_.tensor_bytes(tensor);
  return all.subspan(static_cast<size_t>(slot * stride),
                     static_cast<size_t>(arena_.tensor_bytes(tensor)));
}

// kSwap: O(1) in the weights' size; kCopy: one layer copied (or enqueued, by the installer);
// the engine's tensors: slot by slot, the staged bytes of every slot whose expert changes.
int64_t WeightStore::install(const migration::LayerMigration& migration, int64_t layer) {
  Installer* installer = config_.installer.get();
  std::byte* const base = regions_.arena.data;
  int64_t copied = 0;
  const auto copy = [&](std::byte* live, const std::byte* staged, size_t bytes) {
    if (installer) {
      installer_or_stop([&] { installer->copy(live, staged, bytes); }, layer);
    } else {
      std::memcpy(live, staged, bytes);
    }
    copied += static_cast<int64_t>(bytes);
  };
  if (spec_.engine_weights()) {
    const auto actions = migration.plan.rank_actions(seat_, config_.layout);
    for (size_t j = 0; j < actions.size(); ++j) {
      if (actions[j].action == migration::Action::kUnchanged) continue;
      for (int64_t t = 0; t < arena_.tensors(); ++t) {
        const EngineTensors::Tensor& e = regions_.engine.of(layer, t);
        copy(e.base + static_cast<int64_t>(j) * e.stride,
             base + arena_.offset(0, t, static_cast<int64_t>(j)),
             static_cast<size_t>(arena_.tensor_bytes(t)));
      }
    }
  } else if (swaps()) {
    map_.install(layer);
  } else {
    copy(base + arena_.offset(map_.buffer_of_layer[layer], 0, 0),
         base + arena_.offset(map_.staging, 0, 0), static_cast<size_t>(arena_.layer_bytes()));
  }
  if (installer) installer_or_stop([&] { installer->mark(); }, layer);
  return copied;
}

// An installer that fails mid-install (a CUDA error on the engine's stream) leaves this rank's
// weights, tables and buffer map no longer in step with each other or with the other ranks',
// and there is no consistent way back: the process stops, loudly, so that its peers see a dead
// rank and abandon the rebalance cleanly instead of serving wrong experts.
template <typename F>
void WeightStore::installer_or_stop(F&& call, int64_t layer) const {
  try {
    call();
  } catch (...) {
    spdlog::critical("eplb runtime rank {}: the installer failed installing layer {}: {}; "
                     "this rank's weights can no longer be trusted, stopping the process",
                     seat_, layer, Failure::current().message);
    spdlog::shutdown();
    std::abort();
  }
}

// ---------------------------------------------------------------- backup
std::vector<int32_t> WeightStore::backup_experts() const {
  return backup_.copies() > 0 ? backup_.experts_of(seat_) : std::vector<int32_t>{};
}

std::span<std::byte> WeightStore::backup_weights(int64_t layer, int64_t tensor,
                                                 int32_t expert) const {
  EPLB_CHECK(regions_.backup.bytes > 0,
             "backup_weights: this rank keeps no backup copy (Config::backup.copies is 0, or "
             "connect()/reconfigure() has not run yet)");
  EPLB_CHECK(layer >= 0 && layer < spec_.layers, "backup_weights: layer ", layer,
             " is outside [0, ", spec_.layers, ")");
  EPLB_CHECK(tensor >= 0 && tensor < arena_.tensors(), "backup_weights: tensor ", tensor,
             " is outside [0, ", arena_.tensors(), ")");
  if (backup_.index(seat_, expert) < 0) {
    fail("backup_weights: seat ", seat_, " keeps no copy of expert ", expert,
         " (backup_experts() lists those it does)");
  }
  return {regions_.backup.data + backup_.offset(seat_, layer, expert, tensor),
          static_cast<size_t>(arena_.tensor_bytes(tensor))};
}

void WeightStore::fill_backup(
    const std::function<void(int64_t, int64_t, int32_t, std::span<std::byte>)>& fill) {
  if (backup_.copies() == 0) return;
  for (int64_t l = 0; l < spec_.layers; ++l) {
    for (const int32_t e : backup_.experts_of(seat_)) {
      for (int64_t t = 0; t < arena_.tensors(); ++t) fill(l, t, e, backup_weights(l, t, e));
    }
  }
  backup_filled_.store(true, std::memory_order_release);
}

std::vector<std::vector<int32_t>> WeightStore::backup_holders() const {
  std::vector<std::vector<int32_t>> holders(static_cast<size_t>(config_.layout.experts));
  for (int32_t e = 0; e < config_.layout.experts; ++e) {
    for (const int32_t seat : backup_.holders(e)) {
      if (member(seat) && regions_.peer_backup_region[static_cast<size_t>(seat)] >= 0) {
        holders[e].push_back(seat);
      }
    }
  }
  return holders;
}

}  // namespace eplb::runtime
