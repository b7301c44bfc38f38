"""eplb's control plane on the engine's own group (``group=``).

An engine already runs a CPU group for its expert-parallel bookkeeping: vLLM's
``get_eplb_group().cpu_group``, a stateless gloo group it builds after a failure under elastic EP,
its ``StatelessProcessGroup``, SGLang's world group. eplb runs every collective it needs on it
(the start-up exchanges, the window all-reduce, the per-step agreement, barriers), so it joins no
rendezvous and opens no connection of its own for its control plane. Three kinds are taken:

- a torch.distributed ``ProcessGroup`` with the gloo backend, in torch's world map or not (a
  ``ProcessGroupGloo`` built on a store of the engine's, as vLLM's elastic EP builds them):
  ``TorchGroup`` calls the group's own methods, so torch.distributed need not be initialized;
- vLLM's ``StatelessProcessGroup`` (``rank``, ``world_size``, ``all_gather_obj``,
  ``broadcast_obj``, ``barrier``): ``StoreGroup``;
- any object with eplb's four collectives and its place in the group (``collectives()`` checks
  it): ``rank`` and ``size`` (or ``world_size``), attributes or methods, and

      barrier(seconds) -> None
      all_reduce(values: list[int], op: "min" | "max" | "sum", seconds) -> list[int]
      broadcast(data: bytes, root: int, seconds) -> bytes
      all_gather(data: bytes, seconds) -> list[bytes]   (one per rank, in rank order)

  `seconds` is what is left of the collective's deadline; raise eplb.Timeout when it passes,
  anything else for a failure. Optionally ``exited()``: the ranks known to be gone.

The C++ runtime calls these methods from one thread at a time (its control thread once serving;
the thread of connect() or reconfigure() at start-up), holding the interpreter lock only for
the call; a torch ``work.wait`` releases it while a collective is in flight. Collectives of one
group must be issued in the same order on every rank, and eplb issues its own from its control
thread: the group must be one the engine dedicates to EPLB (vLLM's is), never one the engine's
forward thread also uses.

A collective that fails (a peer gone, a connection closed) raises eplb.IoError, one that does
not finish by its deadline eplb.Timeout; the runtime then abandons the rebalance on every rank.
The message names the ranks of this machine whose process has exited. After a failure the
group's state is unknown (a collective may still be pending in gloo): build a new group to go
on (elastic serving: ``Rebalancer.reconfigure(group=new_group, members=seats)``).
"""

import datetime
import os
import socket
import sys
import time

from . import _eplb

InvalidArgument = _eplb.InvalidArgument

# eplb's collectives, as a group object offers them.
COLLECTIVES = ("barrier", "all_reduce", "broadcast", "all_gather")


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is what gave us the group
        raise InvalidArgument(f"group= needs torch.distributed: {e}") from e
    return dist


def is_process_group(group):
    """Whether `group` is a torch.distributed process group (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(group, dist.ProcessGroup)


def _not_a_member(group):
    """Whether `group` is torch's placeholder for a group this process is not a member of."""
    dist = sys.modules.get("torch.distributed")
    member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return member is not None and group is member


def _value(obj, *names):
    """The first of `names` `obj` has, called if it is a method; None when it has none."""
    for name in names:
        if hasattr(obj, name):
            value = getattr(obj, name)
            return value() if callable(value) else value
    return None


def _check_place(kind, rank, size, want_rank, want_size):
    """rank and size as the group reports them, against what the caller gave beside it."""
    if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(size, bool) or \
            not isinstance(size, int):
        raise InvalidArgument(f"group=: the {kind} reports rank {rank!r} and size {size!r}; "
                              f"integers expected")
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"group=: the {kind} reports rank {rank} of size {size}: this "
                              f"process must be a member (0 <= rank < size)")
    if want_size is not None and int(want_size) != size:
        raise InvalidArgument(f"the group has {size} ranks but world_size is {want_size} "
                              f"(eplb's ranks are the group's members)")
    if want_rank is not None and int(want_rank) != rank:
        raise InvalidArgument(f"this process is rank {rank} of the group but rank is "
                              f"{want_rank} (eplb's rank is the process's rank in the group)")


def collectives(group, rank=None, world_size=None):
    """eplb's collectives on the engine's `group` (any of the kinds above): an object with
    ``rank``, ``size`` and the four methods. InvalidArgument naming what is missing or what
    contradicts `rank` / `world_size`."""
    if _not_a_member(group):
        raise InvalidArgument("group=: this process is not a member of the group "
                              "(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER "
                              "here): pass a group this rank belongs to")
    if is_process_group(group):
        return TorchGroup(group, rank, world_size)
    if all(hasattr(group, m) for m in ("all_gather_obj", "broadcast_obj", "barrier")) and \
            hasattr(group, "world_size") and not all(hasattr(group, m) for m in COLLECTIVES[1:]):
        return StoreGroup(group, rank, world_size)
    missing = [m for m in COLLECTIVES if not callable(getattr(group, m, None))]
    place = [n for n, names in (("rank", ("rank",)), ("size", ("size", "world_size")))
             if not any(hasattr(group, a) for a in names)]
    if missing or place:
        what = ", ".join([f"{m}()" for m in missing] + place)
        raise InvalidArgument(
            f"group= is a {type(group).__name__} without {what}: eplb's control plane needs "
            f"a torch.distributed gloo ProcessGroup, vLLM's StatelessProcessGroup, or an object "
            f"with rank, size and the collectives {', '.join(m + '()' for m in COLLECTIVES)} "
            f"(docs/embedding.md, \"Collectives\")")
    return PythonGroup(group, rank, world_size)


