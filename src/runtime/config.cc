// The runtime's configuration: names of its options, the checks of Config and WeightSpec, and
// the fingerprint every rank compares at connect().

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <string_view>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/placement/gain.h"
#include "eplb/runtime/rebalancer.h"
#include "runtime/config.h"

namespace eplb::runtime {

uint64_t config_fingerprint(const Config& c, const WeightSpec& w) {
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(c.layout.experts), mix(c.layout.physical), mix(c.layout.ranks), mix(c.layout.nodes);
  mix(c.layout.groups), mix(c.interval), mix(c.window), mix(static_cast<int64_t>(c.placement.policy));
  mix(c.placement.hierarchical), mix(c.lag), mix(static_cast<int64_t>(c.mode)), mix(c.peers_per_round);
  mix(static_cast<int64_t>(c.agreement));
  mix(c.balancedness_period);  // it adds collectives: every rank must add the same
  // With kSwap the buffer map changes at installs and peers compute offsets from it; with
  // kCopy it never does: every rank must do the same.
  mix(static_cast<int64_t>(c.install));
  // The placement's options decide the plan (a rank that skips by a min_gain while another
  // installs would diverge): compared bit for bit. (The cost model needs not be the same: the
  // ranks decide with the mean of theirs, gain.h.)
  mix(std::bit_cast<int64_t>(c.placement.tolerance)), mix(std::bit_cast<int64_t>(c.min_gain));
  mix(std::bit_cast<int64_t>(c.min_balancedness_gain));
  mix(c.placement.thorough);
  // Where lost experts come from decides the plans of a repair.
  mix(c.backup.copies), mix(c.backup.loader ? 1 : 0);
  mix(w.layers);
  for (const TensorSpec& t : w.tensors) mix(t.expert_bytes);
  // A reader computes offsets in a peer's tensors from its own strides.
  mix(w.engine_weights() ? 1 : 0);
  for (int64_t l = 0; w.engine_weights() && l < w.layers; ++l) {
    for (int64_t t = 0; t < static_cast<int64_t>(w.tensors.size()); ++t) mix(w.stride(l, t));
  }
  return h;
}

Mode parse_mode(std::string_view name) {
  if (name == "async") return Mode::kAsync;
  if (name == "sync") return Mode::kSync;
  fail("unknown mode '", name, "' (choose async or sync)");
}

std::string_view mode_name(Mode mode) { return mode == Mode::kAsync ? "async" : "sync"; }

Agreement parse_agreement(std::string_view name) {
  if (name == "internal") return Agreement::kInternal;
  if (name == "external") return Agreement::kExternal;
  fail("unknown agreement '", name, "' (choose internal or external)");
}

std::string_view agreement_name(Agreement agreement) {
  return agreement == Agreement::kInternal ? "internal" : "external";
}

OnError parse_on_error(std::string_view name) {
  if (name == "log") return OnError::kLog;
  if (name == "raise") return OnError::kRaise;
  fail("unknown on_error '", name, "' (choose log or raise)");
}

Install parse_install(std::string_view name) {
  if (name == "swap") return Install::kSwap;
  if (name == "copy") return Install::kCopy;
  fail("unknown install '", name, "' (choose swap or copy)");
}

std::string_view install_name(Install install) {
  return install == Install::kSwap ? "swap" : "copy";
}

std::string_view outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::kCompleted: return "completed";
    case Outcome::kSkipped: return "skipped";
    case Outcome::kFailed: return "failed";
    case Outcome::kCancelled: return "cancelled";
  }
  return "?";
}

int64_t WeightSpec::stride(int64_t layer, int64_t tensor) const {
  const int64_t s = memory(layer, tensor).stride;
  return s != 0 ? s : tensors[static_cast<size_t>(tensor)].expert_bytes;
}

int64_t WeightSpec::expert_bytes() const {
  int64_t sum = 0;
  for (const TensorSpec& t : tensors) sum = checked_add(sum, t.expert_bytes, "weight spec bytes");
  return sum;
}

void WeightSpec::validate() const {
  if (layers < 1 || layers > kMaxLayers) {
    fail("weight spec: layers ", layers, " is outside [1, ", kMaxLayers, "]");
  }
  if (tensors.empty()) fail("weight spec: at least one tensor per layer is needed");
  for (const TensorSpec& t : tensors) {
    if (t.expert_bytes < 1) {
      fail("weight spec: tensor '", t.name, "' has expert_bytes ", t.expert_bytes,
           " (must be at least 1)");
    }
  }
  (void)expert_bytes();  // their sum fits an int64 (InvalidArgument otherwise)
  if (!engine_weights()) return;
  const auto per_layer = static_cast<int64_t>(tensors.size());
  if (static_cast<int64_t>(engine.size()) != layers * per_layer) {
    fail("weight spec: engine holds ", engine.size(), " tensors, expected layers x tensors = ",
         layers, " x ", per_layer, " (one per layer and tensor, layer-major)");
  }
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < per_layer; ++t) {
      const TensorMemory& m = memory(l, t);
      const TensorSpec& spec = tensors[static_cast<size_t>(t)];
      if (m.base == nullptr) {
        fail("weight spec: layer ", l, " tensor '", spec.name, "' has a null base address");
      }
      if (m.stride != 0 && m.stride < spec.expert_bytes) {
        fail("weight spec: layer ", l, " tensor '", spec.name, "' has stride ", m.stride,
             " bytes, below its expert_bytes ", spec.expert_bytes,
             " (slots would overlap; 0 means contiguous)");
      }
    }
  }
}

