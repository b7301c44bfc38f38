#pragma once
// What the backends that run their own rounds (inproc, shm) put in each message, so that a rank
// calling a different collective, op, root or length than its peers is told so instead of
// silently exchanging garbage.

#include <cstdint>
#include <string>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"

namespace eplb::control::detail {

enum class Kind : std::uint32_t { kJoin = 1, kBarrier, kAllReduce, kBroadcast, kAllGather };

// What a rank called: the collective, its op or root, and (all_reduce) its element count.
struct Call {
  Kind kind = Kind::kJoin;
  std::uint32_t arg = 0;     // all_reduce: the ReduceOp; broadcast: the root
  std::uint64_t count = 0;   // all_reduce: the element count
  bool operator==(const Call&) const = default;
};

inline std::string describe(const Call& call) {
  switch (call.kind) {
    case Kind::kJoin:
      return "join";
    case Kind::kBarrier:
      return "barrier";
    case Kind::kAllReduce:
      return ::eplb::detail::concat("all_reduce(", to_string(static_cast<ReduceOp>(call.arg)),
                                    ", ", call.count, " values)");
    case Kind::kBroadcast:
      return ::eplb::detail::concat("broadcast(root ", call.arg, ")");
    case Kind::kAllGather:
      return "all_gather";
  }
  return "?";
}

// Throws IoError when `theirs` (rank `peer`) does not match `mine`: the ranks are out of step.
inline void check_same_call(const Call& mine, const Call& theirs, int peer) {
  if (!(mine == theirs)) {
    fail<IoError>("rank ", peer, " called ", describe(theirs), " while this rank called ",
                  describe(mine),
                  " (every rank must call the same collectives in the same order)");
  }
}

}  // namespace eplb::control::detail
