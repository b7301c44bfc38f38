// The weight store, make_plan and stage_layer on their own: two ranks in one process over the
// inproc transport, no threads and no control plane. A rebalance's layers are planned, staged
// on every rank, then installed on every rank (the order the protocol's agreements give), and
// every slot of every rank must then hold its new expert's bytes.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/core/types.h"
#include "eplb/transport/registry.h"
#include "runtime/compute.h"
#include "runtime/stage.h"
#include "runtime/weight_store.h"

namespace eplb::runtime {
namespace {

constexpr int64_t kLayers = 3;
constexpr int64_t kBytes = 24;  // one expert of the one tensor

std::byte pattern(int64_t layer, int32_t expert, int64_t i) {
  return static_cast<std::byte>((layer * 31 + expert * 7 + i) & 0xff);
}

Config two_ranks(Install install = Install::kSwap, int64_t copies = 0) {
  Config c;
  c.layout = {.experts = 4, .physical = 6, .ranks = 2, .nodes = 1};
  c.timeout = std::chrono::milliseconds(10'000);
  c.install = install;
  c.backup.copies = copies;
  return c;
}

WeightSpec arena_spec() {
  WeightSpec s;
  s.layers = kLayers;
  s.tensors = {{.name = "w", .expert_bytes = kBytes}};
  return s;
}

// Two ranks, connected to each other as connect() would, each slot holding its expert's bytes.
struct Ranks {
  Config config;
  WeightSpec spec = arena_spec();
  std::vector<std::unique_ptr<transport::Transport>> transports;
  std::vector<std::unique_ptr<WeightStore>> stores;
  std::vector<int32_t> phy2log;  // [layers][physical], what the slots hold

  explicit Ranks(Config c) : config(std::move(c)) {
    const Placement start = trivial_placement(kLayers, config.layout.experts,
                                              config.layout.physical);
    phy2log = start.phy2log;
    for (int g = 0; g < 2; ++g) {
      transports.push_back(transport::create("inproc", {.rank = g}));
      stores.push_back(std::make_unique<WeightStore>(config, spec, g, transports.back().get()));
      stores.back()->allocate(*transports.back());
    }
    for (int g = 0; g < 2; ++g) {
      stores[g]->clear_peers();
      for (int h = 0; h < 2; ++h) {
        if (h != g) transports[g]->import_descriptor(h, transports[h]->export_descriptor());
        const WeightStore::Regions& r = stores[h]->regions();
        stores[g]->set_peer(h, h, r.arena.id, r.backup.bytes > 0 ? r.backup.id : -1);
      }
    }
    for (int g = 0; g < 2; ++g) fill(g);
  }

  int64_t spr() const { return config.layout.slots_per_rank(); }

  void fill(int g) {
    for (int64_t l = 0; l < kLayers; ++l) {
      for (int64_t j = 0; j < spr(); ++j) {
        const int32_t e = phy2log[l * config.layout.physical + g * spr() + j];
        std::span<std::byte> slot = stores[g]->slot_weights(l, 0, j);
        for (int64_t i = 0; i < kBytes; ++i) slot[i] = pattern(l, e, i);
      }
    }
  }

  // Every slot of every rank holds the bytes of the expert phy2log names.
  void expect_weights() const {
    for (int g = 0; g < 2; ++g) {
      for (int64_t l = 0; l < kLayers; ++l) {
        for (int64_t j = 0; j < spr(); ++j) {
          const int32_t e = phy2log[l * config.layout.physical + g * spr() + j];
          const std::span<std::byte> slot = stores[g]->slot_weights(l, 0, j);
          for (int64_t i = 0; i < kBytes; ++i) {
            ASSERT_EQ(slot[i], pattern(l, e, i))
                << "rank " << g << " layer " << l << " slot " << j << " expert " << e;
          }
        }
      }
    }
  }
};

// Expert 3 of every layer carries most of the load.
std::vector<int64_t> skewed_window(const Layout& layout) {
  std::vector<int64_t> w(static_cast<size_t>(kLayers * layout.experts), 10);
  for (int64_t l = 0; l < kLayers; ++l) w[l * layout.experts + 3] = 1000;
  return w;
}

TEST(WeightStore, WeightsAreTheLiveBufferOfEachLayer) {
  Ranks r(two_ranks());
  const WeightStore& s = *r.stores[0];
  EXPECT_TRUE(s.allocated());
  EXPECT_EQ(s.bytes_held(), 0);  // published once connect() succeeded
  EXPECT_EQ(r.stores[0]->publish_bytes_held(), (kLayers + 1) * r.spr() * kBytes);
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::span<std::byte> all = s.weights(l, 0);
    EXPECT_EQ(all.size(), static_cast<size_t>(r.spr() * kBytes));
    EXPECT_EQ(s.slot_weights(l, 0, 1).data(), all.data() + kBytes);
  }
  EXPECT_THROW(s.weights(kLayers, 0), InvalidArgument);
  EXPECT_THROW(s.weights(0, 1), InvalidArgument);
  EXPECT_THROW(s.slot_weights(0, 0, r.spr()), InvalidArgument);
  r.expect_weights();
}

TEST(WeightStore, NothingServedBeforeAllocate) {
  const Config config = two_ranks();
  const WeightSpec spec = arena_spec();
  const WeightStore s(config, spec, 0, nullptr);
  EXPECT_FALSE(s.allocated());
  EXPECT_THROW(s.weights(0, 0), InvalidArgument);
  EXPECT_EQ(s.backup_bytes(), 0);
  EXPECT_TRUE(s.member(1));  // every seat a member until an exchange says otherwise
}

TEST(WeightStore, EngineSlotsThatOverlapAreRefused) {
  const Config config = two_ranks();
  WeightSpec spec = arena_spec();
  std::vector<std::byte> memory(static_cast<size_t>(kLayers * 3 * kBytes));
  for (int64_t l = 0; l < kLayers; ++l) {
    // Layer l starts one expert after layer l - 1: its slots overlap the previous layer's.
    spec.engine.push_back({.base = memory.data() + l * kBytes, .stride = kBytes});
  }
  try {
    WeightStore s(config, spec, 0, nullptr);
    FAIL() << "overlapping slots accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("overlap in memory"), std::string::npos) << e.what();
  }
}

TEST(WeightStore, PlannedLayersStagedEverywhereThenInstalledHoldTheirExperts) {
  for (const Install install : {Install::kSwap, Install::kCopy}) {
    SCOPED_TRACE(install_name(install));
    Ranks r(two_ranks(install));
    const Layout& layout = r.config.layout;
    const std::span<std::byte> before = r.stores[0]->weights(0, 0);
    const RebalancePlan plan =
        make_plan(skewed_window(layout), r.phy2log, r.config, r.spec.expert_bytes());
    ASSERT_FALSE(plan.skipped) << plan.skip_reason;
    ASSERT_FALSE(plan.moved_layers.empty());
    for (size_t k = 0; k < plan.moved_layers.size(); ++k) {
      const int64_t layer = plan.moved_layers[k];
      for (int g = 0; g < 2; ++g) {  // every rank stages before any installs
        const StageContext context{.weights = *r.stores[g]};
        ASSERT_TRUE(stage_layer(context, r.stores[g]->map(), layer, plan.migrations[k]));
      }
      for (int g = 0; g < 2; ++g) {
        const int64_t copied = r.stores[g]->install(plan.migrations[k], layer);
        EXPECT_EQ(copied, install == Install::kCopy ? r.spr() * kBytes : 0);
      }
      std::copy(plan.phy2log[k].begin(), plan.phy2log[k].end(),
                r.phy2log.begin() + layer * layout.physical);
      r.expect_weights();
    }
    // Swap moves a layer's weights to the old staging buffer; copy never moves them.
    EXPECT_EQ(r.stores[0]->weights(0, 0).data() == before.data(),
              install == Install::kCopy || plan.moved_layers.front() != 0);
    EXPECT_EQ(r.stores[0]->swaps(), install == Install::kSwap);
  }
}

TEST(WeightStore, MovedToANewTransportTheLayersKeepTheirBytesAndTheMapIsTheIdentity) {
  Ranks r(two_ranks());
  const RebalancePlan plan =
      make_plan(skewed_window(r.config.layout), r.phy2log, r.config, r.spec.expert_bytes());
  ASSERT_FALSE(plan.moved_layers.empty());
  const int64_t layer = plan.moved_layers.front();
  for (int g = 0; g < 2; ++g) {
    ASSERT_TRUE(stage_layer({.weights = *r.stores[g]}, r.stores[g]->map(), layer,
                            plan.migrations[0]));
  }
  for (int g = 0; g < 2; ++g) r.stores[g]->install(plan.migrations[0], layer);
  std::copy(plan.phy2log[0].begin(), plan.phy2log[0].end(),
            r.phy2log.begin() + layer * r.config.layout.physical);
  ASSERT_NE(r.stores[0]->map().buffer_of_layer[layer], layer);  // swapped

  // A reconfigure that fails puts the old regions back.
  const WeightStore::Regions old = r.stores[0]->regions();
  auto next = transport::create("inproc", {.rank = 0});
  r.stores[0]->allocate(*next);
  EXPECT_NE(r.stores[0]->regions().arena.data, old.arena.data);
  r.stores[0]->restore(old);
  EXPECT_EQ(r.stores[0]->regions().arena.data, old.arena.data);
  r.expect_weights();

  // One that succeeds moves the live layers, in layer order.
  r.stores[0]->allocate(*next);
  r.stores[0]->move_from(old);
  for (int64_t l = 0; l < kLayers; ++l) EXPECT_EQ(r.stores[0]->map().buffer_of_layer[l], l);
  EXPECT_EQ(&r.stores[0]->transport(), next.get());
  r.transports[0] = std::move(next);  // after the store let go of the old regions' reads
  r.expect_weights();
}

TEST(WeightStore, BackupCopiesAreFilledServedAndOfferedOnlyWhereFilled) {
  Ranks r(two_ranks(Install::kSwap, 1));
  WeightStore& s = *r.stores[0];
  EXPECT_GT(s.backup_bytes(), 0);
  const std::vector<int32_t> mine = s.backup_experts();
  ASSERT_FALSE(mine.empty());
  EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end()));
  EXPECT_FALSE(s.backup_filled());
  s.fill_backup([](int64_t l, int64_t, int32_t e, std::span<std::byte> bytes) {
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = pattern(l, e, static_cast<int64_t>(i));
  });
  EXPECT_TRUE(s.backup_filled());
  for (const int32_t e : mine) {
    const std::span<std::byte> b = s.backup_weights(kLayers - 1, 0, e);
    ASSERT_EQ(b.size(), static_cast<size_t>(kBytes));
    EXPECT_EQ(b[5], pattern(kLayers - 1, e, 5));
  }
  int32_t other = 0;
  while (std::find(mine.begin(), mine.end(), other) != mine.end()) ++other;
  EXPECT_THROW(s.backup_weights(0, 0, other), InvalidArgument);