void Config::validate() const {
  layout.validate();
  if (interval < 0 || interval > kMaxSteps) {
    fail("interval ", interval, " is outside [0, ", kMaxSteps,
         "] steps (0: no rebalance of the runtime's own, only proposed placements and repairs)");
  }
  if (window < 1) fail("window ", window, " must be at least 1 step");
  if (window > kMaxSteps) fail("window ", window, " is outside [1, ", kMaxSteps, "] steps");
  if (backup.copies < 0 || backup.copies > layout.ranks) {
    fail("backup copies ", backup.copies, " is outside [0, ", layout.ranks,
         "] (each copy of an expert on another rank; 0: no host copy)");
  }
  if (lag < 1 || lag > kMaxLag) {
    fail("lag ", lag, " is outside [1, ", kMaxLag,
         "] steps (an agreement acts after it runs, and every rank keeps the agreements of the "
         "last lag steps)");
  }
  if (timeout.count() < 1 || timeout > kMaxTimeout) {
    fail("timeout ", timeout.count(), " ms is outside [1, ", kMaxTimeout.count(),
         "] ms (one day: a peer that answers in no less is gone)");
  }
  // What balanced and sticky placements need of the layout, checked here rather than at the
  // first rebalance (deepseek's packing allows two replicas of an expert on one rank).
  if (placement.policy != placement::Policy::kDeepseek) {
    if (placement.hierarchical && layout.groups % layout.nodes != 0) {
      fail("hierarchical placement needs groups ", layout.groups, " to be a multiple of nodes ",
           layout.nodes, " (whole groups are packed onto nodes)");
    }
    const int64_t experts = placement.hierarchical ? layout.experts / layout.nodes : layout.experts;
    if (layout.slots_per_rank() > experts) {
      fail("each rank holds ", layout.slots_per_rank(), " slots (", layout.describe(),
           ") but only ", experts, placement.hierarchical ? " experts live on each node" : " experts exist",
           ", so a rank would hold two replicas of one expert (need physical / ranks <= ",
           experts, " with the ", placement::policy_name(placement.policy), " policy)");
    }
  }
  if (stall_warn.count() < 0 || stall_warn > kMaxTimeout) {
    fail("stall_warn ", stall_warn.count(), " ms is outside [0, ", kMaxTimeout.count(),
         "] ms (0 turns the watchdog off)");
  }
  if (balancedness_period < -1 || balancedness_period > kMaxSteps) {
    fail("balancedness_period ", balancedness_period, " is outside [-1, ", kMaxSteps,
         "] steps (0: every interval, -1: never)");
  }
  for (const auto& [name, value] : metric_labels) {
    const bool valid = !name.empty() && name.rfind("__", 0) != 0 &&
                       std::all_of(name.begin(), name.end(), [](char c) {
                         return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
                       }) &&
                       std::isdigit(static_cast<unsigned char>(name[0])) == 0;
    // The labels eplb's own metrics carry, and those Prometheus gives a meaning.
    static constexpr std::array<std::string_view, 7> kReserved = {
        "rank", "outcome", "path", "phase", "source", "le", "quantile"};
    const bool reserved = std::find(kReserved.begin(), kReserved.end(), name) != kReserved.end();
    if (!valid || reserved) {
      fail("metric label '", name, "' is not a label eplb can add (a Prometheus label name: ",
           "letters, digits and _, not starting with a digit or __, and none of rank, outcome, ",
           "path, phase, source, le, quantile, which eplb's metrics or Prometheus use)");
    }
  }
  if (peers_per_round < 1) fail("peers_per_round ", peers_per_round, " must be at least 1");
  if (!(placement.tolerance >= 0 && placement.tolerance < 1)) {
    fail("tolerance ", placement.tolerance, " must be in [0, 1)");
  }
  if (placement.previous != nullptr || !placement.live_ranks.empty()) {
    fail("Config::placement's previous and live_ranks are the runtime's to give at each "
         "rebalance: leave them empty");
  }
  if (placement.thorough && placement.policy == placement::Policy::kDeepseek) {
    fail("thorough applies to the balanced and sticky policies, not deepseek (whose replica "
         "counts are the reference's own)");
  }
  if (!(min_balancedness_gain >= -1 && min_balancedness_gain <= 1)) {
    fail("min_balancedness_gain ", min_balancedness_gain,
         " must be in [-1, 1] (a balancedness gain; -1 never skips for it)");
  }
  placement::check_min_gain(min_gain);
  if (cost) cost->validate();
  if (agreement == Agreement::kExternal && mode != Mode::kAsync) {
    fail("agreement external needs mode async (mode ", mode_name(mode),
         " runs its agreements inside one step_end, where no engine collective can carry them)");
  }
}

}  // namespace eplb::runtime
