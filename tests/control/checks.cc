#include "control/checks.h"

#include <cstdint>
#include <thread>
#include <vector>

namespace eplb::control::testing {
namespace {

Bytes pattern(std::size_t n, int seed) {
  Bytes out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 31 + seed * 7) & 0xff);
  return out;
}

}  // namespace

void check_identity(Communicator& comm, const std::string& backend, int size) {
  EPLB_REQUIRE(comm.size() == size, "size ", comm.size(), " expected ", size);
  EPLB_REQUIRE(comm.rank() >= 0 && comm.rank() < size, "rank ", comm.rank());
  EPLB_REQUIRE(comm.backend() == backend, "backend ", comm.backend());
  EPLB_REQUIRE(!comm.broken());
}

void check_barrier(Communicator& comm) {
  for (int i = 0; i < 3; ++i) comm.barrier();
}

void check_all_reduce(Communicator& comm) {
  const std::int64_t r = comm.rank();
  const std::int64_t g = comm.size();
  const std::vector<std::int64_t> mine = {r, -r, r * r, 1'000'000'000'000 + r};
  std::int64_t squares = 0;
  for (std::int64_t k = 0; k < g; ++k) squares += k * k;

  auto values = mine;
  comm.all_reduce(values, ReduceOp::kMin);
  EPLB_REQUIRE((values == std::vector<std::int64_t>{0, -(g - 1), 0, 1'000'000'000'000}));
  values = mine;
  comm.all_reduce(values, ReduceOp::kMax);
  EPLB_REQUIRE((values == std::vector<std::int64_t>{g - 1, 0, (g - 1) * (g - 1),
                                                    1'000'000'000'000 + g - 1}));
  values = mine;
  comm.all_reduce(values, ReduceOp::kSum);
  EPLB_REQUIRE((values == std::vector<std::int64_t>{g * (g - 1) / 2, -g * (g - 1) / 2, squares,
                                                    1'000'000'000'000 * g + g * (g - 1) / 2}),
               values[0], " ", values[1], " ", values[2], " ", values[3]);
  std::vector<std::int64_t> none;
  comm.all_reduce(none, ReduceOp::kSum);
}

void check_all_reduce_large(Communicator& comm) {
  // More than one shared-memory round (4096 values per round) and not a multiple of it.
  const std::size_t n = 10'000;
  std::vector<std::int64_t> values(n);
  for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<std::int64_t>(i) * (comm.rank() + 1);
  comm.all_reduce(values, ReduceOp::kSum);
  const std::int64_t factor = static_cast<std::int64_t>(comm.size()) * (comm.size() + 1) / 2;
  for (std::size_t i = 0; i < n; ++i) {
    EPLB_REQUIRE(values[i] == static_cast<std::int64_t>(i) * factor, "at ", i, ": ", values[i]);
  }
}

void check_broadcast(Communicator& comm) {
  for (int root = 0; root < comm.size(); ++root) {
    const auto expected = pattern(static_cast<std::size_t>(root) * 37 + 5, root);
    Bytes data = comm.rank() == root ? expected : pattern(3, 99);
    comm.broadcast(data, root);
    EPLB_REQUIRE(data == expected, "root ", root, ": got ", data.size(), " bytes");
  }
  Bytes empty = comm.rank() == 0 ? Bytes{} : pattern(10, 1);
  comm.broadcast(empty, 0);
  EPLB_REQUIRE(empty.empty(), "empty broadcast gave ", empty.size(), " bytes");
  const int root = comm.size() - 1;
  const auto large = pattern(100'000, 5);
  Bytes data = comm.rank() == root ? large : Bytes{};
  comm.broadcast(data, root);
  EPLB_REQUIRE(data == large, "large broadcast: got ", data.size(), " bytes");
}

void check_all_gather(Communicator& comm) {
  const auto mine = pattern(static_cast<std::size_t>(comm.rank()) * 13, comm.rank());
  auto all = comm.all_gather(mine);
  EPLB_REQUIRE(static_cast<int>(all.size()) == comm.size(), all.size());
  for (int r = 0; r < comm.size(); ++r) {
    EPLB_REQUIRE(all[r] == pattern(static_cast<std::size_t>(r) * 13, r), "from rank ", r);
  }
  // One rank sends more than a shared-memory round holds, the others little or nothing.
  const auto size_of = [](int r) { return r == 1 ? std::size_t{70'000} : std::size_t(r % 2); };
  all = comm.all_gather(pattern(size_of(comm.rank()), 7));
  for (int r = 0; r < comm.size(); ++r) {
    EPLB_REQUIRE(all[r] == pattern(size_of(r), 7), "large all_gather from rank ", r, ": ",
                 all[r].size(), " bytes");
  }
}

void check_from_another_thread(Communicator& comm) {
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      check_all_reduce(comm);
      check_all_gather(comm);
    } catch (...) {
      error = std::current_exception();
    }
  });
  worker.join();
  if (error) std::rethrow_exception(error);
  comm.barrier();  // and back on the creating thread
}

void check_many_in_a_row(Communicator& comm) {
  for (int i = 0; i < 200; ++i) {
    std::vector<std::int64_t> v = {i, comm.rank()};
    comm.all_reduce(v, ReduceOp::kSum);
    EPLB_REQUIRE(v[0] == static_cast<std::int64_t>(i) * comm.size(), "iteration ", i);
    if (i % 10 == 0) {
      Bytes b = comm.rank() == i % comm.size() ? pattern(8, i) : Bytes{};
      comm.broadcast(b, i % comm.size());
      EPLB_REQUIRE(b == pattern(8, i), "iteration ", i);
    }
  }
}

void check_everything(Communicator& comm, const std::string& backend, int size) {
  check_identity(comm, backend, size);
  check_barrier(comm);
  check_all_reduce(comm);
  check_all_reduce_large(comm);
  check_broadcast(comm);
  check_all_gather(comm);
  check_from_another_thread(comm);
  check_many_in_a_row(comm);
}

}  // namespace eplb::control::testing