class PythonGroup:
    """An engine's object with eplb's collectives itself (the protocol above), as it is."""

    def __init__(self, group, rank=None, world_size=None):
        self.group = group
        self.rank = _value(group, "rank")
        self.size = _value(group, "size", "world_size")
        _check_place(type(group).__name__, self.rank, self.size, rank, world_size)
        self.backend = str(getattr(group, "backend", None) or type(group).__name__)

    def barrier(self, seconds):
        return self.group.barrier(seconds)

    def all_reduce(self, values, op, seconds):
        return self.group.all_reduce(values, op, seconds)

    def broadcast(self, data, root, seconds):
        return self.group.broadcast(data, root, seconds)

    def all_gather(self, data, seconds):
        return self.group.all_gather(data, seconds)

    def exited(self, wait=0.5):
        fn = getattr(self.group, "exited", None)
        return list(fn()) if callable(fn) else []


class StoreGroup:
    """eplb's collectives on vLLM's StatelessProcessGroup: a group of objects over a TCPStore
    (``all_gather_obj``, ``broadcast_obj``, ``barrier``), the group vLLM's elastic EP keeps its
    metadata on. The store's own timeout bounds each collective (it cannot take a deadline);
    a store error whose message says it timed out becomes eplb.Timeout."""

    backend = "stateless"

    def __init__(self, group, rank=None, world_size=None):
        self.group = group
        self.rank = _value(group, "rank")
        self.size = _value(group, "world_size")
        _check_place(type(group).__name__, self.rank, self.size, rank, world_size)

    def _call(self, what, fn, *args, **kwargs):
        import eplb
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the store's errors are plain RuntimeErrors
            text = str(e).strip()
            if "timeout" in text.lower() or "timed out" in text.lower():
                raise eplb.Timeout(f"control {what}: the StatelessProcessGroup did not finish on "
                                   f"rank {self.rank}: {text}") from e
            raise eplb.IoError(f"control {what}: the StatelessProcessGroup failed on rank "
                               f"{self.rank}: {text}") from e

    def barrier(self, seconds):
        self._call("barrier", self.group.barrier, timeout=max(seconds, 0.001))

    def all_reduce(self, values, op, seconds):
        parts = self._call("all_reduce", self.group.all_gather_obj, [int(v) for v in values])
        reduce = {"min": min, "max": max, "sum": sum}[op]
        return [int(reduce(p[i] for p in parts)) for i in range(len(values))]

    def broadcast(self, data, root, seconds):
        return bytes(self._call("broadcast", self.group.broadcast_obj,
                                bytes(data) if self.rank == root else None, src=root))

    def all_gather(self, data, seconds):
        return [bytes(p) for p in self._call("all_gather", self.group.all_gather_obj,
                                             bytes(data))]

    def exited(self, wait=0.5):
        return []


