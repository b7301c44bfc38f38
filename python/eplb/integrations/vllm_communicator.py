"""eplb as vLLM's EPLB communicator: one-sided reads of the peers' live expert weights over
eplb's transports, in the rounds of eplb's half-duplex migration schedule.

vLLM (``vllm/distributed/eplb/``) moves a layer's experts through an ``EplbCommunicator``. For
each layer (or, with migration batching, each batch of a layer) every EP rank calls
``set_transfer_context(old_indices, layer_idx)``, then ``add_send(tensors, dst_rank,
expert_id)`` for each expert it gives and ``add_recv(tensors, src_rank, expert_id)`` for each
expert it gets (``tensors``: one row of each of the layer's weight tensors; for a receive, rows
of vLLM's expert buffer), then ``execute()``. ``TransportCommunicator`` fills that contract:

- at construction (collective over the group) it registers every layer's expert tensors once
  with an eplb transport, exchanges the descriptors, and checks that every rank holds the same
  tensors (dtype and shape); the transport is ``shm`` when the group is on one machine (peers
  read the tensors by cross-memory attach), ``hybrid`` across machines (shm within a node,
  UCX across), or what ``transport=`` / ``EPLB_VLLM_TRANSPORT`` says;
- ``add_send`` does nothing (a read needs no help from its source) and ``add_recv`` records
  where a received expert lands;
- ``execute()`` (collective) publishes this rank's receives (a few integers) on its progress
  board, a small region every peer reads one-sided, and reads everyone's; plans the reads with
  eplb's migration layer (``eplb.plan_migration(..., peers_per_round=1, half_duplex=True)``:
  it chooses the source replica of each transfer and packs the transfers into rounds in which
  every rank talks to one peer at most, vLLM's contention model); and reads round by round
  from the peers' live weights straight into the receive rows. Before a round a rank waits for
  the peers it meets in that round to have finished the one before (their boards say); after
  the last round it waits for every rank to be done, the fence after which a rank may
  overwrite its weights (no peer reads them any more). execute() runs no collective of the
  group: a rank's wait is a few one-sided reads of small boards (_board.py).

Failures: a peer that dies (or whose memory goes) during ``execute()`` makes every surviving
rank raise ``eplb.IoError`` naming it, at once (the rank that finds it writes the culprit on its
board, and the ranks waiting on it give up naming the same rank); a peer that stops makes them
raise ``eplb.Timeout`` within ``timeout`` seconds (the whole ``execute()``) naming the ranks
that did not get there. After either, the communicator is broken (every later call raises
``eplb.IoError``): the ranks may be out of step, so vLLM must rebuild its EP state, as after any
failure of its own communicators.
Bad input that one rank detects (a receive row of another dtype or size than the registered
tensor, an expert no slot of the old placement holds, ranks in different layers) is reported
on every rank as ``eplb.InvalidArgument`` naming the rank and the value; nothing hangs.

Threads and ownership: one thread at a time calls a communicator (vLLM's forward thread in sync
mode, its async EPLB worker otherwise). The expert tensors are vLLM's: the communicator keeps a
reference to each and reads them in place; they must keep their storage (vLLM never reallocates
them) until ``close()``. A receive row is written only inside ``execute()``.

Limits: CPU tensors only (CUDA tensors raise ``eplb.NotSupported``: eplb's transports here
serve host memory; eplb's cuda transport, CUDA IPC within a node, is not wired to this
communicator). Not for vLLM's stateless groups (elastic EP), which raise ``eplb.NotSupported``.

``install`` puts it into vLLM's ``create_eplb_communicator`` under the backend name ``"eplb"``;
``install_from_env`` (called by the package's vLLM plugin) does that when
``EPLB_VLLM_COMMUNICATOR=eplb`` and makes it the communicator of every EPLB model (vLLM's config
admits only its own backend names). vLLM is imported only by ``install``.
"""

import json
import logging
import os
import socket
import time
import zlib

import numpy as np

import eplb
from eplb import _eplb
from eplb._torch_group import WatchedTorchGroup
from eplb.integrations._board import CHECKED, FENCED, PUBLISHED, Board, round_done

__all__ = [
    "TransportCommunicator", "communicator_class", "make_communicator", "plan_reads", "install",
    "install_from_env", "BACKEND", "ENV_COMMUNICATOR", "ENV_TRANSPORT", "ENV_TIMEOUT",
]

_log = logging.getLogger(__name__)

