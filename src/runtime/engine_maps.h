#pragma once
// The engine's map tensors (Rebalancer::bind_maps) and the writes that keep them equal to the
// placement and dispatch tables in force. Forward thread only: tensors are bound there, and
// written there at bind time, at every layer install (inside step_end(), at the step every rank
// installs that layer) and after reconfigure(); so the engine's router, which reads them on the
// same thread between passes, never sees a half-written row of a layer it is routing.

#include <cstdint>
#include <span>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/engine_maps.h"

namespace eplb::runtime {

class EngineMaps {
 public:
  // Checks every binding against `layers` and `layout` (InvalidArgument naming the tensor, its
  // type and shape, and what is right), then replaces the bound set; nothing changes on error.
  void bind(std::vector<MapBinding> maps, int64_t layers, const Layout& layout);
  bool empty() const { return maps_.empty(); }

  // Writes row `layer` of every bound tensor: `phy2log` ([physical]) and `tables` are the
  // layer's placement and dispatch tables now; `rank` this rank's seat (kRankDispatch).
  void write(int64_t layer, std::span<const int32_t> phy2log,
             const routing::DispatchTables& tables, int rank) const;

 private:
  std::vector<MapBinding> maps_;
};

// Reads one pass of the engine's counts ([layers][physical] or [layers][experts], per `of`) into
// `logical` ([layers][experts], zeroed first), a slot's tokens counted for the expert `phy2log`
// ([layers][physical], the placement they were routed under) gives it. InvalidArgument naming
// the tensor's shape or a negative count, before anything is written.
void read_pass_counts(const IntTensor& counts, CountsOf of, int64_t layers, const Layout& layout,
                      std::span<const int32_t> phy2log, std::span<int64_t> logical);

}  // namespace eplb::runtime
