"""The runtime for Python engines: ``eplb.Rebalancer``.

One ``Rebalancer`` per rank records expert loads, serves the dispatch tables, owns the expert
weights (the arena, handed to the engine as numpy arrays or torch tensors without a copy) and
rebalances the experts while the engine keeps serving (docs/runtime.md).

    rb = eplb.Rebalancer({"experts": 64, "physical": 72, "interval": 100, "window": 100},
                         rank, world_size, control="gloo", rendezvous=shared_folder,
                         transport="shm", layers=L,
                         weights={"gate_up": ((2 * I, H), "float32"), "down": ((H, I), "float32")})
    rb.connect()                                   # all memory, all peers, before the KV cache
    rb.fill_weights(lambda layer, tensor, expert: load(layer, tensor, expert))
    while serving:                                 # the forward thread
        for layer in range(L):
            w13 = rb.weights(layer, "gate_up", as_torch=True)   # [slots_per_rank, 2I, H]
            rb.record(layer, topk_ids)
            slots = rb.route(layer, topk_ids, first_token)     # or rb.dispatch(layer)
            ...
        rb.step_end()                              # every rank, once per forward pass
    rb.shutdown()                                  # every rank, at the same step

WEIGHT VIEWS ARE VALID ONLY UNTIL THE NEXT ``step_end()``. A rebalance installs a layer by
swapping its buffer with the staging buffer, so after ``step_end()`` a view fetched before may
show a buffer that is being overwritten with another layer's next placement. Fetch the views of
a layer again after every ``step_end()`` (it costs a few microseconds), or at least whenever
``installed_layers`` changed. The same holds for ``dispatch()`` and ``phy2log()`` (they are
copies, so they stay readable, but describe the old placement).

External agreement (config "agreement": "external": the engine carries the per-step agreement
on its own collective, see agreement_contribution()) and elastic serving (reconfigure(),
Rebalancer.join(), fill_backup()) are in python/README.md, docs/runtime.md and docs/elastic.md.

Threads: record*, dispatch, route, weights, phy2log, step_end and reconfigure belong to one
thread (the engine's forward thread). The GIL is released while connect(), reconfigure(),
step_end() and shutdown() run, and while the constructor joins the control group.
"""

import math
import operator
import os

import numpy as np

from . import _eplb
from . import _as_int, MAX_LAYERS, MAX_RANKS

InvalidArgument = _eplb.InvalidArgument

from ._reports import _Reports  # noqa: E402
from ._seams import _MAP_KINDS, _control_group, _host_ints  # noqa: E402
from ._weights import (  # noqa: E402
    _torch,
    _is_torch_tensor,
    _is_torch_dtype,
    _itemsize,
    _engine_tensor,
    _parse_weights,
    _rendezvous,
    _store,
    _ids,
    _to_torch,
    _torch_dtype,
)


