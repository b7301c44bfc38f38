// A placement computed elsewhere (proposal.h).

#include "runtime/proposal.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <utility>

#include "eplb/core/error.h"
#include "runtime/impl.h"
#include "runtime/in_flight.h"

namespace eplb::runtime {

Placement checked_proposal(std::span<const int32_t> phy2log, int64_t layers, int64_t width,
                           const Layout& layout, const CompactSlots& compact,
                           std::span<const int32_t> current) {
  const int64_t E = layout.experts, P = layout.physical;
  const bool full = width == P;
  if (!full && width != compact.width()) {
    fail("propose: the placement is ", layers, " layers x ", width, " slots; expected ",
         current.size() / static_cast<size_t>(P), " x ", P, " (the layout's slots)",
         compact.width() != P ? detail::concat(" or x ", compact.width(),
                                               " (the members' slots, in seat order)")
                              : std::string());
  }
  if (layers * P != static_cast<int64_t>(current.size())) {
    fail("propose: the placement has ", layers, " layers, the runtime ",
         current.size() / static_cast<size_t>(P));
  }
  if (static_cast<int64_t>(phy2log.size()) != layers * width) {
    fail("propose: the placement holds ", phy2log.size(), " slots, not ", layers, " layers x ",
         width);
  }
  Placement out(layers, E, P);
  std::copy(current.begin(), current.end(), out.phy2log.begin());
  std::vector<uint8_t> held(static_cast<size_t>(E));
  for (int64_t l = 0; l < layers; ++l) {
    std::fill(held.begin(), held.end(), 0);
    for (int64_t i = 0; i < width; ++i) {
      const int32_t e = phy2log[static_cast<size_t>(l * width + i)];
      if (e < 0 || e >= E) {
        fail("propose: layer ", l, " slot ", i, " holds expert ", e, ", outside [0, ", E,
             ") (the layout's experts)");
      }
      const int64_t slot = full ? i : compact.seat_slot(i);
      if (full && compact.compact_slot(slot) < 0) continue;  // a seat that is no member
      out.phy2log[static_cast<size_t>(l * P + slot)] = e;
      held[static_cast<size_t>(e)] = 1;
    }
    const auto missing = std::find(held.begin(), held.end(), 0);
    if (missing != held.end()) {
      fail("propose: layer ", l, " has no slot for expert ", missing - held.begin(),
           compact.width() != P ? " on the group's members" : "",
           ": every expert must be served (each needs at least one slot)");
    }
  }
  out.derive_from_phy2log();
  return out;
}

std::vector<int64_t> agreement_values(const Placement& proposal, int64_t step) {
  const size_t n = proposal.phy2log.size();
  std::vector<int64_t> v(2 * n + 2);
  for (size_t i = 0; i < n; ++i) {
    v[i] = proposal.phy2log[i];
    v[n + i] = -static_cast<int64_t>(proposal.phy2log[i]);
  }
  v[2 * n] = step;
  v[2 * n + 1] = -step;
  return v;
}

void check_agreed(std::span<const int64_t> reduced, const Placement& proposal) {
  const size_t n = proposal.phy2log.size();
  EPLB_CHECK_EQ(reduced.size(), 2 * n + 2, "check_agreed: the reduced values' size");
  const int64_t latest = reduced[2 * n], earliest = -reduced[2 * n + 1];
  if (latest != earliest) {
    fail("propose: the ranks proposed at different steps (", earliest, " to ", latest,
         "): every rank proposes at the same step, between the same two step_end() calls");
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t most = reduced[i], least = -reduced[n + i];
    if (most != least) {
      const auto P = static_cast<size_t>(proposal.physical);
      fail("propose: the ranks proposed different placements for step ", latest, ": layer ",
           i / P, " slot ", i % P, " holds expert ", least, " on one rank and ", most,
           " on another; every rank must propose the same placement (nothing installed, the "
           "placement in force stays)");
    }
  }
}

std::optional<Failure> proposal_refused(const Active& active) {
  if (!active.proposed || !active.proposal_check.valid()) return std::nullopt;
  // The forward thread's own copy: the worker may read the shared state through its own.
  const std::shared_future<CollectiveResult> check = active.proposal_check;
  // The agreement that reported the failure ran after the check on the same control thread.
  if (check.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return std::nullopt;
  const CollectiveResult& result = check.get();
  if (result.failure) return std::nullopt;
  try {
    check_agreed(result.values, *active.proposed);
  } catch (...) {
    return Failure::current();
  }
  return std::nullopt;
}

// ---------------------------------------------------------------- the runtime's entry
const CompactSlots& Rebalancer::Impl::compact_slots() const { return group_.compact(); }

// Forward thread: checked now, taken by the next step_end()'s trigger (trigger.cc, sync.cc).
void Rebalancer::Impl::propose(const Placement& placement) {
  if (lifecycle_ != Lifecycle::kConnected) {
    fail("propose() needs connect() first (a rank that joins: reconfigure())");
  }
  if (shut_down_) fail("propose() after shutdown()");
  if (records_.open) {
    fail("propose: rebalance ", records_.open->index, " (triggered at step ",
         records_.open->trigger_step, ") is still installing at step ", step_,
         ": propose once it has ended (rebalancing() false, the same step on every rank); "
         "the placement in force stays");
  }
  if (control_broken()) {
    fail("propose: no rebalance can start any more (a collective of the control plane failed: "
         "control_broken()); the placement in force stays");
  }
  if (placement.experts != config_.layout.experts) {
    fail("propose: the placement has ", placement.experts, " experts, the layout ",
         config_.layout.experts);
  }
  proposals_.queue(checked_proposal(placement.phy2log, placement.layers, placement.physical,
                                    config_.layout, compact_slots(), phy2log_),
                   step_);
}

}  // namespace eplb::runtime
