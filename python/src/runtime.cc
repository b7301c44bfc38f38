// Bindings of the runtime: one Python object owning a rank's communicator, transport and
// Rebalancer (docs/runtime.md), with the weight arena exposed as numpy views without a copy.
//
// Ownership. The C++ Rebalancer keeps references to its communicator and transport, which must
// outlive it; here all three belong to one Runtime and are destroyed in the reverse order of
// their creation (rebalancer, then transport, then communicator). reconfigure() (docs/elastic.md)
// builds the new group's pair, hands it to the C++ reconfigure(), which copies eplb's memory out
// of the old transport, and only then lets the old pair go. The views returned by weights() and
// backup_weights() hold a reference to the Runtime object and to the transport whose memory they
// show, so neither the arena nor a transport retired by reconfigure() is freed under a view:
// an old view is stale, never dangling, even after shutdown().
//
// The GIL is released wherever a call may wait on other ranks: joining the group, connect(),
// reconfigure(), step_end(), shutdown() and destruction. Ranks that are threads of one process
// (inproc backends) then make progress while one of them waits.

#include <fmt/core.h>
#include <prometheus/metric_family.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "python_communicator.h"
#include "runtime_values.h"
#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/initial_placement.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/shareable.h"

namespace eplb::python {
namespace {

using IdArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using CountArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::array_t<int32_t> int32s(const std::vector<int32_t>& v, std::vector<py::ssize_t> shape) {
  py::array_t<int32_t> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// The weight spec of both constructors: (name, expert bytes) per tensor and, with the
// engine's own tensors, (address, stride) per [layers][tensors] (the Python object passed as
// `keep` holds them as long as the runtime).
runtime::WeightSpec weight_spec(const std::vector<std::pair<std::string, int64_t>>& tensors,
                                int64_t layers,
                                const std::vector<std::pair<uintptr_t, int64_t>>& engine) {
  runtime::WeightSpec spec;
  spec.layers = layers;
  for (const auto& [name, bytes] : tensors) spec.tensors.push_back({name, bytes});
  for (const auto& [address, stride] : engine) {
    spec.engine.push_back({.base = reinterpret_cast<void*>(address), .stride = stride});
  }
  return spec;
}

control::Options control_options(int rank, int size, const std::string& rendezvous,
                                 const std::string& group, std::chrono::milliseconds timeout) {
  control::Options options;
  options.rank = rank;
  options.size = size;
  options.rendezvous = rendezvous;
  options.group = group;
  options.timeout = timeout;
  return options;
}

// One rank of the runtime. Members are declared in the order they are built, so they are
// destroyed rebalancer first, communicator last.
class Runtime {
 public:
  // A member of the group from the start: joins the control group here.
  // `collectives` (None: eplb's own control plane `control`) is the engine's group
  // (python_communicator.h).
  Runtime(runtime::Config config, int rank, const std::string& control,
          const control::Options& options, const std::string& transport, runtime::WeightSpec spec,
          std::optional<Placement> initial, std::optional<std::string> initial_path,
          py::object keep, py::object collectives)
      : keep_(std::move(keep)),
        layout_(config.layout),
        dispatch_policy_(config.dispatch),
        random_state_(0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(rank) + 1)) {
    spec.validate();
    // Everything that can be checked alone is checked before joining the group, so a bad
    // argument raises here instead of leaving the other ranks waiting at the rendezvous.
    Placement start;
    if (initial) {
      start = std::move(*initial);
    } else if (initial_path) {
      start = runtime::placement_from_file(*initial_path, layout_);
    } else {
      start = trivial_placement(spec.layers, layout_.experts, layout_.physical);
    }
    if (start.layers != spec.layers) {
      fail("the initial placement has ", start.layers, " layers but layers is ", spec.layers);
    }
    check_transport_name(transport, rank);
    std::unique_ptr<control::Communicator> engines = engine_group(std::move(collectives), options);
    py::gil_scoped_release release;
    comm_ = engines ? std::move(engines) : control::connect(control, options);
    transport_ = transport::create(transport, transport::Options{.rank = rank});
    rebalancer_ = std::make_unique<runtime::Rebalancer>(std::move(config), *comm_, *transport_,
                                                        std::move(spec), std::move(start));
  }

  // A process that takes seat `seat` of a running group: no communicator and no transport
  // until reconfigure() brings it in.
  Runtime(runtime::Config config, int seat, runtime::WeightSpec spec, py::object keep)
      : keep_(std::move(keep)),
        layout_(config.layout),
        dispatch_policy_(config.dispatch),
        random_state_(0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(seat) + 1)),
        joining_(true) {
    spec.validate();
    rebalancer_ = std::make_unique<runtime::Rebalancer>(std::move(config), std::move(spec), seat);
  }

