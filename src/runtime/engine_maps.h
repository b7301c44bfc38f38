#pragma once
// The engine's map tensors (Rebalancer::bind_maps) and the writes that keep them equal to the
// placement and dispatch tables in force. Forward thread only: tensors are bound there, and
// written there at bind time, at every layer install (inside step_end(), at the step every rank
// installs that layer) and after reconfigure(); so the engine's router, which reads them on the
// same thread between passes, never sees a half-written row of a layer it is routing.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/engine_maps.h"
#include "runtime/compact_slots.h"

namespace eplb::runtime {

class EngineMaps {
 public:
  // Checks every binding against `layers` and `layout` (InvalidArgument naming the tensor, its
  // type and shape, and what is right), then replaces the bound set; nothing changes on error.
  // The slots of one call's tensors are numbered as the layout's, or as the members' (`members`:
  // an engine that re-slices its maps after losing ranks, as vLLM's elastic EP does) when its
  // physical_to_logical tensor is at the members' width. The old tensors are never written again.
  void bind(std::vector<MapBinding> maps, int64_t layers, const Layout& layout,
            const CompactSlots& members);
  bool empty() const { return maps_.empty(); }

  // After the group changed (reconfigure): unbinds the tensors numbered as members other than
  // `members` and returns their names (the engine binds views of the new width).
  std::vector<std::string> unbind_other_members(const CompactSlots& members);

  // Writes row `layer` of every bound tensor: `phy2log` ([physical]) and `tables` are the
  // layer's placement and dispatch tables now; `rank` this rank's seat (kRankDispatch).
  void write(int64_t layer, std::span<const int32_t> phy2log,
             const routing::DispatchTables& tables, int rank) const;

 private:
  struct Bound {
    MapBinding map;
    std::optional<CompactSlots> compact;  // numbered as these members' slots, not the layout's
  };
  std::vector<Bound> maps_;
};

// Reads one pass of the engine's counts ([layers][physical] or [layers][experts], per `of`;
// per slot also [layers][members' slots], numbered as `compact`) into `logical`
// ([layers][experts], zeroed first), a slot's tokens counted for the expert `phy2log`
// ([layers][physical], the placement they were routed under) gives it. InvalidArgument naming
// the tensor's shape or a negative count, before anything is written.
void read_pass_counts(const IntTensor& counts, CountsOf of, int64_t layers, const Layout& layout,
                      const CompactSlots& compact, std::span<const int32_t> phy2log,
                      std::span<int64_t> logical);

}  // namespace eplb::runtime
