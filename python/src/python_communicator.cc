#include "python_communicator.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <utility>

#include "eplb/core/error.h"

namespace eplb::python {
namespace py = pybind11;

namespace {

bool interpreter_alive() { return Py_IsInitialized() != 0 && _Py_IsFinalizing() == 0; }

py::bytes to_bytes(std::span<const std::byte> data) {
  return py::bytes(reinterpret_cast<const char*>(data.data()), data.size());
}

control::Bytes from_bytes(const py::handle& object, const char* op) {
  if (!py::isinstance<py::bytes>(object)) {
    throw IoError(detail::concat(op, " returned ", py::str(py::type::of(object)).cast<std::string>(),
                                 ", expected bytes"));
  }
  const std::string_view s = py::cast<std::string_view>(object);
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return control::Bytes(p, p + s.size());
}

}  // namespace

PythonCommunicator::PythonCommunicator(py::object collectives, int rank, int size,
                                       std::chrono::milliseconds timeout, std::string name)
    : control::Communicator(rank, size, timeout),
      collectives_(std::move(collectives)),
      name_(std::move(name)) {}

PythonCommunicator::~PythonCommunicator() {
  if (!interpreter_alive()) {
    (void)collectives_.release();  // no interpreter to hand it back to
    return;
  }
  py::gil_scoped_acquire gil;
  collectives_ = py::object();
}

template <typename F>
auto PythonCommunicator::call(const char* op, control::Clock::time_point deadline, F&& body) {
  if (!interpreter_alive()) {
    throw IoError(detail::concat(name_, " ", op, ": the Python interpreter is shutting down"));
  }
  py::gil_scoped_acquire gil;
  const double seconds = std::max(
      0.0, std::chrono::duration<double>(deadline - control::Clock::now()).count());
  try {
    return body(collectives_.attr(op), seconds);
  } catch (py::error_already_set& e) {
    const std::string message = e.what();
    const py::object eplb_timeout = py::module_::import("eplb").attr("Timeout");
    if (e.matches(eplb_timeout)) throw Timeout(message);
    throw IoError(message);
  } catch (py::cast_error& e) {
    throw IoError(detail::concat(name_, " ", op, " returned the wrong type: ", e.what()));
  }
}

void PythonCommunicator::do_barrier(control::Clock::time_point deadline) {
  call("barrier", deadline, [](const py::object& f, double seconds) { f(seconds); });
}

void PythonCommunicator::do_all_reduce(std::span<std::int64_t> values, control::ReduceOp op,
                                       control::Clock::time_point deadline) {
  call("all_reduce", deadline, [&](const py::object& f, double seconds) {
    const std::vector<int64_t> in(values.begin(), values.end());
    const auto out = f(in, std::string(control::to_string(op)), seconds).cast<std::vector<int64_t>>();
    if (out.size() != values.size()) {
      throw IoError(detail::concat(name_, " all_reduce returned ", out.size(), " values for ",
                                   values.size()));
    }
    std::copy(out.begin(), out.end(), values.begin());
  });
}

void PythonCommunicator::do_broadcast(control::Bytes& data, int root,
                                      control::Clock::time_point deadline) {
  call("broadcast", deadline, [&](const py::object& f, double seconds) {
    data = from_bytes(f(to_bytes(data), root, seconds), "broadcast");
  });
}

std::vector<control::Bytes> PythonCommunicator::do_all_gather(std::span<const std::byte> data,
                                                              control::Clock::time_point deadline) {
  return call("all_gather", deadline, [&](const py::object& f, double seconds) {
    const py::list parts = f(to_bytes(data), seconds);
    if (static_cast<int>(parts.size()) != size()) {
      throw IoError(detail::concat(name_, " all_gather returned ", parts.size(), " parts for ",
                                   size(), " ranks"));
    }
    std::vector<control::Bytes> out;
    out.reserve(parts.size());
    for (const py::handle part : parts) out.push_back(from_bytes(part, "all_gather"));
    return out;
  });
}

}  // namespace eplb::python
