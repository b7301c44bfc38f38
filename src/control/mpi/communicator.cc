#include "control/mpi/communicator.h"

#include <mpi.h>
#include <sched.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "eplb/core/error.h"

namespace eplb::control::mpi {
namespace {

// Set when a request was abandoned at its deadline: MPI cannot be finalized any more (it would
// wait for that request), so the exit handler skips MPI_Finalize.
std::atomic<bool> g_abandoned{false};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !g_abandoned.load()) MPI_Finalize();
}

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<std::size_t>(length));
}

void check(int code, const char* what) {
  if (code != MPI_SUCCESS) fail<IoError>("mpi: ", what, " failed: ", error_text(code));
}

// Initializes MPI once per process (unless the program already did), with calls allowed from
// any thread, one at a time.
void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
            "MPI_Init_thread");
      std::atexit(finalize_at_exit);
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      fail<NotSupported>("control mpi: this MPI gives thread level ", provided,
                         ", below MPI_THREAD_SERIALIZED (the control thread may not be the "
                         "thread that initialized MPI)");
    }
  });
}

MPI_Op to_mpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kSum:
      return MPI_SUM;
  }
  fail<InvalidArgument>("mpi: unknown reduce op ", static_cast<int>(op));
}

int to_count(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX)) {
    fail<NotSupported>("mpi: ", what, " of ", n, " elements is more than MPI's int counts hold");
  }
  return static_cast<int>(n);
}

// Completes `request` by MPI_Test until done or the deadline. Spins first (MPI is fastest when
// polled), then yields, then naps, so that oversubscribed ranks leave the cores to their peers.
void wait(MPI_Request& request, Clock::time_point deadline, const char* what) {
  for (long polls = 0;; ++polls) {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    if (Clock::now() >= deadline) {
      g_abandoned.store(true);
      fail<Timeout>("timed out in ", what,
                    " (a peer is stopped, hung or too slow; MPI cannot abandon the request, so "
                    "this process must exit)");
    }
    if (polls > 20'000) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else if (polls > 200) {
      sched_yield();
    }
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int size, std::chrono::milliseconds timeout, MPI_Comm comm)
      : Communicator(rank, size, timeout), comm_(comm) {}

  ~MpiCommunicator() override {
    if (!g_abandoned.load()) MPI_Comm_free(&comm_);
  }

  std::string_view backend() const override { return "mpi"; }

 protected:
  void do_barrier(Clock::time_point deadline) override {
    MPI_Request request;
    check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    wait(request, deadline, "MPI_Ibarrier");
  }

  void do_all_reduce(std::span<std::int64_t> values, ReduceOp op,
                     Clock::time_point deadline) override {
    if (values.empty()) return;
    MPI_Request request;
    check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), to_count(values.size(), "all_reduce"),
                         MPI_INT64_T, to_mpi(op), comm_, &request),
          "MPI_Iallreduce");
    wait(request, deadline, "MPI_Iallreduce");
  }

  void do_broadcast(Bytes& data, int root, Clock::time_point deadline) override {
    std::uint64_t length = rank() == root ? data.size() : 0;
    MPI_Request request;
    check(MPI_Ibcast(&length, 1, MPI_UINT64_T, root, comm_, &request), "MPI_Ibcast");
    wait(request, deadline, "MPI_Ibcast");
    if (rank() != root) data.resize(length);
    if (length == 0) return;
    check(MPI_Ibcast(data.data(), to_count(data.size(), "broadcast"), MPI_BYTE, root, comm_,
                     &request),
          "MPI_Ibcast");
    wait(request, deadline, "MPI_Ibcast");
  }

  std::vector<Bytes> do_all_gather(std::span<const std::byte> data,
                                   Clock::time_point deadline) override {
    std::uint64_t mine = data.size();
    std::vector<std::uint64_t> lengths(size());
    MPI_Request request;
    check(MPI_Iallgather(&mine, 1, MPI_UINT64_T, lengths.data(), 1, MPI_UINT64_T, comm_,
                         &request),
          "MPI_Iallgather");
    wait(request, deadline, "MPI_Iallgather");
    std::vector<int> counts(size()), offsets(size());
    std::size_t total = 0;
    for (int r = 0; r < size(); ++r) {
      counts[r] = to_count(lengths[r], "all_gather");
      offsets[r] = to_count(total, "all_gather");
      total += lengths[r];
    }
    to_count(total, "all_gather");
    std::vector<Bytes> out(size());
    if (total == 0) return out;
    Bytes gathered(total);
    check(MPI_Iallgatherv(data.data(), counts[rank()], MPI_BYTE, gathered.data(), counts.data(),
                          offsets.data(), MPI_BYTE, comm_, &request),
          "MPI_Iallgatherv");
    wait(request, deadline, "MPI_Iallgatherv");
    for (int r = 0; r < size(); ++r) {
      out[r].assign(gathered.begin() + offsets[r], gathered.begin() + offsets[r] + counts[r]);
    }
    return out;
  }

 private:
  MPI_Comm comm_;
};

}  // namespace

std::unique_ptr<Communicator> connect(const Options& options) {
  const auto prefix = [&] { return std::string("control connect (mpi): "); };
  ensure_initialized();
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if ((options.rank != -1 && options.rank != rank) || (options.size != -1 && options.size != size)) {
    fail<InvalidArgument>(prefix(), "Options rank ", options.rank, " and size ", options.size,
                          " do not match the MPI world's rank ", rank, " and size ", size,
                          " (pass the world's, or -1 to take them from mpirun)");
  }
  // A communicator of our own, so that eplb's collectives never mix with the program's.
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request request;
  try {
    check(MPI_Comm_idup(MPI_COMM_WORLD, &comm, &request), "MPI_Comm_idup");
    wait(request, Clock::now() + options.timeout, "MPI_Comm_idup");
    check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  } catch (const Timeout& e) {
    fail<Timeout>(prefix(), e.what());
  } catch (const IoError& e) {
    fail<IoError>(prefix(), e.what());
  }
  return std::make_unique<MpiCommunicator>(rank, size, options.timeout, comm);
}

}  // namespace eplb::control::mpi