class Rebalancer(_Reports):
    """One rank of eplb's runtime (C++ ``eplb::runtime::Rebalancer``).

    Parameters:
        config: a dict; any other key is refused (eplb.InvalidArgument listing these). Mostly
            the C++ Config's field names (docs/runtime.md, "Config", has every default); the
            keys that differ say which field they set:
              ``experts``, ``physical`` (required), ``ranks`` (default world_size), ``nodes``,
                ``groups``: the layout;
              ``interval``, ``window``: when to rebalance, on how many steps of load;
              ``policy`` ("sticky", "balanced", "deepseek"), ``hierarchical``, ``tolerance``,
                ``thorough`` (balanced / sticky at two slots per rank: see
                eplb.rebalance_experts): Config::placement;
              ``min_gain`` (a rebalance only when the MoE time it is predicted to save over
                the next interval reaches min_gain times its price; 0, the default,
                rebalances at every trigger: see set_cost_model() and
                eplb.should_rebalance), ``cost`` (the eplb.cost.CostModel min_gain predicts
                with; default the "tokens" preset), ``min_balancedness_gain`` (skip a
                placement whose predicted balancedness gains less than this, in [-1, 1];
                default 0), ``lag``, ``peers_per_round``;
              ``timeout_ms``: Config::timeout, in milliseconds;
              ``mode`` ("async", "sync"); ``agreement`` ("internal", or "external": see
                agreement_result());
              ``install`` ("swap"; "copy" keeps weights() at fixed addresses, at the cost of
                one layer copy per installed layer);
              ``dispatch``: what route() does, "static", "random", "hash", "weighted",
                "split", "adaptive" or "adaptive_cost" (the last two take each step's
                global_counts and prefix in route(); adaptive_cost also an
                eplb.cost.CostModel, cost=);
              ``on_error`` ("log", "raise");
              ``stall_warn_ms``: Config::stall_warn, in milliseconds (the watchdog; 0: off);
              ``balancedness_period`` (steps between measurements of the recorded window's
                balancedness; 0: every interval, -1: never);
              ``backup_copies``: Config::backup.copies, host copies of every expert kept
                across the ranks for elastic serving (see fill_backup()); the loader is C++
                only;
              ``metric_labels``: a dict of label name -> value added to every metric.
            The config property returns the same keys, every one filled in.
        rank, world_size: this rank and the number of ranks (taken from `group` when that is
            the engine's process group; given too, they must be the group's).
        control: control-plane backend, "shm" (processes of one machine), "gloo" (TCP; the
            rendezvous is a shared folder or redis://host:port), "inproc" (ranks are threads of
            this process), "mpi" where built; eplb.control_backends() lists them.
        rendezvous: where the ranks meet: a name (inproc, shm), a folder or redis:// (gloo).
            Required with more than one rank.
        transport: weight transport, "shm", "ucx", "hybrid" (shm within a node, UCX across) or
            "inproc"; eplb.transport_backends().
        weights: the tensors of one layer's expert, as a list of (name, spec) or a dict
            name -> spec, where spec is either
              - the engine's own tensors: a list with one tensor per layer (PyTorch CPU tensors
                or numpy arrays) of shape [slots_per_rank, ...], each slot contiguous. eplb
                registers them, reads peers' in place, and installs into them the slots whose
                expert changes; weights(layer, name) is that very tensor for the whole run
                (the same data_ptr()), and eplb allocates only one staging layer;
              - or, for an arena eplb allocates: the bytes of one expert (an int: views default
                to uint8 [slots_per_rank, bytes]) or (shape, dtype) (views default to
                dtype [slots_per_rank, *shape]; dtype may be a numpy or a torch dtype).
        layers: number of MoE layers (may be left out when `initial` is an array).
        initial: the starting placement: None or "trivial" (slot p holds expert p % experts),
            a placement file (eplb's JSON or SGLang's physical_to_logical_map), or a
            [layers, physical] phy2log array.
        group: the engine's torch.distributed process group (gloo, on the CPU), which then
            carries every collective eplb runs: start-up, the window all-reduce, the per-step
            agreement, barriers; no rendezvous, no second mesh. Dedicate it to eplb (vLLM's
            get_eplb_group().cpu_group is one): eplb issues its collectives from its own control
            thread, and collectives of one group must run in the same order on every rank. A
            collective that fails or times out on it fails the rebalance on every rank
            (eplb/_torch_group.py). Or a string: the name that separates several of eplb's own
            groups meeting through one rendezvous.

    The constructor joins the control group: it returns once every rank has constructed its
    Rebalancer (or raises eplb.Timeout after timeout_ms). Bad arguments raise
    eplb.InvalidArgument (a ValueError) with the library's message, before joining.

    The object owns the communicator, the transport and the C++ Rebalancer; the arena lives as
    long as the object or any view of it. Use it as a context manager to shut down on exit.

    Elastic serving (docs/elastic.md): reconfigure() moves the ranks that are left onto a new
    group after one is lost (or takes one back), repairing the lost slots from the backup
    copies; join() builds the Rebalancer of a process that takes a lost seat. ``rank`` is this
    process's seat in the layout for life, ``world_size`` the layout's ranks (every seat);
    members() lists the seats that serve now.
    """

    _maps = ()  # the engine's bound map tensors (and the bindings), kept alive while bound
    _collectives = None  # the engine's process group as eplb's control plane (group=)

    def __init__(self, config, rank=None, world_size=None, *, control="shm", rendezvous=None,
                 transport="shm", weights, layers=None, initial=None, group="eplb"):
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        collectives, group, rank, world_size = _control_group(group, control, rendezvous, rank,
                                                             world_size)
        tensors, owned = _parse_weights(weights)

        initial_array, initial_path = None, None
        if initial is None or (isinstance(initial, str) and initial == "trivial"):
            pass
        elif isinstance(initial, (str, os.PathLike)):
            initial_path = os.fspath(initial)
        else:
            if _is_torch_tensor(initial):
                initial = initial.detach().cpu().numpy()
            a = np.asarray(initial)
            if a.dtype.kind not in "iu" or a.ndim != 2:
                raise InvalidArgument(
                    "initial must be None, 'trivial', a placement file or an integer "
                    f"[layers, physical] phy2log array, got dtype {a.dtype} shape {a.shape}")
            initial_array = np.ascontiguousarray(a, dtype=np.int64)
            if layers is None:
                layers = a.shape[0]
        layers, engine = self._set_weights(config, world_size, tensors, owned, layers,
                                           "unless initial is a phy2log array or the weights "
                                           "are the engine's")
        self._collectives = collectives
        rendezvous = "" if collectives is not None else _rendezvous(rendezvous, world_size)
        self._rt = _eplb._Runtime(dict(config), rank, world_size, str(control), rendezvous,
                                  str(group), str(transport), [(t[0], t[1]) for t in tensors],
                                  layers, initial_array, initial_path, engine,
                                  self._engine, collectives)
        self._config = self._rt.config()
        self._slots_per_rank = self._config["physical"] // world_size
        self._connected = False

    @classmethod
    def join(cls, config, seat, world_size=None, *, weights, layers=None):
        """A Rebalancer for a process that takes seat `seat` of a running group (a restarted
        rank, or a new one for a lost seat; docs/elastic.md, "Grow").

        It has no communicator, no transport and no weights yet: bring it in with
        ``reconfigure(rank, world_size, seats, ...)``, called at the same step by every member
        of the new group (whose `seats` list `seat`), instead of connect(). It then adopts the
        group's step and placement; its slots receive tokens once the repair rebalance that
        follows has installed them. Until reconfigure() returns, connect(), step_end(),
        weights(), host_bytes(), backup_weights() and fill_backup() raise eplb.InvalidArgument;
        after it, fill this rank's backup share (fill_backup()) before serving.

        `config` and `weights` as for the constructor, the same as on every member; `world_size`
        is the layout's ranks (every seat, lost ones included: the world_size the group started
        with), by default config["ranks"]. Nothing here waits on other ranks.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        if world_size is None:
            if "ranks" not in config:
                raise InvalidArgument(
                    "join: give world_size (the layout's ranks: every seat, lost ones included) "
                    "or config['ranks']")
            world_size = config["ranks"]
        world_size = _as_int(world_size, "world_size", 1, MAX_RANKS)
        seat = _as_int(seat, "seat", -2**31, 2**31 - 1)  # the library checks the layout's range
        tensors, owned = _parse_weights(weights)
        self = cls.__new__(cls)
        layers, engine = self._set_weights(config, world_size, tensors, owned, layers,
                                           "unless the weights are the engine's")
        self._rt = _eplb._Runtime.join(dict(config), seat, world_size,
                                       [(t[0], t[1]) for t in tensors], layers, engine,
                                       self._engine)
        self._config = self._rt.config()
        self._slots_per_rank = self._config["physical"] // world_size
        self._connected = False
        return self

    def _set_weights(self, config, world_size, tensors, owned, layers, layers_hint):
        """Sizes the engine's tensors (if any) and sets the attributes both constructors share;
        returns (layers, [(address, stride)] of the engine's tensors, [layers][tensors])."""
        if layers is None and owned:
            layers = len(owned[0][1])
        if layers is None:
            raise InvalidArgument(f"layers is required (the number of MoE layers) {layers_hint}")
        layers = _as_int(layers, "layers", 1, MAX_LAYERS)
        engine = []
        self._engine = None
        if owned:
            physical = config.get("physical")
            if not isinstance(physical, (int, np.integer)) or physical < 1 or physical % world_size:
                raise InvalidArgument(
                    f"config['physical'] {physical!r} must be a positive multiple of world_size "
                    f"{world_size} (each rank holds physical // world_size slots)")
            slots = int(physical) // world_size
            per_layer = {}
            for index, (name, per) in enumerate(owned):
                if len(per) != layers:
                    raise InvalidArgument(f"weights: tensor '{name}' has {len(per)} layers of "
                                          f"tensors, expected {layers}")
                first = None
                for layer, t in enumerate(per):
                    address, stride, shape, dtype, nbytes = _engine_tensor(name, layer, t, slots)
                    if first is None:
                        first = (shape, dtype)
                    elif (shape, dtype) != first:
                        raise InvalidArgument(
                            f"weights: tensor '{name}' of layer {layer} is {shape} {dtype}, "
                            f"layer 0's is {first[0]} {first[1]}: every layer must be alike")
                    per_layer[(layer, index)] = (address, stride)
                tensors[index] = (name, nbytes, first[0], first[1])
            engine = [per_layer[(layer, index)] for layer in range(layers)
                      for index in range(len(owned))]
            # [tensors][layers]; the runtime keeps them too, until after its threads are gone.
            self._engine = [per for _, per in owned]
        self._tensors = tensors
        self._index = {t[0]: i for i, t in enumerate(tensors)}
        self._world_size = world_size
        self._layers = layers
        return layers, engine

    # ------------------------------------------------------------------ start-up
    def connect(self):
        """Start-up, on every rank together: allocates the arena (layers + 1 layer buffers,
        zero-filled) and this rank's backup share (config "backup_copies"), connects to every
        peer and reads from each once, starts the runtime's threads. Returns the bytes held
        (arena or staging); nothing more is allocated or connected until a reconfigure().
        A Rebalancer from join() never calls it: reconfigure() brings it in."""
        held = self._rt.connect()
        self._connected = True
        return held

    def fill_weights(self, fill):
        """Fills this rank's slots of every layer and tensor: ``fill(layer, tensor_name,
        expert)`` returns the weights of `expert` (array-like or torch tensor of the tensor's
        shape and dtype, or its bytes), copied into the slot."""
        for layer in range(self._layers):
            experts = self.local_experts(layer)
            for name, _, _, _ in self._tensors:
                view = self.weights(layer, name)
                raw = self._rt.weights(layer, self._index[name])
                for j, expert in enumerate(experts):
                    _store(view[j], raw[j], fill(layer, name, int(expert)))

    # ------------------------------------------------------------------ elastic serving
    def reconfigure(self, rank=None, world_size=None, seats=None, *, members=None,
                    control="shm", rendezvous=None, transport="shm", group="eplb"):
        """Moves this rank onto a new group (docs/elastic.md): after a rank was lost, or to take
        one back. Every member of the new group calls it at the same step (between two
        step_end() calls, on the forward thread). `members` (or `seats`, the same list) gives
        the seat (rank of the layout, what ``self.rank`` is) of each member of the new group, by
        its rank in that group, the same list on every member. A member keeps its seat; a seat
        left out is lost: nothing is placed on it or routed to it until a member takes it back.
        A Rebalancer from join() enters the group here.

        The group is the engine's or eplb's own, as for the constructor:

        - ``reconfigure(group=new_group, members=seats)``: the group the engine built after the
          failure (a torch.distributed gloo ProcessGroup, in the world map or not, such as the
          stateless groups vLLM's elastic EP builds; vLLM's StatelessProcessGroup; an object
          with eplb's collectives). This rank's rank and the size are the group's; a group
          whose size is not len(members), or whose rank here is not this seat's position in
          members, is refused before anything runs on it.
        - ``reconfigure(rank, world_size, members, control=..., rendezvous=...)``: eplb joins a
          new control group itself (the rendezvous must be new to this group, e.g. named after
          the membership's epoch).

        Either way it builds a new transport (`transport`), abandons a rebalance in flight
        (recorded as failed) and a proposal not yet started, moves eplb's memory into the new
        transport, and rebuilds every layer's tables over the usable slots only:
        unavailable(layer) lists the experts left with no replica (routed to -1). The next
        step_end() starts a repair rebalance (history(): "repair"). The bound maps are written
        again; an engine whose map views change width with the group (vLLM re-slices its
        physical_to_logical_map to the members' slots) binds the new views with bind_maps()
        right after. The old communicator and transport are released once it returns; views of
        the arena (weights(), backup_weights()) taken before must be taken again (old ones stay
        readable, but stale). The GIL is released while it waits for the group.

        Raises eplb.InvalidArgument for a bad membership (a seat twice or outside the layout,
        this rank's seat not at its position, a group that contradicts it) before joining
        anything, and the library's error when the members disagree (steps, configuration) or
        a collective fails (then call it again with the next group)."""
        if members is not None and seats is not None:
            raise InvalidArgument("reconfigure: give members or seats (the same list), not both")
        seats = members if members is not None else seats
        if seats is None:
            raise InvalidArgument("reconfigure needs members: the seat of each member of the new "
                                  "group, by its rank in that group")
        if _is_torch_tensor(seats):
            seats = seats.detach().cpu().numpy()
        try:
            seats = [_as_int(s, "seat", -2**31, 2**31 - 1) for s in seats]
        except TypeError:
            raise InvalidArgument(f"members must be a list of integer seats, got "
                                  f"{seats!r}") from None
        collectives, group, rank, world_size = _control_group(group, control, rendezvous, rank,
                                                             world_size)
        if collectives is not None and len(seats) != world_size:
            raise InvalidArgument(
                f"reconfigure: the group has {world_size} ranks but members lists {len(seats)} "
                f"seats {seats}: member g of the group is its rank g")
        if collectives is not None and seats[rank] != self.rank:
            raise InvalidArgument(
                f"reconfigure: this process is rank {rank} of the group, but members puts seat "
                f"{seats[rank]} there and this Rebalancer holds seat {self.rank}: list each "
                f"member's seat at its rank in the group")
        rendezvous = None if collectives is not None else _rendezvous(rendezvous, world_size)
        self._rt.reconfigure(rank, world_size, seats, str(control), rendezvous or "",
                             str(group), str(transport), collectives)
        if collectives is not None:
            self._collectives = collectives

    def exited_ranks(self):
        """With group= the engine's process group: the ranks of this machine whose process has
        exited (a dead peer's rank, for the engine's own error when one of its collectives
        fails); [] with eplb's own control planes, or when none has."""
        return self._collectives.exited() if self._collectives is not None else []

    def members(self):
        """The seats of the group now, ascending (every seat until a reconfigure())."""
        return self._rt.members()

    def unavailable(self, layer):
        """The experts of `layer` with no usable replica now (every replica on a lost slot),
        ascending: int32 numpy. route() sends their tokens to -1 (leave the expert out of the
        token's sum) until the repair installs them."""
        return self._rt.unavailable(layer)

    def any_unavailable(self):
        """Whether some expert of some layer is unavailable now."""
        return self._rt.any_unavailable()

    def backup_experts(self):
        """The experts this rank keeps a backup copy of (config "backup_copies"), the same in
        every layer: int32 numpy, empty without backups."""
        return self._rt.backup_experts()

    def backup_bytes(self):
        """The bytes of this rank's backup share (host memory, counted in host_bytes())."""
        return self._rt.backup_bytes()

    def backup_weights(self, layer, tensor, expert, dtype=None, shape=None, as_torch=False):
        """This rank's backup copy of one tensor of `expert` in `layer` (one of
        backup_experts()): a writable view [*shape] (dtype and shape as for weights()) that
        keeps the memory alive. Fill the share with fill_backup(), which also marks it as a
        source for repairs; writing through these views alone does not. Take it again after a
        reconfigure() (the share moves into the new transport)."""
        index = self._tensor_index(tensor)
        raw = self._rt.backup_weights(_as_int(layer, "layer"), index,
                                      _as_int(expert, "expert", -2**31, 2**31 - 1))
        return self._view(raw, index, dtype, shape, as_torch, ())

    def fill_backup(self, fill):
        """Fills this rank's backup share: ``fill(layer, tensor_name, expert, view)`` for each
        layer, tensor and expert of backup_experts(), on this thread (with the GIL).
        `view` is a writable view of the copy (dtype and shape as declared in `weights`):
        fill it in place, or return the expert's weights (as fill_weights()'s callback does)
        and they are copied into it. Once every call returned, the share counts as filled: it
        is a restore source from the next reconfigure() on. Call it after connect() (a joining
        rank: after its reconfigure()), before serving; an exception from `fill` propagates
        and leaves the share unfilled. Nothing to do (and no calls) without backups.

        Config "backup_copies" keeps that many host copies of every expert across the ranks.
        The C++ Backup::loader (reading an expert from the checkpoint on demand) has no Python
        form for now: the runtime calls it on its worker thread, which runs without the GIL."""
        names = [t[0] for t in self._tensors]

        def one(layer, index, expert, raw):
            view = self._view(raw, index, None, None, False, ())
            value = fill(layer, names[index], int(expert), view)
            if value is not None:
                _store(view, raw, value)

        self._rt.fill_backup(one)

    # ------------------------------------------------------------------ forward thread
    def record(self, layer, topk_ids):
        """Counts the tokens routed to each listed logical expert of `layer` in this step.
        `topk_ids`: integer numpy array or CPU torch tensor, any shape (e.g. [tokens, top_k]);
        int32 C-contiguous input is read in place, other integer dtypes are converted."""
        self._rt.record(layer, _ids(topk_ids, "topk_ids"))

    def record_pass(self, counts, per=None):
        """One forward pass of the engine's own counters, every layer at once, in place of a
        record() call per layer (and, on a GPU, a host sync per layer): `counts` is the
        engine's per-pass count tensor, [layers, physical] tokens per slot (vLLM's
        expert_load_pass; each slot's tokens count for the expert it holds now) or [layers,
        experts] per logical expert (SGLang's); int32 or int64, a CPU torch tensor or numpy
        array, read in place (any strides). `per` ("slot" or "expert") says which; it is needed
        only when physical == experts. Once per step: a second call before step_end(), a
        wrong shape or dtype, a negative count or a CUDA tensor raises eplb.InvalidArgument
        and counts nothing. The engine zeroes its tensor for the next pass as it does."""
        layers, experts = self._layers, self._config["experts"]
        physical = self._config["physical"]
        # After a reconfigure to fewer seats: the members' slots, as vLLM re-slices its counts.
        members = len(self._rt.members()) * self._slots_per_rank
        address, dtype, shape, strides = _host_ints(counts, "record_pass: counts")
        if per is None:
            if len(shape) == 2 and shape[1] in (physical, members) and \
                    shape[1] != experts:
                per = "slot"
            elif len(shape) == 2 and shape[1] == experts and experts not in (physical, members):
                per = "expert"
            elif len(shape) == 2 and shape[1] == experts:
                raise InvalidArgument(f"record_pass: counts is [{shape[0]}, {shape[1]}] and "
                                      f"the slots are as many as the experts ({experts}): say "
                                      f"per='slot' or per='expert'")
            else:
                slots = f"[{layers}, {physical}]" + (
                    f" or [{layers}, {members}] (the members' slots)" if members != physical
                    else "")
                raise InvalidArgument(
                    f"record_pass: counts has shape {list(shape)}, expected [layers, physical] "
                    f"= {slots} (tokens per slot) or [layers, experts] = [{layers}, "
                    f"{experts}] (tokens per expert)")
        if per not in ("slot", "expert"):
            raise InvalidArgument(f"record_pass: per={per!r} is not 'slot' or 'expert'")
        self._rt.record_pass(address, dtype, shape, strides, per + "s")

    def bind_maps(self, metadata=None, **maps):
        """Binds the engine's own map tensors: eplb writes a layer's rows into them, in place, at
        the step that layer is installed on every rank (and after reconfigure()); their storage
        never changes, so CUDA graphs that captured them stay valid. Every rank's tensors are
        the same after every step (a dispatch row is the rank's own). Writes every layer's rows
        now, and replaces any binding made before.

        Keywords (any of them; int32 or int64 CPU tensors or numpy arrays, any strides):
            vLLM's layout:
                logical_to_physical_map: [layers, experts, R], the slots serving each expert
                    (usable slots, in eplb's dispatch order), -1 after them; R, fixed by the
                    engine, must be at least physical - experts + 1 (vLLM sizes it
                    num_redundant_experts + 1)
                logical_replica_count: [layers, experts]
                physical_to_logical_map: [layers, physical]
            SGLang's (the fields of its ExpertLocationMetadata, host copies):
                physical_to_logical_map, physical_to_logical_map_cpu: [layers, physical]
                logical_to_all_physical_map, logical_to_all_physical_map_cpu:
                    [layers, experts, X], X >= physical - experts + 1 (SGLang: physical)
                logical_to_all_physical_map_num_valid: [layers, experts]
                logical_to_rank_dispatch_physical_map: [layers, experts], the slot this rank
                    sends each expert's tokens to (eplb's static choice: a replica on this rank,
                    else on its node, else shared evenly among the ranks without one)
        `metadata`: an object or dict with those names as attributes or keys (SGLang's
        ExpertLocationMetadata): each field present that is a tensor is bound.

        A wrong shape, dtype or R, an unknown name or a CUDA tensor raises
        eplb.InvalidArgument and binds nothing. eplb keeps a reference to each tensor."""
        if metadata is not None:
            fields = metadata if isinstance(metadata, dict) else vars(metadata)
            for name in _MAP_KINDS:
                value = fields.get(name)
                if value is not None and name not in maps and not isinstance(value, int):
                    maps[name] = value
        if not maps:
            raise InvalidArgument(f"bind_maps: no map tensors given (names: "
                                  f"{', '.join(_MAP_KINDS)})")
        bindings, keep = [], []
        for name, tensor in maps.items():
            if name not in _MAP_KINDS:
                raise InvalidArgument(f"bind_maps: unknown map {name!r} (known: "
                                      f"{', '.join(_MAP_KINDS)})")
            address, dtype, shape, strides = _host_ints(tensor, f"bind_maps: {name}")
            bindings.append((_MAP_KINDS[name], name, address, dtype, shape, strides))
            keep.append(tensor)
        self._rt.bind_maps(bindings)
        self._maps = (bindings, keep)

    def propose(self, placement):
        """Installs a placement computed elsewhere: the engine's own policy (vLLM's, SGLang's
        init_by_eplb, eplb.integrations.vllm.propose), or a file ``eplb plan`` wrote.

        `placement`: the phy2log, a [layers, physical] integer torch tensor (any device) or
        numpy array, or after a reconfigure() to fewer seats [layers, members' slots] (member
        g, in ascending seat order, at [g * slots_per_rank, ...), as vLLM numbers its slots
        after a scale-down); or the path of a placement file (eplb's placement JSON, SGLang's
        ``{"physical_to_logical_map": ...}``).

        The next step_end() starts a rebalance that installs it instead of placing with the
        configured policy (config "interval": 0 leaves all placements to the engine): the
        runtime plans the moves, stages them off the forward thread, agrees the install steps
        and installs layer by layer, exactly as for its own placements; history() marks it
        "proposed". Every rank proposes the same placement at the same step: a mismatch fails
        that rebalance on every rank, naming the first differing layer and slot, and the
        placement in force stays (raised from step_end() with on_error "raise").

        Raises eplb.InvalidArgument, and nothing is queued, for a wrong shape, an expert out
        of range or a layer that leaves an expert without a slot, while a rebalance is in
        flight (propose once ``rebalancing`` is False), or once rebalancing has stopped
        (control plane broken). A second call before step_end() replaces the first."""
        if isinstance(placement, (str, os.PathLike)):
            self._rt.propose_file(os.fspath(placement))
            return
        if _is_torch_tensor(placement):
            placement = placement.detach().cpu().numpy()
        a = np.asarray(placement)
        if a.dtype.kind not in "iu" or a.ndim != 2:
            raise InvalidArgument(
                f"propose: the placement must be an integer [layers, physical] phy2log (torch "
                f"tensor or numpy array) or a placement file, got dtype {a.dtype} shape "
                f"{a.shape}")
        if a.size and (a.min() < -2**62 or a.max() > 2**62):
            raise InvalidArgument(f"propose: the placement holds expert {a.max()}, outside "
                                  f"[0, {self._config['experts']})")
        self._rt.propose(np.ascontiguousarray(a, dtype=np.int64))

    @property
    def rebalancing(self):
        """Whether a rebalance is in flight (the same on every rank at every step)."""
        return self._rt.state()["rebalancing"]

    def record_counts(self, layer, counts):
        """Adds a count vector [experts] (integers) to `layer` in this step."""
        if _is_torch_tensor(counts):
            counts = counts.detach().cpu().numpy()
        counts = np.asarray(counts)
        if counts.dtype.kind not in "iu":
            raise InvalidArgument(f"counts must be integers, got dtype {counts.dtype}")
        self._rt.record_counts(layer, counts)

    def dispatch(self, layer, as_torch=False):
        """The dispatch tables of `layer` now (copies; they describe the placement until the
        next step_end()): a dict of int32 arrays ``log2phy`` [experts, max_replicas] (padded
        with -1), ``replica_count`` [experts], ``static_slot`` [ranks, experts] (the slot rank g
        sends e to under static dispatch) and uint32 ``cumulative_share``
        [experts, max_replicas] (weighted dispatch). Torch CPU tensors with as_torch=True."""
        tables = self._rt.dispatch(layer)
        if as_torch:
            torch = _torch()
            return {k: torch.from_numpy(v.astype(np.int64) if v.dtype == np.uint32 else v)
                    for k, v in tables.items()}
        return tables

    def route(self, layer, topk_ids, first_token=0, *, global_counts=None, prefix=None,
              cost=None):
        """The physical slot of every (token, k) of `topk_ids` [tokens, top_k] under the
        config's dispatch policy; row t is the token with index first_token + t (hash and
        weighted dispatch hash it; split counts each expert's tokens from the first row).
        Slot p lives on rank p // slots_per_rank. Returns int32 numpy, or an int64 torch
        tensor for a torch input (torch indexes with int64).

        dispatch "adaptive" also needs this step's `global_counts` (the layer's count of every
        logical expert summed over all ranks) and `prefix` (each expert's tokens on the ranks
        below this one), int arrays of [experts]: from the all-to-all's layout exchange, or an
        all-reduce and an exclusive scan of this rank's counts. Every rank computes the same
        shares from them. Dispatch "adaptive_cost" takes the same two and `cost`, an
        ``eplb.cost.CostModel`` (the same on every rank): its shares minimise the busiest
        rank's modeled time instead of its tokens."""
        torch_in = _is_torch_tensor(topk_ids)
        counts = None if global_counts is None else _ids(global_counts, "global_counts")
        before = None if prefix is None else _ids(prefix, "prefix")
        slots = self._rt.route(layer, _ids(topk_ids, "topk_ids"),
                               _as_int(first_token, "first_token"), global_counts=counts,
                               prefix=before, cost=cost)
        if torch_in:
            return _torch().from_numpy(slots.astype(np.int64))
        return slots

    def weights(self, layer, tensor, dtype=None, shape=None, as_torch=False):
        """This rank's weights of one tensor of `layer`: slot j holds the expert
        ``local_experts(layer)[j]``. With the engine's own tensors, that very tensor (unless
        dtype, shape or as_torch ask for another view of it); else a view of the arena (no copy).

        `tensor`: its name or index. `dtype`, `shape`: how to view one expert (default: as
        declared in `weights`, else uint8 [expert_bytes]); a torch dtype, or as_torch=True,
        gives a torch CPU tensor (through DLPack). Shape of the result: [slots_per_rank, *shape].

        With the arena, VALID ONLY UNTIL THE NEXT step_end(): fetch it again after every
        step_end() (unless config "install" is "copy": then the arena moves only at
        reconfigure()), and after every reconfigure(), which moves the arena into the new
        group's transport. An old view stays readable (it keeps the memory it shows alive) but
        is stale. The engine's tensors never move.
        """
        index = self._tensor_index(tensor)
        if (self._engine is not None and dtype is None and shape is None and not as_torch and
                not self._rt.joining()):
            return self._engine[index][_as_int(layer, "layer", 0, self._layers - 1)]
        raw = self._rt.weights(layer, index)  # uint8 [slots_per_rank, nbytes]
        return self._view(raw, index, dtype, shape, as_torch, (self._slots_per_rank,))

    def _view(self, raw, index, dtype, shape, as_torch, lead):
        """`raw` (uint8 [*lead, expert_bytes] of tensor `index`) as [*lead, *shape] of `dtype`
        (default: as declared in `weights`, else uint8 [expert_bytes])."""
        name, nbytes, declared_shape, declared_dtype = self._tensors[index]
        if dtype is None:
            dtype = declared_dtype if declared_dtype is not None else np.uint8
            if shape is None and declared_shape is not None:
                shape = declared_shape
        size = _itemsize(dtype)
        if shape is None:
            if nbytes % size:
                raise InvalidArgument(f"weights: tensor '{name}' has {nbytes} bytes per expert, "
                                      f"not a multiple of {dtype}'s {size}")
            shape = (nbytes // size,)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if math.prod(shape) * size != nbytes:
            raise InvalidArgument(f"weights: tensor '{name}' has {nbytes} bytes per expert; "
                                  f"shape {shape} of {dtype} needs {math.prod(shape) * size}")
        if as_torch or _is_torch_dtype(dtype):
            t = _to_torch(raw)
            target = dtype if _is_torch_dtype(dtype) else _torch_dtype(dtype)
            if target != t.dtype:
                t = t.view(target)
            return t.view(*lead, *shape)
        return raw.view(dtype).reshape(*lead, *shape)

    def phy2log(self, layer):
        """The placement of `layer` in force now: int32 [physical], the expert of each slot."""
        return self._rt.phy2log(layer)

    def local_experts(self, layer):
        """The logical experts of this rank's slots of `layer` now: int32 [slots_per_rank]."""
        begin = self.rank * self._slots_per_rank
        return self._rt.phy2log(layer)[begin:begin + self._slots_per_rank]

    def placement(self):
        """The placement in force now, all layers: int32 [layers, physical]."""
        return self._rt.placement()

    def step_end(self):
        """Once after every forward pass, on every rank. Advances the rebalance protocol (in
        async mode it stays in the microseconds); releases the GIL. With on_error="raise",
        raises the error of a rebalance that failed at this step (already abandoned
        consistently; later calls go on serving). Invalidates weights() views."""
        self._rt.step_end()

    def set_cost_model(self, model):
        """The eplb.cost.CostModel that config "min_gain"'s check predicts the MoE time with,
        from the next trigger on (one the engine fits from its own per-layer timings while
        serving: eplb.cost.fit_cost_model). Give every rank the same model at the same step
        (the ranks decide with the mean of theirs). Forward thread."""
        self._rt.set_cost_model(model)

    # ------------------------------------------------------------------ external agreement
    def agreement_contribution(self):
        """With config agreement="external": this rank's value for the agreement of step
        ``self.step``, read after step_end(). Min-reduce it over the ranks on a collective the
        engine runs anyway and hand the minimum to agreement_result() on every rank.
        eplb.NO_AGREEMENT (the identity of min) when no rebalance runs."""
        return self._rt.agreement_contribution()

    def agreement_result(self, step, min_value):
        """The minimum over all ranks of their agreement_contribution() at `step`; it must come
        before the step_end() that makes ``self.step == step + lag`` (that call waits for it at
        most timeout_ms, then fails the rebalance and stops rebalancing). Any thread."""
        self._rt.agreement_result(_as_int(step, "step"), _as_int(min_value, "min_value"))

    # ------------------------------------------------------------------ observability
    def host_bytes(self):
        """The host memory eplb holds on this rank, in bytes: the arena or staging layer
        (unless it is in device memory), the load window, the placement and the dispatch
        tables. Not the engine's weights, nor a rebalance's plan in flight. Call it from the
        forward thread (it reads the tables that installs swap)."""
        return self._rt.host_bytes()

    def shutdown(self):
        """Stops the runtime's threads (a running rebalance is cancelled); idempotent. Call it
        on every rank at the same step (a rank that leaves the group while the others
        reconfigure() without it calls it at that step). Views of the arena stay readable
        afterwards."""
        self._rt.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    # ------------------------------------------------------------------ state
    @property
    def rank(self):
        """This process's seat: its rank in the layout (slots [rank * slots_per_rank, ...)),
        which reconfigure() never changes."""
        return self._rt.rank()

    @property
    def world_size(self):
        """The layout's ranks (seats), lost ones included; members() are those serving."""
        return self._world_size

    @property
    def layers(self):
        return self._layers

    @property
    def slots_per_rank(self):
        return self._slots_per_rank

    @property
    def tensors(self):
        """Names of the tensors of one layer, in arena order."""
        return [t[0] for t in self._tensors]

    @property
    def config(self):
        """The configuration in force, as a dict (every field, defaults included)."""
        return dict(self._config)

    @property
    def step(self):
        """step_end() calls so far."""
        return self._rt.step()

    @property
    def installed_layers(self):
        """Layer installs so far, all rebalances: when it changes, views must be re-fetched."""
        return self._rt.installed_layers()

    @property
    def bytes_held(self):
        return self._rt.state()["bytes_held"]

    def _tensor_index(self, tensor):
        if isinstance(tensor, str):
            if tensor not in self._index:
                raise InvalidArgument(
                    f"weights: no tensor '{tensor}' (tensors: {', '.join(self._index)})")
            return self._index[tensor]
        index = operator.index(tensor)
        if not 0 <= index < len(self._tensors):
            raise InvalidArgument(
                f"weights: tensor {index} is outside [0, {len(self._tensors)})")
        return index