  ~Runtime() {
    // shutdown() may wait on the control thread's last collectives, which other ranks of this
    // process (threads) can only finish if they can run Python.
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      destroy();
    } else {
      destroy();
    }
  }

  runtime::Rebalancer& rb() { return *rebalancer_; }
  const Layout& layout() const { return layout_; }

  routing::DispatchPolicy dispatch_policy() const { return dispatch_policy_; }
  routing::AdaptiveShares& shares() { return shares_; }  // route()'s, reused between calls
  uint64_t& random_state() { return random_state_; }

  // Built to join and not brought in yet: the calls that need a group refuse with this message
  // (the C++ Rebalancer's own would speak of connect(), which a joining rank never calls).
  bool joining() const { return joining_; }
  void require_member(const char* what) const {
    if (joining_) {
      fail(what, ": this Rebalancer was built to join seat ", rebalancer_->rank(),
           " and is no member yet: call reconfigure() with a membership that lists seat ",
           rebalancer_->rank(), " first (on every member, at the same step)");
    }
  }

  // The order of calls an engine owes the runtime (build, connect(), serve, shutdown()), and the
  // layers, tensors and experts it names, checked here: the C++ Rebalancer checks them too, but
  // its messages are a C++ caller's, with the place of the check; a Python caller gets what was
  // wrong and what to call instead.
  void require_open(const char* what) const {
    if (shut_down_) {
      fail(what, ": this Rebalancer was shut down (shutdown() ends it for good; build a new one "
           "to serve again)");
    }
  }
  void require_connected(const char* what) const {
    require_member(what);
    require_open(what);
    if (!connected_) {
      fail(what, ": call connect() first, on every rank (it agrees on the placement and "
           "allocates the weights)");
    }
  }
  void check_layer(const char* what, int64_t layer) const {
    const int64_t layers = rebalancer_->weight_spec().layers;
    if (layer < 0 || layer >= layers) {
      fail(what, ": layer ", layer, " is outside [0, ", layers, ") (this Rebalancer's MoE "
           "layers)");
    }
  }
  void check_tensor(const char* what, int64_t tensor) const {
    const auto tensors = static_cast<int64_t>(rebalancer_->weight_spec().tensors.size());
    if (tensor < 0 || tensor >= tensors) {
      fail(what, ": tensor ", tensor, " is outside [0, ", tensors, ") (this Rebalancer's weight "
           "tensors per layer)");
    }
  }
  void connect_called() {
    require_open("connect()");
    if (connected_) {
      fail("connect(): already called on this rank; call it once, after building the "
           "Rebalancer, on every rank");
    }
  }
  void set_connected() { connected_ = true; }
  bool connected() const { return connected_; }
  void set_shut_down() { shut_down_ = true; }

  // Every transport whose memory the Rebalancer may show now: the one in force, and those a
  // failed reconfigure() left it with. A view holds them, so its memory outlives the group.
  std::vector<std::shared_ptr<transport::Transport>> transports() const {
    std::vector<std::shared_ptr<transport::Transport>> all = pending_transports_;
    if (transport_) all.push_back(transport_);
    return all;
  }