  // A seat whose copy is not usable (-1) is no holder; a seat that is no member neither.
  s.set_peer(1, 1, r.stores[1]->regions().arena.id, -1);
  std::vector<std::vector<int32_t>> holders = s.backup_holders();
  ASSERT_EQ(holders.size(), 4u);
  for (int32_t e = 0; e < 4; ++e) {
    const bool held = std::find(mine.begin(), mine.end(), e) != mine.end();
    EXPECT_EQ(holders[e], held ? std::vector<int32_t>{0} : std::vector<int32_t>{})
        << "expert " << e;
  }
  s.set_peer(0, -1, s.regions().arena.id, s.regions().backup.id);
  holders = s.backup_holders();
  for (const std::vector<int32_t>& h : holders) EXPECT_TRUE(h.empty());
}

TEST(MakePlan, AProposalIsPlannedAsProposedAndUnchangedLayersAreNotMoved) {
  const Config config = two_ranks();
  const Layout& layout = config.layout;
  const Placement current = trivial_placement(kLayers, layout.experts, layout.physical);
  Placement proposal = current;
  // Layer 1 only: rank 0's slots take what rank 1's held and the other way round.
  int32_t* row = proposal.phy2log.data() + 1 * layout.physical;
  std::rotate(row, row + layout.slots_per_rank(), row + layout.physical);
  proposal.derive_from_phy2log();
  ASSERT_NE(proposal.phy2log, current.phy2log);
  const std::vector<int64_t> window(static_cast<size_t>(kLayers * layout.experts), 1);
  const RebalancePlan plan = make_plan(window, current.phy2log, config, kBytes, {}, {},
                                       &proposal);
  ASSERT_FALSE(plan.skipped) << plan.skip_reason;
  ASSERT_EQ(plan.moved_layers, std::vector<int64_t>{1});
  EXPECT_EQ(plan.phy2log[0], std::vector<int32_t>(row, row + layout.physical));
  EXPECT_GT(plan.slots_moved, 0);
  ASSERT_EQ(plan.tables.size(), 1u);
}

