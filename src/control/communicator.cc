#include "eplb/control/communicator.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "control/inproc/communicator.h"
#include "control/shm/communicator.h"
#include "eplb/config.h"
#include "eplb/core/error.h"

#if EPLB_HAVE_GLOO
#include "control/gloo/communicator.h"
#endif
#if EPLB_HAVE_MPI
#include "control/mpi/communicator.h"
#endif

namespace eplb::control {

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kSum:
      return "sum";
  }
  return "?";
}

void reduce_into(std::span<std::int64_t> acc, std::span<const std::int64_t> in, ReduceOp op) {
  EPLB_CHECK_EQ(acc.size(), in.size(), "reduce_into: lengths differ");
  switch (op) {
    case ReduceOp::kMin:
      for (size_t i = 0; i < acc.size(); ++i) acc[i] = std::min(acc[i], in[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < acc.size(); ++i) acc[i] = std::max(acc[i], in[i]);
      return;
    case ReduceOp::kSum:
      // Wrapping sum: the result does not depend on the order of the ranks.
      for (size_t i = 0; i < acc.size(); ++i) {
        acc[i] = static_cast<std::int64_t>(static_cast<std::uint64_t>(acc[i]) +
                                           static_cast<std::uint64_t>(in[i]));
      }
      return;
  }
}

struct Communicator::State {
  std::atomic<bool> busy{false};
  std::atomic<bool> broken{false};
  std::string broken_by;  // written and read only by the caller that holds `busy`
};

Communicator::Communicator(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout), state_(std::make_unique<State>()) {}

Communicator::~Communicator() = default;

bool Communicator::broken() const { return state_->broken.load(std::memory_order_acquire); }

template <typename F>
auto Communicator::run(const char* op, std::chrono::milliseconds timeout, F&& body) {
  const auto prefix = [&] {
    return detail::concat("control ", op, " (", backend(), ", rank ", rank_, " of ", size_,
                          "): ");
  };
  if (timeout == kDefaultTimeout) timeout = timeout_;
  if (timeout.count() < 0) {
    fail<InvalidArgument>(prefix(), "timeout ", timeout.count(),
                          " ms is negative (pass a duration >= 0, or kDefaultTimeout)");
  }
  bool expected = false;
  if (!state_->busy.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
    fail<InvalidArgument>(prefix(),
                          "called while another collective of this communicator is running "
                          "on another thread (calls of one communicator must be a sequence)");
  }
  struct Release {
    std::atomic<bool>& busy;
    ~Release() { busy.store(false, std::memory_order_release); }
  } release{state_->busy};

  if (state_->broken.load(std::memory_order_relaxed)) {
    fail<IoError>(prefix(), "the communicator is unusable after an earlier failure (",
                  state_->broken_by, "); build a new one");
  }
  const auto deadline = Clock::now() + timeout;
  try {
    return body(deadline);
  } catch (const Timeout& e) {
    state_->broken_by = detail::concat(op, ": ", e.what());
    state_->broken.store(true, std::memory_order_release);
    throw Timeout(prefix() + e.what());
  } catch (const IoError& e) {
    state_->broken_by = detail::concat(op, ": ", e.what());
    state_->broken.store(true, std::memory_order_release);
    throw IoError(prefix() + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(prefix() + e.what());
  }
}

void Communicator::barrier(std::chrono::milliseconds timeout) {
  run("barrier", timeout, [&](Clock::time_point deadline) { do_barrier(deadline); });
}

void Communicator::all_reduce(std::span<std::int64_t> values, ReduceOp op,
                              std::chrono::milliseconds timeout) {
  run("all_reduce", timeout,
      [&](Clock::time_point deadline) { do_all_reduce(values, op, deadline); });
}

void Communicator::broadcast(Bytes& data, int root, std::chrono::milliseconds timeout) {
  run("broadcast", timeout, [&](Clock::time_point deadline) {
    if (root < 0 || root >= size_) {
      fail<InvalidArgument>("root ", root, " is not a rank (ranks are 0..", size_ - 1, ")");
    }
    do_broadcast(data, root, deadline);
  });
}

std::vector<Bytes> Communicator::all_gather(std::span<const std::byte> data,
                                            std::chrono::milliseconds timeout) {
  return run("all_gather", timeout,
             [&](Clock::time_point deadline) { return do_all_gather(data, deadline); });
}

// The registry: one factory per built backend, listed here explicitly.
namespace {

const std::vector<std::pair<std::string, Factory>>& registry() {
  static const auto* entries = [] {
    auto* list = new std::vector<std::pair<std::string, Factory>>;
    list->emplace_back("inproc", &inproc::connect);
    list->emplace_back("shm", &shm::connect);
#if EPLB_HAVE_GLOO
    list->emplace_back("gloo", &gloo::connect);
#endif
#if EPLB_HAVE_MPI
    list->emplace_back("mpi", &mpi::connect);
#endif
    return list;
  }();
  return *entries;
}

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : registry()) names.push_back(name);
  return names;
}

std::unique_ptr<Communicator> connect(std::string_view backend, const Options& options) {
  const auto& entries = registry();
  const auto it = std::find_if(entries.begin(), entries.end(),
                               [&](const auto& entry) { return entry.first == backend; });
  if (it == entries.end()) {
    std::string known;
    for (const auto& [name, factory] : entries) known += (known.empty() ? "" : ", ") + name;
    fail<InvalidArgument>("control backend '", backend, "' is not built in (this build has: ",
                          known, ")");
  }
  if (backend != "mpi") {
    if (options.size < 1) {
      fail<InvalidArgument>("control: size ", options.size, " must be at least 1");
    }
    if (options.rank < 0 || options.rank >= options.size) {
      fail<InvalidArgument>("control: rank ", options.rank, " is not in 0..", options.size - 1,
                            " (size ", options.size, ")");
    }
  }
  if (options.timeout.count() < 0) {
    fail<InvalidArgument>("control: timeout ", options.timeout.count(), " ms is negative");
  }
  return it->second(options);
}

}  // namespace eplb::control