  // Onto the group of `seats` (docs/elastic.md): member options.rank of options.size.
  void reconfigure(const std::vector<int32_t>& seats, const std::string& control,
                   const control::Options& options, const std::string& transport,
                   py::object collectives) {
    require_open("reconfigure()");
    if (!connected_ && !joining_) {
      fail("reconfigure(): call connect() first (a process that takes a lost seat is built "
           "with Rebalancer.join() and enters through reconfigure())");
    }
    runtime::Membership membership{seats};
    // What can be checked alone is checked before joining, as in the constructor.
    membership.validate(layout_);
    const int32_t seat = seats[static_cast<size_t>(options.rank)];
    if (seat != rebalancer_->rank()) {
      fail("reconfigure: this rank holds seat ", rebalancer_->rank(), " but seats puts it (rank ",
           options.rank, " of the new group) in seat ", seat,
           ": a member keeps its seat, list it at its own position");
    }
    check_transport_name(transport, options.rank);
    std::unique_ptr<control::Communicator> comm = engine_group(std::move(collectives), options);
    py::gil_scoped_release release;
    if (!comm) comm = control::connect(control, options);
    std::shared_ptr<transport::Transport> next =
        transport::create(transport, transport::Options{.rank = options.rank});
    try {
      rebalancer_->reconfigure(*comm, *next, membership);
    } catch (...) {
      // The Rebalancer may have moved onto the new pair before it failed (its regions live in
      // the new transport once allocated): keep both pairs until a reconfigure() succeeds.
      pending_comms_.push_back(std::move(comm));
      pending_transports_.push_back(std::move(next));
      throw;
    }
    // The old pair is no longer used. Its transport's memory goes once no view holds it.
    std::unique_ptr<control::Communicator> old_comm = std::exchange(comm_, std::move(comm));
    transport_ = std::move(next);
    pending_transports_.clear();
    pending_comms_.clear();
    old_comm.reset();
    joining_ = false;
    connected_ = true;
  }

 private:
  // The engine's group as eplb's communicator, or null for eplb's own (None). Built with the GIL
  // held: it keeps a reference to the Python object.
  static std::unique_ptr<control::Communicator> engine_group(py::object collectives,
                                                             const control::Options& options) {
    if (collectives.is_none()) return nullptr;
    std::string name = py::hasattr(collectives, "backend")
                           ? collectives.attr("backend").cast<std::string>()
                           : std::string("python");
    return std::make_unique<PythonCommunicator>(std::move(collectives), options.rank,
                                                options.size, options.timeout, std::move(name));
  }

  static void check_transport_name(const std::string& transport, int rank) {
    if (!transport::has_backend(transport)) {
      // create() names the built backends.
      transport::create(transport, transport::Options{.rank = rank});
    }
  }

  void destroy() {
    rebalancer_.reset();
    pending_transports_.clear();
    transport_.reset();
    pending_comms_.clear();
    comm_.reset();
  }

  // The engine's own tensors (or None): declared first, so released last, after the
  // Rebalancer and its threads are gone; views of them keep this object, so it, alive.
  py::object keep_;
  const Layout layout_;
  const routing::DispatchPolicy dispatch_policy_;
  routing::AdaptiveShares shares_;
  uint64_t random_state_;
  bool joining_ = false;
  bool connected_ = false;  // connect() (or, joining, reconfigure()) succeeded
  bool shut_down_ = false;  // shutdown() was called
  std::unique_ptr<control::Communicator> comm_;
  std::vector<std::unique_ptr<control::Communicator>> pending_comms_;
  // Shared with the views of their memory (ViewOwner).
  std::shared_ptr<transport::Transport> transport_;
  std::vector<std::shared_ptr<transport::Transport>> pending_transports_;
  std::unique_ptr<runtime::Rebalancer> rebalancer_;
};

std::unique_ptr<Runtime> make_runtime(const py::dict& config, int rank, int world_size,
                                      const std::string& control, const std::string& rendezvous,
                                      const std::string& group, const std::string& transport,
                                      const std::vector<std::pair<std::string, int64_t>>& tensors,
                                      int64_t layers, const std::optional<IndexArray>& initial,
                                      const std::optional<std::string>& initial_path,
                                      const std::vector<std::pair<uintptr_t, int64_t>>& engine,
                                      py::object keep, py::object collectives) {
  if (world_size < 1) fail("world_size ", world_size, " must be at least 1");
  if (rank < 0 || rank >= world_size) {
    fail("rank ", rank, " is outside [0, ", world_size, ") (world_size ", world_size, ")");
  }
  runtime::Config c = to_config(config, world_size);
  runtime::WeightSpec spec = weight_spec(tensors, layers, engine);
  std::optional<Placement> start;
  if (initial) {
    if (initial->ndim() == 2 && initial->shape(1) != c.layout.physical) {
      fail("initial has ", initial->shape(1), " slots per layer but config['physical'] is ",
           c.layout.physical);
    }
    start = to_placement(*initial, c.layout.experts, "initial", true);
  }
  const control::Options options =
      control_options(rank, world_size, rendezvous, group, c.timeout);
  return std::make_unique<Runtime>(std::move(c), rank, control, options, transport,
                                   std::move(spec), std::move(start), initial_path,
                                   std::move(keep), std::move(collectives));
}

