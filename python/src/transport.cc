// Bindings of the transport layer (include/eplb/transport/transport.h) for data planes written
// in Python: eplb.integrations.vllm_communicator reads vLLM's live expert weights with it.
//
// `_Transport` owns one Transport of this rank. It serves reads from memory the caller
// registers by address (a tensor's data_ptr()): the caller keeps that memory alive and mapped
// until close() (the communicator holds the tensors). A batch never outlives the call that
// posts it: read() posts, waits and, on a timeout or an error, destroys the batch before it
// returns, so nothing is written to a destination after read() has returned.
//
// Threads: one thread at a time per object, as the Transport contract says; the GIL is released
// while reads run, so other Python threads (the engine's forward thread) keep going.
//
// Flags peers poll (a rank's progress in a protocol built on reads): allocate() gives memory the
// transport owns and peers read; store_release() writes a 64-bit word of it after everything
// the rank wrote or read before, and read() ends with an acquire fence, so a peer that reads
// the word and then the data behind it sees that data.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"

namespace eplb::python {
namespace {

using ReadArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;  // [n][5]

class PyTransport {
 public:
  PyTransport(const std::string& backend, int rank, const std::string& node) {
    if (rank < 0) fail("transport rank ", rank, " must be at least 0");
    transport_ = transport::create(backend, transport::Options{.rank = rank, .node = node});
  }

  std::string backend() const { return std::string(get().backend()); }
  int rank() const { return get().rank(); }

  py::dict capabilities() const {
    const transport::Capabilities c = get().capabilities();
    py::dict out;
    out["device_memory"] = c.device_memory;
    out["one_sided"] = c.one_sided;
    out["register_memory"] = c.register_memory;
    out["cross_node"] = c.cross_node;
    return out;
  }

  // A region of `bytes` zero-filled bytes the transport owns (until close()): (id, address).
  py::tuple allocate(int64_t bytes) {
    if (bytes < 1) fail("allocate: ", bytes, " bytes; a region must hold at least one");
    const transport::Region r = get().allocate(static_cast<size_t>(bytes));
    return py::make_tuple(r.id, reinterpret_cast<uintptr_t>(r.data));
  }

  // Registers [address, address + bytes) and returns its region id (in order of creation).
  int register_memory(uintptr_t address, int64_t bytes) {
    if (address == 0) fail("register_memory: a null address");
    if (bytes < 1) fail("register_memory: ", bytes, " bytes; a region must hold at least one");
    return get().register_memory(reinterpret_cast<void*>(address), static_cast<size_t>(bytes)).id;
  }

  py::bytes export_descriptor() const {
    const std::vector<std::byte> d = get().export_descriptor();
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  }

  void import_descriptor(int peer, const py::bytes& descriptor) {
    const auto s = py::cast<std::string_view>(descriptor);
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    std::span<const std::byte> span(p, s.size());
    py::gil_scoped_release release;  // UCX connects to the peer here
    get().import_descriptor(peer, span);
  }

  bool one_sided_to(int peer) const { return get().one_sided_to(peer); }

  // reads: [n][5] rows (peer, region, offset, destination address, bytes). Posts them as one
  // batch and waits up to `seconds`. Raises what the batch raises (IoError naming the peer,
  // Timeout, InvalidArgument for a bad read); the batch is gone when this returns.
  void read(const ReadArray& reads, double seconds) {
    if (reads.ndim() != 2 || reads.shape(1) != 5) {
      fail("read: reads must be an [n, 5] array (peer, region, offset, address, bytes)");
    }
    if (!(seconds >= 0) || !std::isfinite(seconds)) {
      fail("read: timeout ", seconds, " s must be a finite number of seconds, at least 0");
    }
    const int64_t n = reads.shape(0);
    std::vector<transport::Read> batch(static_cast<size_t>(n));
    const int64_t* r = reads.data();
    for (int64_t i = 0; i < n; ++i, r += 5) {
      if (r[2] < 0 || r[4] < 0) fail("read ", i, ": offset ", r[2], " and bytes ", r[4],
                                     " must be at least 0");
      batch[static_cast<size_t>(i)] = transport::Read{
          .peer = static_cast<int>(r[0]),
          .region = static_cast<int>(r[1]),
          .offset = static_cast<uint64_t>(r[2]),
          .dst = reinterpret_cast<void*>(static_cast<uintptr_t>(r[3])),
          .bytes = static_cast<size_t>(r[4])};
    }
    // A wait of more than a year is a wait without end: clamped, so the milliseconds fit.
    const double ms = std::ceil(std::min(seconds, 365.0 * 24 * 3600) * 1000);
    py::gil_scoped_release release;
    std::unique_ptr<transport::Batch> posted = get().post(batch);
    posted->wait(std::chrono::milliseconds(static_cast<int64_t>(ms)));
    std::atomic_thread_fence(std::memory_order_acquire);
  }

  void close() {
    if (transport_) {
      py::gil_scoped_release release;
      transport_->close();
    }
  }

 private:
  transport::Transport& get() const {
    if (!transport_) fail<IoError>("the transport is closed");
    return *transport_;
  }

  std::unique_ptr<transport::Transport> transport_;
};

// A 64-bit word at `address` (8-byte aligned), written with release order.
void store_release(uintptr_t address, uint64_t value) {
  if (address == 0 || address % alignof(uint64_t) != 0) {
    fail("store_release: address ", address, " is not an aligned 64-bit word");
  }
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(address))
      .store(value, std::memory_order_release);
}

}  // namespace

void bind_transport(py::module_& m) {
  m.def("_store_release", &store_release, py::arg("address"), py::arg("value"),
        "Writes a 64-bit word of memory peers read, after everything written before it.");
  py::class_<PyTransport>(m, "_Transport")
      .def(py::init<const std::string&, int, const std::string&>(), py::arg("backend"),
           py::arg("rank"), py::arg("node") = std::string())
      .def_property_readonly("backend", &PyTransport::backend)
      .def_property_readonly("rank", &PyTransport::rank)
      .def("capabilities", &PyTransport::capabilities)
      .def("allocate", &PyTransport::allocate, py::arg("bytes"))
      .def("register_memory", &PyTransport::register_memory, py::arg("address"),
           py::arg("bytes"))
      .def("export_descriptor", &PyTransport::export_descriptor)
      .def("import_descriptor", &PyTransport::import_descriptor, py::arg("peer"),
           py::arg("descriptor"))
      .def("one_sided_to", &PyTransport::one_sided_to, py::arg("peer"))
      .def("read", &PyTransport::read, py::arg("reads"), py::arg("seconds"))
      .def("close", &PyTransport::close);
}

}  // namespace eplb::python