class TorchGroup:
    """The collectives of eplb's control plane on a torch.distributed gloo process group, in
    torch's world map or not: the group's own methods (allreduce, allgather, broadcast), with
    the group's ranks.

    rank and world_size, when given, must be the group's: a group of another size or in which
    this process has another rank is refused before anything runs on it."""

    backend = "torch"

    def __init__(self, group, rank=None, world_size=None):
        dist = _dist()
        backend = self._backend_name(group)
        if backend is not None and "gloo" not in backend:
            raise InvalidArgument(
                f"group= uses the {backend} backend; eplb's control plane runs on the CPU: give "
                f"a gloo group (vLLM's get_eplb_group().cpu_group, "
                f"torch.distributed.new_group(ranks, backend='gloo'), or a ProcessGroupGloo)")
        self.group = group
        self._dist = dist
        _check_place("process group", group.rank(), group.size(), rank, world_size)
        self.rank = group.rank()
        self.size = group.size()
        self._peers = None  # (host, pid) of every rank, gathered at the first collective

    @staticmethod
    def _backend_name(group):
        name = getattr(group, "name", None)
        try:
            if callable(name):
                return str(name()).lower()
        except RuntimeError:
            pass
        dist = _dist()
        try:  # a group of the world map whose object does not say it
            return str(dist.get_backend(group)).lower()
        except (RuntimeError, ValueError):
            return None

    # ---------------------------------------------------------------- the collectives
    def barrier(self, seconds):
        self._peers_known(seconds)
        import torch
        t = torch.zeros(1, dtype=torch.int64)
        self._wait(self._all_reduce_work(t, "sum"), seconds, "barrier")

    def all_reduce(self, values, op, seconds):
        self._peers_known(seconds)
        import torch
        t = torch.tensor(values, dtype=torch.int64)
        self._wait(self._all_reduce_work(t, op), seconds, "all_reduce")
        return t.tolist()

    def _all_reduce_work(self, t, op):
        dist = self._dist
        options = dist.AllreduceOptions()
        options.reduceOp = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
                            "sum": dist.ReduceOp.SUM}[op]
        return self.group.allreduce([t], options)

    def broadcast(self, data, root, seconds):
        self._peers_known(seconds)
        import torch
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(self._broadcast_work(n, root), seconds, "broadcast")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root and \
            len(data) else torch.zeros(int(n), dtype=torch.uint8)
        if int(n):
            self._wait(self._broadcast_work(buf, root), seconds, "broadcast")
        return bytes(buf.numpy().tobytes())

    def _broadcast_work(self, t, root):
        options = self._dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        return self.group.broadcast([t], options)

    def all_gather(self, data, seconds):
        self._peers_known(seconds)
        return self._all_gather(data, seconds)

    def _all_gather(self, data, seconds):
        import torch
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(self.group.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]),
                   seconds, "all_gather")
        width = max(int(s) for s in sizes)
        if width == 0:
            return [b""] * self.size
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [mine]), seconds, "all_gather")
        return [bytes(p[:int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]

    # ---------------------------------------------------------------- failures
    def _peers_known(self, seconds):
        # Who runs each rank, for naming a rank whose process is gone: exchanged once, on the
        # group, before eplb's first collective (every rank makes it first too).
        if self._peers is None:
            me = f"{socket.gethostname()} {os.getpid()}".encode()
            parts = self._all_gather(me, seconds)
            peers = []
            for p in parts:
                host, _, pid = p.decode().rpartition(" ")
                peers.append((host, int(pid)))
            self._peers = peers

    def _wait(self, work, seconds, what):
        import eplb
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(seconds, 0.001)))
        except RuntimeError as e:
            text = str(e)
            gone = self.gone()
            where = f"; {gone}" if gone else ""
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise eplb.Timeout(f"control {what}: the torch group (gloo) did not finish within "
                                   f"{seconds:.1f} s on rank {self.rank}{where}") from e
            raise eplb.IoError(f"control {what}: the torch group (gloo) failed on rank "
                               f"{self.rank}: {text.strip()}{where}") from e

    def exited(self, wait=0.5):
        """The ranks of this machine (other than this one) whose process has exited. A process
        being killed closes its connections before it is gone from the process table: when
        none is found, look again for up to `wait` seconds."""
        if not self._peers:
            return []
        here = socket.gethostname()
        deadline = time.monotonic() + wait
        while True:
            dead = [r for r, (host, pid) in enumerate(self._peers)
                    if host == here and r != self.rank and not _alive(pid)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def gone(self):
        """A sentence naming the ranks of this machine whose process has exited, or ""."""
        dead = [f"rank {r} (pid {self._peers[r][1]})" for r in self.exited()]
        if not dead:
            return ""
        return ", ".join(dead) + (" has" if len(dead) == 1 else " have") + " exited"


class WatchedTorchGroup(TorchGroup):
    """A TorchGroup whose waits watch the peers. A gloo collective whose peer died fails at
    once on the ranks that exchange data with that peer, but a rank waiting on a survivor that
    gave up waits for its whole timeout. Here a rank, while it waits, looks every 50 ms for
    ranks of its machine whose process has exited and fails at once naming them; at the
    deadline it names the ranks of its machine that are stopped as well. The collective itself
    is left to gloo: after a failure the group must be rebuilt, as TorchGroup's are."""

    def _wait(self, work, seconds, what):
        import eplb
        start = time.monotonic()
        deadline = start + max(seconds, 0.001)
        pause, look = 1e-5, start + 0.05
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                where = "; ".join(x for x in (self.gone(), self.stopped()) if x)
                raise eplb.Timeout(f"control {what}: the torch group (gloo) did not finish "
                                   f"within {seconds:.1f} s on rank {self.rank}"
                                   + (f"; {where}" if where else ""))
            if now >= look:
                dead = self.exited(wait=0)
                if dead:
                    raise eplb.IoError(f"control {what}: {self._named(dead)} exited while "
                                       f"rank {self.rank} waited for the torch group")
                look = now + 0.05
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        super()._wait(work, max(deadline - time.monotonic(), 0.001), what)

    def _named(self, ranks):
        return ", ".join(f"rank {r} (pid {self._peers[r][1]})" for r in ranks) + \
            (" has" if len(ranks) == 1 else " have")

    def stopped(self):
        """A sentence naming the ranks of this machine whose process is stopped, or ""."""
        if not self._peers:
            return ""
        here = socket.gethostname()
        ranks = [r for r, (host, pid) in enumerate(self._peers)
                 if host == here and r != self.rank and _stopped(pid)]
        return f"{self._named(ranks)} stopped (SIGSTOP or a debugger)" if ranks else ""


def _stopped(pid):
    """Whether process `pid` is stopped (a signal or a tracer)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _alive(pid):
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