// The joining Runtime: `ranks` is the layout's (every seat, lost ones included).
std::unique_ptr<Runtime> make_joining(const py::dict& config, int seat, int ranks,
                                      const std::vector<std::pair<std::string, int64_t>>& tensors,
                                      int64_t layers,
                                      const std::vector<std::pair<uintptr_t, int64_t>>& engine,
                                      py::object keep) {
  if (ranks < 1) fail("world_size ", ranks, " must be at least 1");
  if (seat < 0 || seat >= ranks) {
    fail("joining seat ", seat, " is outside [0, ", ranks, ") (a seat of the layout's ",
         "world_size ", ranks, " ranks)");
  }
  runtime::Config c = to_config(config, ranks);
  return std::make_unique<Runtime>(std::move(c), seat, weight_spec(tensors, layers, engine),
                                   std::move(keep));
}

void reconfigure(Runtime& r, int rank, int world_size, const std::vector<int32_t>& seats,
                 const std::string& control, const std::string& rendezvous,
                 const std::string& group, const std::string& transport,
                 py::object collectives) {
  if (world_size < 1) fail("world_size ", world_size, " must be at least 1");
  if (rank < 0 || rank >= world_size) {
    fail("rank ", rank, " is outside [0, ", world_size, ") (world_size ", world_size, ")");
  }
  if (static_cast<int64_t>(seats.size()) != world_size) {
    fail("reconfigure: seats lists ", seats.size(), " seats but world_size is ", world_size,
         " (member g of the new group is its rank g, in seat seats[g])");
  }
  r.reconfigure(seats, control,
                control_options(rank, world_size, rendezvous, group, r.rb().config().timeout),
                transport, std::move(collectives));
}

// What a view of the Rebalancer's memory keeps alive: the Runtime (the arena's owner, and the
// engine's tensors) and the transports whose memory the view may show. The Runtime goes first
// (members are destroyed in reverse order): its Rebalancer is gone before a transport it used.
runtime::MapKind map_kind(const std::string& kind) {
  for (const auto k : {runtime::MapKind::kPhysicalToLogical, runtime::MapKind::kLogicalToPhysical,
                       runtime::MapKind::kReplicaCount, runtime::MapKind::kRankDispatch}) {
    if (runtime::map_kind_name(k) == kind) return k;
  }
  fail("unknown map kind '", kind, "'");
}

runtime::IntTensor int_tensor(uintptr_t address, const std::string& dtype,
                              const std::vector<int64_t>& shape,
                              const std::vector<int64_t>& strides, const std::string& name) {
  if (dtype != "int32" && dtype != "int64") {
    fail(name, " has dtype ", dtype, ": eplb reads and writes int32 or int64 tensors");
  }
  return runtime::IntTensor{.data = reinterpret_cast<void*>(address),
                            .type = dtype == "int32" ? runtime::IntTensor::Type::kInt32
                                                     : runtime::IntTensor::Type::kInt64,
                            .shape = shape,
                            .strides = strides};
}

struct ViewOwner {
  std::vector<std::shared_ptr<transport::Transport>> transports;
  py::object runtime;
};

py::capsule view_owner(py::object self) {
  auto* owner = new ViewOwner{self.cast<Runtime&>().transports(), std::move(self)};
  return py::capsule(owner, [](void* p) { delete static_cast<ViewOwner*>(p); });
}