BACKEND = "eplb"
ENV_COMMUNICATOR = "EPLB_VLLM_COMMUNICATOR"
ENV_TRANSPORT = "EPLB_VLLM_TRANSPORT"
ENV_TIMEOUT = "EPLB_VLLM_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # seconds, as vLLM's NIXL communicator waits for its fence
_TRANSPORTS = ("auto", "shm", "hybrid", "ucx")
_ERRORS = {"InvalidArgument": eplb.InvalidArgument, "NotSupported": eplb.NotSupported,
           "IoError": eplb.IoError, "Timeout": eplb.Timeout}


def _kind(error):
    for name, cls in _ERRORS.items():
        if type(error) is cls:  # noqa: E721 - the exact class, not a subclass
            return name
    return "InvalidArgument" if isinstance(error, ValueError) else "Error"


def _torch():
    import torch
    return torch


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class _Failed(Exception):
    """A check of this rank that every rank must hear of: caught here, carried to every rank
    (start-up: the group's gather; execute(): the boards) and raised on all of them."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def _check_timeout(timeout, name="timeout"):
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise eplb.InvalidArgument(f"{name} {timeout!r} must be a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise eplb.InvalidArgument(f"{name} {timeout!r} must be a positive, finite number of "
                                   f"seconds")
    return value


def _check_transport(name, what="transport"):
    if name is None:
        return "auto"
    if name not in _TRANSPORTS:
        raise eplb.InvalidArgument(f"{what} {name!r} is not one of {', '.join(_TRANSPORTS)} "
                                   f"(auto: shm on one machine, hybrid across machines)")
    if name != "auto" and name not in _eplb.transport_backends():
        raise eplb.NotSupported(
            f"{what} {name!r} is not in this build of eplb (it has "
            f"{', '.join(_eplb.transport_backends())}; ucx and hybrid need libucx-dev)")
    return name


class TransportCommunicator:
    """vLLM's ``EplbCommunicator`` contract over eplb's transports (see the module's text).

    Parameters:
        group: the CPU (gloo) torch.distributed process group of the EP ranks (vLLM's
            ``get_eplb_group().cpu_group``); this rank's EP rank is its rank in the group
        expert_weights: ``[layers][tensors]`` CPU tensors, each ``[local slots, ...]`` and
            contiguous, the same dtypes and shapes on every rank (vLLM's
            ``model.expert_weights``)
        transport: "auto" (default; ``EPLB_VLLM_TRANSPORT`` when set), "shm", "hybrid" or
            "ucx"
        timeout: seconds one ``execute()`` (and the construction) may take at most (default
            ``EPLB_VLLM_TIMEOUT``, else 300)

    Construction is collective: every rank of the group constructs its communicator at the
    same point (vLLM does, in ``EplbState.add_model``).
    """

    def __init__(self, group, expert_weights, transport=None, timeout=None):
        if transport is None:
            transport = os.environ.get(ENV_TRANSPORT) or None
            what = ENV_TRANSPORT
        else:
            what = "transport"
        self._asked = _check_transport(transport, what)
        if timeout is None:
            timeout = os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT
            self._timeout = _check_timeout(timeout, ENV_TIMEOUT)
        else:
            self._timeout = _check_timeout(timeout)
        self._group = WatchedTorchGroup(group)
        self.rank = self._group.rank
        self.world_size = self._group.size
        self._transport = None
        self._broken = None
        self._stream = None
        self._layer = None
        self._old = None
        self._recvs = []
        self._deferred = None  # the first bad add_recv, raised on every rank by execute()
        self.last = None  # figures of the last execute(): rounds, reads, bytes, seconds

        deadline = time.monotonic() + self._timeout
        # Step 1: this rank's tensors, checked here and compared over the group.
        try:
            self._weights, self._meta = self._describe(expert_weights)
            mine = {"host": socket.gethostname(), "tensors": self._meta}
        except _Failed as e:
            self._weights, self._meta = None, None
            mine = {"error": [e.kind, str(e)]}
        everyone = self._gather(mine, deadline, "start-up")
        self._raise_errors(everyone, "start-up")
        self._compare(everyone)
        self._slots = self._meta[0][0]["shape"][0]
        hosts = [m["host"] for m in everyone]
        self.backend = self._choose_transport(hosts)
        self._nodes = self._node_count(hosts)

        # Step 2: register every layer's tensors once, exchange the descriptors, import them.
        try:
            node = socket.gethostname() if self.backend == "hybrid" else ""
            self._transport = _eplb._Transport(self.backend, self.rank, node)
            for layer, tensors in enumerate(self._weights):
                for t, tensor in enumerate(tensors):
                    region = self._transport.register_memory(tensor.data_ptr(),
                                                             tensor.numel() *
                                                             tensor.element_size())
                    if region != self._region(layer, t):
                        raise _Failed("Error", f"registered region {region} for tensor {t} of "
                                               f"layer {layer}, expected "
                                               f"{self._region(layer, t)}")
            self._board = Board(self._transport, self.rank, self.world_size, self._slots,
                                stopped=self._group.stopped)
            if self._board.region != self._region(len(self._weights), 0):
                raise _Failed("Error", f"the progress board is region {self._board.region}, "
                                       f"expected {self._region(len(self._weights), 0)}")
            mine = {"descriptor": self._transport.export_descriptor().hex()}
        except (_Failed, eplb.Error) as e:
            mine = {"error": [getattr(e, "kind", None) or _kind(e), str(e)]}
        everyone = self._gather(mine, deadline, "start-up (descriptors)")
        self._raise_errors(everyone, "start-up")
        try:
            for peer, m in enumerate(everyone):
                if peer != self.rank:
                    self._transport.import_descriptor(peer, bytes.fromhex(m["descriptor"]))
            mine = {}
        except eplb.Error as e:
            mine = {"error": [_kind(e), str(e)]}
        self._raise_errors(self._gather(mine, deadline, "start-up (connections)"), "start-up")
        self._epoch = 0  # execute() calls so far: the same count on every rank
        _log.info("eplb communicator: rank %d of %d, %s transport, %d layers x %d tensors "
                  "registered", self.rank, self.world_size, self.backend, len(self._weights),
                  len(self._meta[0]))

    # ------------------------------------------------------------ vLLM's EplbCommunicator
    @property
    def needs_recv_rows(self):
        return False

    @property
    def owned_expert_buffer(self):
        return None

    @property
    def needs_profile_buffer_reservation(self):
        return False  # nothing to reserve: the transport was set up at construction

    def set_stream(self, stream):
        self._stream = stream  # CPU tensors: no stream to order copies on

    def set_transfer_context(self, old_indices, layer_idx, recv_rows=None):
        """The layer the next ``add_recv`` calls and ``execute()`` are about, and its placement
        before the move (``old_indices``: vLLM's global phy2log of the layer, [physical]).
        A bad argument is reported by ``execute()``, on every rank."""
        self._usable()
        if self._deferred is not None:
            return
        try:
            if self._recvs:
                raise _Failed("InvalidArgument",
                              f"set_transfer_context(layer {layer_idx}) with {len(self._recvs)} "
                              f"receives of layer {self._layer} not executed yet")
            try:
                layer = int(layer_idx)
            except (TypeError, ValueError):
                raise _Failed("InvalidArgument",
                              f"layer_idx {layer_idx!r} is not an integer") from None
            if not 0 <= layer < len(self._weights):
                raise _Failed("InvalidArgument", f"layer_idx {layer} is outside [0, "
                                                 f"{len(self._weights)}), the layers registered")
            from eplb.integrations import _integers
            try:
                old = _integers(old_indices, "old_indices")
            except eplb.InvalidArgument as e:
                raise _Failed("InvalidArgument", str(e)) from None
            physical = self.world_size * self._slots
            if old.ndim != 1 or old.shape[0] < physical:
                raise _Failed("InvalidArgument",
                              f"old_indices has shape {tuple(old.shape)}, expected [physical] "
                              f"with at least {physical} slots ({self.world_size} ranks x "
                              f"{self._slots})")
            bad = old[:physical][(old[:physical] < -1) | (old[:physical] >= eplb.MAX_EXPERTS)]
            if bad.size:
                raise _Failed("InvalidArgument",
                              f"old_indices of layer {layer} holds expert {int(bad[0])}, "
                              f"outside [0, {eplb.MAX_EXPERTS}) (-1 marks an unused slot)")
        except _Failed as e:
            self._deferred = e
            return
        self._layer = layer
        self._old = old[:physical]

    def add_send(self, tensors, dst_rank, expert_id):
        """Nothing to do: the receiver reads this rank's live weights itself."""
        self._usable()

    def add_recv(self, tensors, src_rank, expert_id):
        """Expert ``expert_id`` of the current layer lands in ``tensors`` (one row of each of
        the layer's tensors). ``src_rank`` is vLLM's choice of source; eplb chooses its own
        among the ranks holding the expert. Checks are reported by ``execute()``, on every
        rank."""
        self._usable()
        if self._deferred is not None:
            return
        try:
            if self._layer is None:
                raise _Failed("InvalidArgument",
                              "add_recv() before set_transfer_context(): the layer is unknown")
            self._recvs.append((self._check_expert(expert_id),
                                self._check_rows(tensors, expert_id)))
        except _Failed as e:
            self._deferred = e

    def execute(self):
        """Every recorded receive lands in its rows; collective. See the module's text."""
        self._usable()
        try:
            self._execute()
        except (eplb.InvalidArgument, eplb.NotSupported):
            raise  # seen alike by every rank, which all raise it at the same point
        except BaseException as e:
            self._broken = self._broken or f"{type(e).__name__}: {e}"
            raise

    def _execute(self):
        recvs, self._recvs = self._recvs, []
        deferred, self._deferred = self._deferred, None
        layer, old = self._layer, self._old
        self._layer, self._old = None, None
        start = time.monotonic()
        deadline = start + self._timeout
        where = f"layer {layer}" if layer is not None else "execute()"
        self._epoch += 1
        epoch, board = self._epoch, self._board

        # Step 1: every rank's receives (distinct experts) and the checks of each rank, through
        # the boards; once every rank has read them (CHECKED), they may be raised.
        demands = sorted({e for e, _ in recvs})
        if deferred is None and len(demands) > self._slots:
            deferred = _Failed("InvalidArgument", f"{len(demands)} distinct experts received in "
                                                  f"layer {layer}, more than the {self._slots} "
                                                  f"slots of a rank")
        if deferred is not None:
            demands = []
        board.publish(epoch, layer, None if old is None else zlib.crc32(old.tobytes()),
                      demands, None if deferred is None else (deferred.kind, str(deferred)))
        everyone = range(self.world_size)
        board.wait_for(everyone, epoch, PUBLISHED, deadline, where)
        boards = board.read(epoch, deadline, where)
        board.progress(epoch, CHECKED)
        board.wait_for(everyone, epoch, CHECKED, deadline, where)
        # Step 2: eplb's plan: a source for every transfer, and the rounds. Every rank decides
        # alike from the same boards: when one raises here, all do, and none reads again in
        # this epoch (FENCED).
        try:
            self._raise_errors(boards, where)
            self._agree(boards, where)
            if not any(b["recv"] for b in boards):
                board.progress(epoch, FENCED)
                self.last = {"rounds": 0, "reads": 0, "bytes": 0,
                             "seconds": time.monotonic() - start}
                return
            reads, rounds = plan_reads(old, [b["recv"] for b in boards], self._nodes,
                                       sum(m["stride"] for m in self._meta[layer]), where)
        except eplb.InvalidArgument:
            board.progress(epoch, FENCED)
            raise
        rows = {}
        for expert, dst in recvs:
            rows.setdefault(expert, []).append(dst)
        mine_reads = reads["dst_rank"] == self.rank
        served = reads["src_rank"] == self.rank
        # Receives this rank can fill from its own old slots (vLLM asks for none of these).
        remote = set(reads["expert"][mine_reads].tolist())
        for expert in demands:
            if expert not in remote:
                slot = int(np.flatnonzero(old[self.rank * self._slots:
                                              (self.rank + 1) * self._slots] == expert)[0])
                for dst, src in zip(rows[expert][0], self._weights[layer]):
                    dst.copy_(src[slot])

        # Step 3: the rounds. A rank meets one peer at most in a round (reading or read), and
        # starts it once that peer has finished the round before.
        moved = 0
        for k in range(rounds):
            what = f"{where}, round {k + 1} of {rounds}"
            now = reads["round"] == k
            sel = np.flatnonzero(mine_reads & now)
            peers = set(reads["src_rank"][sel].tolist()) | \
                set(reads["dst_rank"][np.flatnonzero(served & now)].tolist())
            board.wait_for(peers, epoch, round_done(k - 1), deadline, what)
            if sel.size:
                batch = []
                for i in sel.tolist():
                    src = int(reads["src_rank"][i])
                    row = int(reads["src_slot"][i]) - src * self._slots
                    for t, dst in enumerate(rows[int(reads["expert"][i])][0]):
                        stride = self._meta[layer][t]["stride"]
                        batch.append((src, self._region(layer, t), row * stride,
                                      dst.data_ptr(), stride))
                        moved += stride
                try:
                    self._transport.read(np.array(batch, dtype=np.int64),
                                         max(deadline - time.monotonic(), 0.0))
                except eplb.Error as e:
                    src = batch[0][0]
                    board.fail(epoch, 2 if isinstance(e, eplb.Timeout) else 1, src)
                    raise (eplb.Timeout if isinstance(e, eplb.Timeout) else eplb.IoError)(
                        f"eplb communicator, {what}: rank {self.rank} could not read from "
                        f"rank {src}: {e}") from e
            board.progress(epoch, round_done(k))
        # The fence: no rank reads this rank's weights once every rank is done.
        board.wait_for(everyone, epoch, round_done(rounds - 1), deadline,
                       f"{where}, after round {rounds} of {rounds}")
        board.progress(epoch, FENCED)

        # Step 4: an expert this rank needs in several rows: copy the first.
        for dsts in rows.values():
            for extra in dsts[1:]:
                for dst, src in zip(extra, dsts[0]):
                    dst.copy_(src)
        self.last = {"rounds": rounds, "reads": int(mine_reads.sum()), "bytes": moved,
                     "seconds": time.monotonic() - start}

    # ------------------------------------------------------------ life
    def close(self, wait=True):
        """Releases the transport: peers can no longer read this rank's weights. With `wait`,
        first waits (up to the timeout, at most 30 s) until no peer still reads this rank's
        board, each being done with the last execute(), failed, or gone: a rank that leaves
        first must not fail the others' last wait. Idempotent."""
        self._close(min(self._timeout, 30.0) if wait else 0.0)

    def _close(self, seconds):
        if self._transport is not None:
            board = getattr(self, "_board", None)
            if seconds > 0 and board is not None and self._epoch:
                board.settle(self._epoch, seconds)
            self._transport.close()
            self._transport = None
        self._broken = self._broken or "the communicator is closed"

    def __del__(self):
        try:
            self._close(5.0)  # dropped right after an execute(): peers may still read the board
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def broken(self):
        """Why the communicator can no longer be used, or None."""
        return self._broken

    # ------------------------------------------------------------ construction
    def _describe(self, expert_weights):
        """(the tensors [layers][tensors], their description), checked on this rank."""
        torch = _torch()
        try:
            layers = [list(ts) for ts in expert_weights]
        except TypeError:
            raise _Failed("InvalidArgument", f"expert_weights must be [layers][tensors] of "
                                             f"tensors, got {type(expert_weights).__name__}")
        if not layers or not layers[0]:
            raise _Failed("InvalidArgument", "expert_weights holds no tensor (it must be "
                                             "[layers][tensors], at least one of each)")
        meta = []
        for layer, tensors in enumerate(layers):
            described = []
            for t, w in enumerate(tensors):
                where = f"expert tensor {t} of layer {layer}"
                if not isinstance(w, torch.Tensor):
                    raise _Failed("InvalidArgument", f"{where} is a {type(w).__name__}, not a "
                                                     f"torch tensor")
                if w.device.type != "cpu":
                    raise _Failed(
                        "NotSupported",
                        f"{where} is on {w.device}: eplb's vLLM communicator moves CPU "
                        f"tensors only (its transports serve host memory). For GPU weights "
                        f"use one of vLLM's communicators (unset {ENV_COMMUNICATOR})")
                if w.layout != torch.strided or w.dim() < 1 or w.shape[0] < 1:
                    raise _Failed("InvalidArgument", f"{where} has shape {tuple(w.shape)}: "
                                                     f"expected a dense [local slots, ...] "
                                                     f"tensor")
                if not w.is_contiguous():
                    raise _Failed("InvalidArgument", f"{where} is not contiguous (strides "
                                                     f"{tuple(w.stride())}): peers read its "
                                                     f"rows as bytes")
                if w.shape[0] != tensors[0].shape[0]:
                    raise _Failed("InvalidArgument",
                                  f"{where} has {w.shape[0]} slots, tensor 0 of layer {layer} "
                                  f"{tensors[0].shape[0]}: every tensor holds this rank's slots")
                stride = w.numel() // w.shape[0] * w.element_size()
                if stride < 1:
                    raise _Failed("InvalidArgument", f"{where} has shape {tuple(w.shape)}: an "
                                                     f"expert of 0 bytes")
                described.append({"shape": list(w.shape), "dtype": _dtype_name(w.dtype),
                                  "stride": stride})
            meta.append(described)
        return layers, meta

    def _compare(self, everyone):
        """Every rank's tensors against rank 0's: the same layers, dtypes and shapes."""
        ref = everyone[0]["tensors"]
        for r, m in enumerate(everyone[1:], start=1):
            theirs = m["tensors"]
            problem = None
            if len(theirs) != len(ref):
                problem = (f"rank {r} registers {len(theirs)} layers of expert tensors, "
                           f"rank 0 {len(ref)}")
            else:
                for layer, (a, b) in enumerate(zip(ref, theirs)):
                    if len(a) != len(b):
                        problem = (f"rank {r} has {len(b)} expert tensors in layer {layer}, "
                                   f"rank 0 {len(a)}")
                        break
                    for t, (x, y) in enumerate(zip(a, b)):
                        if x["dtype"] != y["dtype"] or x["shape"] != y["shape"]:
                            problem = (f"expert tensor {t} of layer {layer} is "
                                       f"{y['dtype']} {tuple(y['shape'])} on rank {r}, "
                                       f"{x['dtype']} {tuple(x['shape'])} on rank 0")
                            break
                    if problem:
                        break
            if problem:
                raise eplb.InvalidArgument(
                    f"eplb communicator start-up: {problem}; every rank must hold the same "
                    f"expert tensors (dtype and shape) for its weights to be read by the "
                    f"others")

    def _choose_transport(self, hosts):
        nodes = list(dict.fromkeys(hosts))
        if self._asked != "auto":
            if self._asked == "shm" and len(nodes) > 1:
                raise eplb.InvalidArgument(
                    f"transport 'shm' reaches the ranks of one machine, but the group's ranks "
                    f"are on {len(nodes)} ({', '.join(nodes)}): use hybrid (shm within a "
                    f"node, UCX across) or ucx")
            return self._asked
        if len(nodes) == 1:
            return "shm"
        if "hybrid" not in _eplb.transport_backends():
            raise eplb.NotSupported(
                f"the group's ranks are on {len(nodes)} machines ({', '.join(nodes)}), which "
                f"needs eplb's hybrid transport (UCX across machines); this build has "
                f"{', '.join(_eplb.transport_backends())} (install libucx-dev and rebuild)")
        return "hybrid"

    def _node_count(self, hosts):
        """Nodes as eplb's planner counts them (rank g on node g // (G/N)): the machines, when
        each holds an equal run of consecutive ranks; else 1 (sources then ignore nodes)."""
        nodes = list(dict.fromkeys(hosts))
        n, g = len(nodes), len(hosts)
        if g % n:
            return 1
        per = g // n
        blocks = [hosts[i * per:(i + 1) * per] for i in range(n)]
        return n if all(len(set(b)) == 1 for b in blocks) and \
            len({b[0] for b in blocks}) == n else 1

    def _region(self, layer, tensor):
        return layer * len(self._meta[0]) + tensor

    # ------------------------------------------------------------ execute()'s parts
    def _check_expert(self, expert_id):
        try:
            expert = int(expert_id)
        except (TypeError, ValueError):
            raise _Failed("InvalidArgument", f"expert_id {expert_id!r} is not an "
                                             f"integer") from None
        if not 0 <= expert < eplb.MAX_EXPERTS:
            raise _Failed("InvalidArgument", f"expert_id {expert} of layer {self._layer} is "
                                             f"outside [0, {eplb.MAX_EXPERTS})")
        return expert

    def _check_rows(self, tensors, expert_id):
        torch = _torch()
        meta = self._meta[self._layer]
        try:
            rows = list(tensors)
        except TypeError:
            raise _Failed("InvalidArgument", f"add_recv(expert {expert_id}): tensors must be "
                                             f"a list of tensors") from None
        if len(rows) != len(meta):
            raise _Failed("InvalidArgument",
                          f"add_recv(expert {expert_id}) of layer {self._layer} gives "
                          f"{len(rows)} tensors; the layer has {len(meta)}")
        for t, (row, m) in enumerate(zip(rows, meta)):
            where = f"add_recv(expert {expert_id}) of layer {self._layer}, tensor {t}"
            if not isinstance(row, torch.Tensor):
                raise _Failed("InvalidArgument", f"{where} is a {type(row).__name__}")
            if row.device.type != "cpu":
                raise _Failed("NotSupported", f"{where} is on {row.device}: eplb's vLLM "
                                              f"communicator writes CPU tensors only")
            nbytes = row.numel() * row.element_size()
            if _dtype_name(row.dtype) != m["dtype"] or nbytes != m["stride"]:
                raise _Failed(
                    "InvalidArgument",
                    f"{where} is {_dtype_name(row.dtype)} {tuple(row.shape)} ({nbytes} bytes); "
                    f"an expert of the registered tensor is {m['dtype']} "
                    f"{tuple(m['shape'][1:])} ({m['stride']} bytes)")
            if not row.is_contiguous():
                raise _Failed("InvalidArgument", f"{where} is not contiguous")
        return rows

    def _agree(self, everyone, where):
        """The ranks move the same layer from the same old placement (when anything moves)."""
        layers = {m["layer"] for m in everyone if m["layer"] is not None}
        if len(layers) > 1:
            self._broken = "the ranks called execute() on different layers"
            raise eplb.InvalidArgument(
                "eplb communicator: the ranks are in different layers at execute() ("
                + ", ".join(f"rank {r}: {m['layer']}" for r, m in enumerate(everyone))
                + "): every rank must move the same layer at the same time")
        if not any(m["recv"] for m in everyone):
            return
        olds = [m["old"] for m in everyone]
        for r, o in enumerate(olds):
            if o is None:
                raise eplb.InvalidArgument(
                    f"eplb communicator, {where}: rank {r} called execute() without "
                    f"set_transfer_context() while other ranks receive experts")
            if o != olds[0]:
                raise eplb.InvalidArgument(
                    f"eplb communicator, {where}: rank {r}'s old placement (old_indices) "
                    f"differs from rank 0's; vLLM passes one global map to every rank")

    # ------------------------------------------------------------ collectives and failures
    def _seconds(self, deadline):
        return max(deadline - time.monotonic(), 0.0)

    def _gather(self, mine, deadline, what):
        try:
            parts = self._group.all_gather(json.dumps(mine).encode(), self._seconds(deadline))
        except (eplb.IoError, eplb.Timeout) as e:
            self._fail(e, what)
        return [json.loads(p.decode()) for p in parts]

    def _raise_errors(self, everyone, what):
        """Raises on every rank the first error a rank reported (all ranks see the same)."""
        errors = [(r, m["error"]) for r, m in enumerate(everyone) if m.get("error")]
        if not errors:
            return
        r, (kind, text) = errors[0]
        also = [str(x) for x, _ in errors[1:]]
        more = f" (ranks {', '.join(also)} failed too)" if also else ""
        raise _ERRORS.get(kind, eplb.Error)(f"eplb communicator, {what}: rank {r}: {text}{more}")

    def _fail(self, error, what):
        """A start-up collective failed (a peer gone, or too slow): name the ranks that are gone
        where the group could not, mark the communicator broken, and raise the same kind."""
        text = str(error)
        board = getattr(self, "_board", None)
        if "exited" not in text and board is not None:
            gone = board.unreachable(range(self.world_size))
            if gone:
                text += "; " + ", ".join(f"rank {p}" for p in gone) + \
                    (" no longer answers" if len(gone) == 1 else " no longer answer") + \
                    " one-sided reads"
        self._broken = f"{what}: {text}"
        raise type(error)(f"eplb communicator, {what}: {text}") from error

    def _usable(self):
        if self._broken is not None:
            raise eplb.IoError(f"eplb communicator of rank {self.rank} is unusable: "
                               f"{self._broken} (rebuild the group and the communicator)")


def plan_reads(old, demands, nodes=1, expert_bytes=1, where="layer"):
    """The reads that move one layer, and in how many rounds, by eplb's migration layer.

    old: int64 [ranks * slots], vLLM's phy2log of the layer before the move (-1: unused);
    demands: per rank, the distinct experts it receives (none it holds already). Returns
    (reads, rounds): ``reads`` the columns of ``eplb.plan_migration``'s reads ("src_rank",
    "src_slot", "dst_rank", "dst_slot", "expert", "round"), one read per (rank, expert), each
    from a holder eplb's planner chooses, in rounds where every rank talks to one peer at most
    (``peers_per_round=1, half_duplex=True``).

    The planner takes two placements: the old one, and here a new one in which every rank's
    slots hold, first, the experts it receives, then its old experts, so that its reads are
    exactly those transfers. Slots marked -1 hold an id no one asks for: never a source.
    Raises eplb.InvalidArgument for an expert no slot holds, or more experts than slots."""
    old = np.asarray(old, dtype=np.int64)
    ranks = len(demands)
    slots = old.shape[0] // ranks
    unused = max([int(old.max(initial=-1))] + [max(d) for d in demands if d]) + 1
    before = np.where(old < 0, unused, old)
    after = before.copy()
    held = set(before[before != unused].tolist())
    for r, experts in enumerate(demands):
        for e in experts:
            if e not in held:
                raise eplb.InvalidArgument(
                    f"eplb communicator, {where}: rank {r} receives expert {e}, which no slot "
                    f"of the old placement holds (a transfer with no source)")
        if len(experts) > slots:
            raise eplb.InvalidArgument(
                f"eplb communicator, {where}: rank {r} receives {len(experts)} distinct "
                f"experts, more than its {slots} slots")
        after[r * slots:r * slots + len(experts)] = experts
    plan = eplb.plan_migration(before[None], after[None], ranks, nodes, max(expert_bytes, 1), 1,
                               half_duplex=True)
    layer = plan["layers"][0]
    return layer["reads"], int(layer["rounds"])


def communicator_class(base=None):
    """``TransportCommunicator`` as a subclass of `base` as well (vLLM's ``EplbCommunicator``
    ABC, so ``isinstance`` checks hold), or itself when `base` is None."""
    if base is None or issubclass(TransportCommunicator, base):
        return TransportCommunicator
    if base not in _CLASSES:
        _CLASSES[base] = type("EplbTransportCommunicator", (TransportCommunicator, base),
                              {"__module__": __name__, "__doc__": TransportCommunicator.__doc__})
    return _CLASSES[base]


_CLASSES = {}  # base -> the class communicator_class made for it


def make_communicator(group_coordinator, expert_weights, cls=TransportCommunicator, **options):
    """The communicator for vLLM's ``create_eplb_communicator(group_coordinator, backend,
    expert_weights, expert_buffer)``: over the coordinator's CPU group. vLLM's stateless
    groups (elastic EP) raise eplb.NotSupported."""
    group = getattr(group_coordinator, "cpu_group", group_coordinator)
    from eplb._torch_group import is_process_group
    if not is_process_group(group):
        raise eplb.NotSupported(
            f"eplb's vLLM communicator runs on a torch.distributed CPU process group; this "
            f"group is a {type(group).__name__} (vLLM's stateless groups of elastic EP are not "
            f"supported: unset {ENV_COMMUNICATOR} to use vLLM's own communicator)")
    return cls(group, expert_weights, **options)


def install(replace_all=False):
    """Puts eplb's communicator into vLLM's ``create_eplb_communicator`` (the factory and the
    names ``eplb_state`` imported from it) under the backend name ``"eplb"``; with
    `replace_all`, for every backend name (vLLM's config admits only its own names). Returns
    the communicator class. Running it again is harmless. Raises ImportError without vLLM."""
    try:
        from vllm.distributed.eplb import eplb_communicator as factory_module
    except ImportError as e:
        raise ImportError(f"eplb.integrations.vllm_communicator.install() needs vLLM with "
                          f"vllm.distributed.eplb.eplb_communicator: {e}") from e
    original = getattr(factory_module.create_eplb_communicator, "_eplb_original",
                       factory_module.create_eplb_communicator)
    cls = communicator_class(getattr(factory_module, "EplbCommunicator", None))

    def create_eplb_communicator(group_coordinator, backend, expert_weights, expert_buffer):
        if backend != BACKEND and not replace_all:
            return original(group_coordinator, backend, expert_weights, expert_buffer)
        return make_communicator(group_coordinator, expert_weights, cls=cls)

    create_eplb_communicator._eplb_original = original
    create_eplb_communicator.__doc__ = original.__doc__
    factory_module.create_eplb_communicator = create_eplb_communicator
    try:
        from vllm.distributed.eplb import eplb_state
    except ImportError:
        eplb_state = None
    if eplb_state is not None and hasattr(eplb_state, "create_eplb_communicator"):
        eplb_state.create_eplb_communicator = create_eplb_communicator
    return cls


def install_from_env(environ=None):
    """What the package's vLLM plugin runs: with ``EPLB_VLLM_COMMUNICATOR=eplb``, install()
    for every EPLB model (whatever ``eplb_config.communicator`` says); unset, empty or "off":
    nothing. ``EPLB_VLLM_TRANSPORT`` and ``EPLB_VLLM_TIMEOUT`` are checked here too. Raises
    eplb.InvalidArgument naming the variable for any other value."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_COMMUNICATOR, "").strip().lower()
    if value in ("", "off"):
        return None
    if value != BACKEND:
        raise eplb.InvalidArgument(f"{ENV_COMMUNICATOR}={environ.get(ENV_COMMUNICATOR)!r}: "
                                   f"expected '{BACKEND}' (eplb's communicator) or 'off' "
                                   f"(vLLM's own)")
    _check_transport(environ.get(ENV_TRANSPORT) or None, ENV_TRANSPORT)
    if environ.get(ENV_TIMEOUT):
        _check_timeout(environ[ENV_TIMEOUT], ENV_TIMEOUT)
    cls = install(replace_all=True)
    _log.info("eplb: vLLM's EPLB communicator is now eplb's (%s=%s)", ENV_COMMUNICATOR, value)
    return cls
