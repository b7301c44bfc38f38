#pragma once
// eplb's control plane on a collective library the engine already runs, written in Python (the
// engine's torch.distributed process group: eplb/_torch_group.py). A control::Communicator
// whose collectives call the Python object's methods:
//
//   barrier(seconds)                       -> None
//   all_reduce(values: list[int], op: str, seconds) -> list[int]   (op "min" | "max" | "sum")
//   broadcast(data: bytes, root: int, seconds) -> bytes
//   all_gather(data: bytes, seconds)       -> list[bytes]
//
// `seconds` is what is left of the collective's deadline. A method that raises eplb.Timeout
// becomes eplb::Timeout, anything else eplb::IoError carrying its message: the runtime then
// fails the rebalance on every rank, as with its own backends.
//
// Threads and the interpreter lock: the runtime calls a communicator from one thread at a time
// (its control thread once serving; the thread of connect() or reconfigure() at start-up), and
// that thread takes the GIL for the call only. Every binding that may wait on the control
// thread (connect, reconfigure, step_end, shutdown, destruction) releases the GIL first, so the
// control thread can always take it; the forward thread never waits on the control thread while
// holding it. During interpreter shutdown a collective fails with IoError instead of taking the
// GIL.

#include <pybind11/pybind11.h>

#include <chrono>
#include <string_view>

#include "eplb/control/communicator.h"

namespace eplb::python {

class PythonCommunicator final : public control::Communicator {
 public:
  // `collectives`: the Python object; rank and size as it reports them.
  PythonCommunicator(pybind11::object collectives, int rank, int size,
                     std::chrono::milliseconds timeout, std::string name);
  ~PythonCommunicator() override;

  std::string_view backend() const override { return name_; }

 protected:
  void do_barrier(control::Clock::time_point deadline) override;
  void do_all_reduce(std::span<std::int64_t> values, control::ReduceOp op,
                     control::Clock::time_point deadline) override;
  void do_broadcast(control::Bytes& data, int root, control::Clock::time_point deadline) override;
  std::vector<control::Bytes> do_all_gather(std::span<const std::byte> data,
                                            control::Clock::time_point deadline) override;

 private:
  template <typename F>
  auto call(const char* op, control::Clock::time_point deadline, F&& body);

  pybind11::object collectives_;  // released with the GIL held (destructor)
  std::string name_;
};

}  // namespace eplb::python