// This rank's bytes of one tensor of `layer`, [slots_per_rank][expert_bytes] uint8, a view
// that keeps the arena alive.
py::array weights_view(py::object self, int64_t layer, int64_t tensor) {
  Runtime& r = self.cast<Runtime&>();
  r.require_member("weights()");
  if (!r.connected()) {
    fail("weights(): call connect() first, on every rank (it allocates the weights)");
  }
  r.check_layer("weights()", layer);
  r.check_tensor("weights()", tensor);
  std::span<std::byte> bytes = r.rb().weights(layer, tensor);
  const runtime::WeightSpec& spec = r.rb().weight_spec();
  const py::ssize_t slots = r.layout().slots_per_rank();
  const auto per_slot = static_cast<py::ssize_t>(spec.tensors[tensor].expert_bytes);
  // The engine's tensors may have a stride between slots; the arena's slots are contiguous.
  const auto stride =
      static_cast<py::ssize_t>(spec.engine_weights() ? spec.stride(layer, tensor) : per_slot);
  return py::array(py::dtype::of<uint8_t>(), {slots, per_slot}, {stride, py::ssize_t{1}},
                   bytes.data(), view_owner(std::move(self)));
}

// One expert's bytes of one tensor in this rank's backup share, uint8 [expert_bytes].
py::array bytes_view(py::object self, std::span<std::byte> bytes) {
  return py::array(py::dtype::of<uint8_t>(), {static_cast<py::ssize_t>(bytes.size())},
                   {py::ssize_t{1}}, bytes.data(), view_owner(std::move(self)));
}

py::dict dispatch_dict(Runtime& r, int64_t layer) {
  r.check_layer("dispatch()", layer);
  const routing::DispatchTables& t = r.rb().dispatch(layer);
  py::dict d;
  d["log2phy"] = int32s(t.log2phy, {t.experts, t.max_replicas});
  d["replica_count"] = int32s(t.replica_count, {t.experts});
  d["static_slot"] = int32s(t.static_slot, {t.ranks, t.experts});
  py::array_t<uint32_t> share(std::vector<py::ssize_t>{
      static_cast<py::ssize_t>(t.cumulative_share.size() / std::max<int64_t>(t.max_replicas, 1)),
      t.max_replicas});
  std::copy(t.cumulative_share.begin(), t.cumulative_share.end(), share.mutable_data());
  d["cumulative_share"] = share;
  return d;
}

// experts [tokens][top_k] (int32) -> slots of the same shape, with the config's dispatch policy.
py::array_t<int32_t> route(Runtime& r, int64_t layer, const IdArray& experts, uint64_t first_token,
                           const std::optional<CountArray>& global_counts,
                           const std::optional<CountArray>& prefix,
                           const std::optional<placement::CostModel>& cost) {
  if (experts.ndim() != 2) {
    fail("route: topk_ids must be a 2-D [tokens, top_k] array, got ", experts.ndim(),
         " dimensions");
  }
  if (experts.shape(1) < 1) {
    fail("route: topk_ids has shape (", experts.shape(0), ", 0): top_k must be at least 1");
  }
  r.check_layer("route()", layer);
  const routing::DispatchTables& tables = r.rb().dispatch(layer);
  const int32_t* ids = experts.data();
  const py::ssize_t n = experts.size();
  for (py::ssize_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= tables.experts) {
      fail("route: layer ", layer, " expert id ", ids[i], " at position ", i, " is outside [0, ",
           tables.experts, ")");
    }
  }
  py::array_t<int32_t> slots(std::vector<py::ssize_t>{experts.shape(0), experts.shape(1)});
  const routing::DispatchPolicy policy = r.dispatch_policy();
  if (cost && policy != routing::DispatchPolicy::kAdaptiveCost) {
    fail("route: cost= is for dispatch \"adaptive_cost\"; this runtime's dispatch is \"",
         routing::dispatch_policy_name(policy), "\"");
  }
  if (routing::routes_by_shares(policy)) {
    // The step's best split needs the step's global count of every expert and the tokens of
    // each expert on the lower ranks: an engine has both after its all-to-all layout exchange.
    if (!global_counts || !prefix) {
      fail("route: ", routing::dispatch_policy_name(policy),
           " dispatch needs global_counts= (this layer's count of every expert "
           "this step, summed over all ranks) and prefix= (each expert's tokens on the ranks "
           "below this one), both int64 arrays of ",
           tables.experts, " entries");
    }
    if (policy == routing::DispatchPolicy::kAdaptiveCost && !cost) {
      fail("route: adaptive_cost dispatch needs cost= (an eplb.cost.CostModel: a preset, "
           "fitted, or from a roofline), the same on every rank");
    }
    auto span_of = [&](const CountArray& a, const char* what) {
      if (a.ndim() != 1 || a.size() != tables.experts) {
        fail("route: ", what, " must be a 1-D array of ", tables.experts,
             " entries (one per logical expert), got ", a.ndim(), " dimensions of ", a.size(),
             " entries");
      }
      return std::span<const int64_t>(a.data(), static_cast<size_t>(a.size()));
    };
    if (cost) {
      cost->validate();
      routing::adaptive_cost_shares(tables, span_of(*global_counts, "global_counts"),
                                    routing::cost_ticks(*cost), r.shares());
    } else {
      routing::adaptive_shares(tables, span_of(*global_counts, "global_counts"), r.shares());
    }
    routing::route_adaptive(tables, r.shares(), span_of(*prefix, "prefix"),
                            {ids, static_cast<size_t>(n)}, experts.shape(1),
                            {slots.mutable_data(), static_cast<size_t>(n)});
    return slots;
  }
  routing::route(tables, policy, {ids, static_cast<size_t>(n)}, experts.shape(1),
                 {slots.mutable_data(), static_cast<size_t>(n)}, first_token, r.rb().rank(),
                 r.random_state());
  return slots;
}

}  // namespace

