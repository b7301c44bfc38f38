#pragma once
// The conformance checks of a Communicator, run by every rank of a group (threads, forked
// processes or mpirun's ranks). Each throws CheckFailed naming what differed.

#include <stdexcept>
#include <string>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"

namespace eplb::control::testing {

struct CheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define EPLB_REQUIRE(cond, ...)                                                          \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      throw ::eplb::control::testing::CheckFailed(::eplb::detail::concat(                \
          __FILE__, ":", __LINE__, ": ", #cond, " failed" __VA_OPT__(, ": ", ) __VA_ARGS__)); \
    }                                                                                    \
  } while (0)

void check_identity(Communicator& comm, const std::string& backend, int size);
void check_barrier(Communicator& comm);
void check_all_reduce(Communicator& comm);
void check_all_reduce_large(Communicator& comm);
void check_broadcast(Communicator& comm);
void check_all_gather(Communicator& comm);
void check_from_another_thread(Communicator& comm);
void check_many_in_a_row(Communicator& comm);

// All of the above, in that order.
void check_everything(Communicator& comm, const std::string& backend, int size);

}  // namespace eplb::control::testing
