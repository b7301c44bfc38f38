// One rank of the mpi tests, started by mpirun from mpi_test.cc:
//   eplb_control_mpi_rank check   every conformance check; prints "rank R ok"
//   eplb_control_mpi_rank stall   the last rank never joins the all_reduce; the others must
//                                 get Timeout and print "rank R timeout ok", then all exit
//   eplb_control_mpi_rank kill    the last rank dies (SIGKILL) before an all_reduce
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "control/checks.h"
#include "eplb/control/communicator.h"
#include "eplb/core/error.h"

using namespace eplb::control;

// OpenMPI allocates at MPI_Init and never frees (its plugins are unloaded by then, so the
// leaks cannot even be attributed); LeakSanitizer would fail every rank of a sanitizer build.
// Only this test program opts out of leak checking; eplb's own code is leak-checked elsewhere.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  try {
    Options options;
    options.rank = -1;
    options.size = -1;
    options.timeout = std::chrono::milliseconds(mode == "check" ? 30'000 : 1'000);
    auto comm = connect("mpi", options);
    const int last = comm->size() - 1;
    if (mode == "check") {
      testing::check_everything(*comm, "mpi", comm->size());
      std::printf("rank %d ok\n", comm->rank());
      std::fflush(stdout);
      return 0;
    }
    comm->barrier();
    if (comm->rank() == last) {
      if (mode == "kill") raise(SIGKILL);
      // Stall past everyone's timeout, then leave without MPI (the others gave up on us).
      std::this_thread::sleep_for(std::chrono::milliseconds(3'000));
      std::fflush(stdout);
      _exit(0);
    }
    std::vector<std::int64_t> values = {1, 2, 3, 4};
    try {
      comm->all_reduce(values, ReduceOp::kSum);
    } catch (const eplb::Timeout& e) {
      const bool named = std::strstr(e.what(), "all_reduce") != nullptr;
      std::printf("rank %d timeout %s: %s\n", comm->rank(), named ? "ok" : "unnamed", e.what());
      std::fflush(stdout);
      _exit(0);  // MPI cannot go on after a timeout: exit without finalizing
    }
    std::printf("rank %d no error\n", comm->rank());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