void bind_runtime(py::module_& m) {
  m.attr("NO_AGREEMENT") = runtime::kNoAgreement;
  // Shareable host memory (eplb.empty): a uint8 array whose base frees it when it goes.
  m.def(
      "shareable_array",
      [](int64_t bytes) {
        if (bytes < 1) fail("shareable memory of ", bytes, " bytes: the size must be positive");
        void* data = transport::allocate_shareable(static_cast<size_t>(bytes));
        py::capsule owner(data, [](void* p) { transport::free_shareable(p); });
        return py::array(py::dtype::of<uint8_t>(), {static_cast<py::ssize_t>(bytes)},
                         {py::ssize_t{1}}, static_cast<uint8_t*>(data), owner);
      },
      py::arg("bytes"), "bytes of zero-filled memory the ranks of this machine can map");
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_PHYSICAL") = kMaxPhysical;
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_LAYERS") = kMaxLayers;
  m.def("control_backends", &control::backend_names,
        "Names of the control-plane backends this build has.");
  m.def("transport_backends", &transport::backend_names,
        "Names of the transport backends this build has.");

  py::class_<Runtime>(m, "_Runtime")
      .def(py::init(&make_runtime), py::arg("config"), py::arg("rank"), py::arg("world_size"),
           py::arg("control"), py::arg("rendezvous"), py::arg("group"), py::arg("transport"),
           py::arg("tensors"), py::arg("layers"), py::arg("initial"), py::arg("initial_path"),
           py::arg("engine"), py::arg("keep"), py::arg("collectives") = py::none())
      .def_static("join", &make_joining, py::arg("config"), py::arg("seat"),
                  py::arg("ranks"), py::arg("tensors"), py::arg("layers"), py::arg("engine"),
                  py::arg("keep"))
      .def("connect",
           [](Runtime& r) {
             if (r.joining()) {
               fail("connect(): this Rebalancer was built to join seat ", r.rb().rank(),
                    " of a running group: it enters through reconfigure(), not connect()");
             }
             r.connect_called();
             runtime::Rebalancer& rb = r.rb();
             int64_t held = 0;
             {
               py::gil_scoped_release release;
               held = rb.connect();
             }
             r.set_connected();
             return held;
           })
      .def("record",
           [](Runtime& r, int64_t layer, const IdArray& ids) {
             r.check_layer("record()", layer);
             r.rb().record(layer, {ids.data(), static_cast<size_t>(ids.size())});
           })
      .def("record_counts",
           [](Runtime& r, int64_t layer, const CountArray& counts) {
             if (counts.ndim() != 1) {
               fail("record_counts: counts must be a 1-D [experts] array, got ", counts.ndim(),
                    " dimensions");
             }
             r.check_layer("record_counts()", layer);
             r.rb().record_counts(layer, {counts.data(), static_cast<size_t>(counts.size())});
           })
      .def("dispatch", &dispatch_dict)
      .def("route", &route, py::arg("layer"), py::arg("topk_ids"), py::arg("first_token") = 0,
           py::kw_only(), py::arg("global_counts") = std::nullopt, py::arg("prefix") = std::nullopt,
           py::arg("cost") = std::nullopt,
           "Slots for topk_ids [tokens, top_k] under the config's dispatch; adaptive and "
           "adaptive_cost also take the step's global_counts and this rank's prefix (int64 "
           "[experts] each), adaptive_cost also the cost model")
      .def("weights", &weights_view)
      .def("phy2log",
           [](Runtime& r, int64_t layer) {
             r.check_layer("phy2log()", layer);
             std::span<const int32_t> p = r.rb().phy2log(layer);
             return py::array_t<int32_t>(static_cast<py::ssize_t>(p.size()), p.data());
           })
      .def("placement",
           [](Runtime& r) {
             const Placement p = r.rb().placement();
             return int32s(p.phy2log, {p.layers, p.physical});
           })
      .def("step_end",
           [](Runtime& r) {
             r.require_connected("step_end()");
             runtime::Rebalancer& rb = r.rb();
             py::gil_scoped_release release;
             rb.step_end();
           })
      .def("set_cost_model",
           [](Runtime& r, const placement::CostModel& model) { r.rb().set_cost_model(model); },
           py::arg("model"))
      .def("save_stats",
           [](Runtime& r, const std::string& path, const std::string& format) {
             r.rb().save_stats(path, stats::parse_load_format(format, "save_stats: format"));
           })
      .def("shutdown",
           [](Runtime& r) {
             runtime::Rebalancer& rb = r.rb();
             {
               py::gil_scoped_release release;
               rb.shutdown();
             }
             r.set_shut_down();
           })
      .def("host_bytes",
           [](Runtime& r) {
             r.require_member("host_bytes()");
             if (!r.connected()) {
               fail("host_bytes(): call connect() first (it allocates what is counted)");
             }
             return r.rb().host_bytes();
           },
           "The host memory eplb holds on this rank, in bytes: arena or staging (unless in device "
           "memory), load window, placement and dispatch tables; not the engine's weights.")
      .def("agreement_contribution", [](Runtime& r) { return r.rb().agreement_contribution(); })
      .def("agreement_result", [](Runtime& r, int64_t step,
                                  int64_t min_value) { r.rb().agreement_result(step, min_value); })
      .def("history",
           [](Runtime& r) {
             py::list out;
             for (const runtime::RebalanceRecord& rec : r.rb().history()) {
               out.append(record_dict(rec));
             }
             return out;
           })
      .def("state",
           [](Runtime& r) {
             runtime::Rebalancer& rb = r.rb();
             py::dict d;
             d["rank"] = rb.rank();
             d["step"] = rb.step();
             d["rebalancing"] = rb.rebalancing();
             d["installed_layers"] = rb.installed_layers();
             d["control_broken"] = rb.control_broken();
             d["bytes_held"] = rb.bytes_held();
             return d;
           })
      .def("metrics_text", [](Runtime& r) { return r.rb().metrics_text(); })
      .def("metric_families",
           [](Runtime& r) {
             const std::vector<prometheus::MetricFamily> families = r.rb().collect_metrics();
             return metric_families_list(families);
           })
      .def("reconfigure", &reconfigure, py::arg("rank"), py::arg("world_size"),
           py::arg("seats"), py::arg("control"), py::arg("rendezvous"), py::arg("group"),
           py::arg("transport"), py::arg("collectives") = py::none())
      // The engine's seams (engine_maps.h), from tensors the Python side has checked to be in
      // host memory: (kind, name, address, dtype, shape, strides in elements) each.
      .def("bind_maps",
           [](Runtime& r, const std::vector<std::tuple<std::string, std::string, uintptr_t,
                                                       std::string, std::vector<int64_t>,
                                                       std::vector<int64_t>>>& maps) {
             std::vector<runtime::MapBinding> bindings;
             for (const auto& [kind, name, address, dtype, shape, strides] : maps) {
               bindings.push_back({map_kind(kind), int_tensor(address, dtype, shape, strides, name),
                                   name});
             }
             r.rb().bind_maps(std::move(bindings));
           })
      .def("record_pass",
           [](Runtime& r, uintptr_t address, const std::string& dtype,
              const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
              const std::string& of) {
             r.require_member("record_pass()");
             r.rb().record_pass(int_tensor(address, dtype, shape, strides, "counts"),
                                of == "slots" ? runtime::CountsOf::kSlots
                                              : runtime::CountsOf::kExperts);
           })
      // A placement computed elsewhere: phy2log [layers][width] (int64; the width the layout's
      // or the members'), or a placement file (eplb's JSON, SGLang's physical_to_logical_map).
      .def("propose",
           [](Runtime& r, const IndexArray& phy2log) {
             r.require_member("propose()");
             if (phy2log.ndim() != 2) {
               fail("propose: the placement must be a 2-D [layers, physical] phy2log, got ",
                    phy2log.ndim(), " dimensions");
             }
             const int64_t layers = phy2log.shape(0), width = phy2log.shape(1);
             Placement p(layers, r.layout().experts, width);
             const int64_t* v = phy2log.data();
             for (int64_t i = 0; i < layers * width; ++i) {
               if (v[i] < 0 || v[i] >= r.layout().experts) {
                 fail("propose: layer ", i / width, " slot ", i % width, " holds expert ", v[i],
                      ", outside [0, ", r.layout().experts, ") (the layout's experts)");
               }
               p.phy2log[static_cast<size_t>(i)] = static_cast<int32_t>(v[i]);
             }
             r.rb().propose(p);
           })
      .def("propose_file",
           [](Runtime& r, const std::string& path) {
             r.require_member("propose()");
             r.rb().propose(runtime::placement_from_file(path, r.layout()));
           })
      .def("members", [](Runtime& r) { return r.rb().members(); })
      .def("unavailable",
           [](Runtime& r, int64_t layer) {
             r.check_layer("unavailable()", layer);
             const std::vector<int32_t> experts = r.rb().unavailable(layer);
             return int32s(experts, {static_cast<py::ssize_t>(experts.size())});
           })
      .def("any_unavailable", [](Runtime& r) { return r.rb().any_unavailable(); })
      .def("backup_experts",
           [](Runtime& r) {
             const std::vector<int32_t> experts = r.rb().backup_experts();
             return int32s(experts, {static_cast<py::ssize_t>(experts.size())});
           })
      .def("backup_bytes", [](Runtime& r) { return r.rb().backup_bytes(); })
      .def("backup_weights",
           [](py::object self, int64_t layer, int64_t tensor, int32_t expert) {
             Runtime& r = self.cast<Runtime&>();
             r.require_member("backup_weights()");
             if (r.rb().backup_bytes() == 0) {
               fail("backup_weights(): this rank keeps no backup copy (the config's backup "
                    "copies are 0, or connect() has not run yet)");
             }
             r.check_layer("backup_weights()", layer);
             r.check_tensor("backup_weights()", tensor);
             return bytes_view(std::move(self), r.rb().backup_weights(layer, tensor, expert));
           })
      // fill(layer, tensor index, expert, uint8 view) for each expert of this rank's share, on
      // this thread with the GIL held; an exception it raises propagates and leaves the share
      // unfilled (not a restore source).
      .def("fill_backup",
           [](py::object self, const py::function& fill) {
             Runtime& r = self.cast<Runtime&>();
             r.require_member("fill_backup()");
             r.rb().fill_backup([&](int64_t layer, int64_t tensor, int32_t expert,
                                    std::span<std::byte> bytes) {
               fill(layer, tensor, expert, bytes_view(self, bytes));
             });
           })
      .def("joining", &Runtime::joining)
      .def("config", [](Runtime& r) { return config_dict(r.rb().config()); })
      .def("rank", [](Runtime& r) { return r.rb().rank(); })
      .def("step", [](Runtime& r) { return r.rb().step(); })
      .def("installed_layers", [](Runtime& r) { return r.rb().installed_layers(); });
}

}  // namespace eplb::python