TEST(MakePlan, AHotExpertGetsReplicasAndEveryExpertKeepsASlot) {
  const Config config = two_ranks();
  const Layout& layout = config.layout;
  const Placement current = trivial_placement(kLayers, layout.experts, layout.physical);
  const RebalancePlan plan = make_plan(skewed_window(layout), current.phy2log, config, kBytes);
  ASSERT_FALSE(plan.skipped) << plan.skip_reason;
  EXPECT_GE(plan.balancedness_after, plan.balancedness_before);
  ASSERT_EQ(plan.migrations.size(), plan.moved_layers.size());
  ASSERT_EQ(plan.phy2log.size(), plan.moved_layers.size());
  EXPECT_TRUE(std::is_sorted(plan.moved_layers.begin(), plan.moved_layers.end()));
  for (const std::vector<int32_t>& row : plan.phy2log) {
    ASSERT_EQ(row.size(), static_cast<size_t>(layout.physical));
    const std::set<int32_t> experts(row.begin(), row.end());
    EXPECT_EQ(experts.size(), static_cast<size_t>(layout.experts));
    EXPECT_GE(std::count(row.begin(), row.end(), 3), 2);
  }
  // The same window and placement give the same plan (every rank computes it alone).
  const RebalancePlan again = make_plan(skewed_window(layout), current.phy2log, config, kBytes);
  EXPECT_EQ(again.moved_layers, plan.moved_layers);
  EXPECT_EQ(again.phy2log, plan.phy2log);
}

}  // namespace
}  // namespace eplb::runtime
