"""eplb's control plane on the engine's own torch.distributed process group.

An engine already runs a CPU (gloo) process group for its expert-parallel bookkeeping: vLLM's
``get_eplb_group().cpu_group``, SGLang's world group. ``TorchGroup`` runs every collective eplb
needs on it (the start-up exchanges, the window all-reduce, the per-step agreement, barriers),
so eplb joins no rendezvous and opens no connection of its own for its control plane.

The C++ runtime calls these methods from one thread at a time (its control thread once serving;
the thread of connect() or reconfigure() at start-up), holding the interpreter lock only for
the call; ``work.wait`` releases it while a collective is in flight. Collectives of one group
must be issued in the same order on every rank, and eplb issues its own from its control
thread: the group must be one the engine dedicates to EPLB (vLLM's is), never one the engine's
forward thread also uses.

A collective that fails (a peer gone, a connection closed) raises eplb.IoError, one that does
not finish by its deadline eplb.Timeout; the runtime then abandons the rebalance on every rank.
The message names the ranks of this machine whose process has exited. After a failure the
group's state is unknown (a collective may still be pending in gloo): build a new group to go
on (elastic serving: Rebalancer.reconfigure(..., group=new_group)).
"""

import datetime
import os
import socket
import time

from . import _eplb

InvalidArgument = _eplb.InvalidArgument


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is what gave us the group
        raise InvalidArgument(f"group= needs torch.distributed: {e}") from e
    return dist


def is_process_group(group):
    """Whether `group` is a torch.distributed process group (without importing torch)."""
    import sys
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(group, dist.ProcessGroup)


class TorchGroup:
    """The collectives of eplb's control plane on a torch.distributed gloo process group.

    rank and world_size, when given, must be the group's: a group of another size or in which
    this process has another rank is refused before anything runs on it."""

    backend = "torch"

    def __init__(self, group, rank=None, world_size=None):
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgument("group= is a torch.distributed process group, but "
                                  "torch.distributed is not initialized in this process "
                                  "(init_process_group first)")
        backend = str(dist.get_backend(group)).lower()
        if "gloo" not in backend:
            raise InvalidArgument(
                f"group= uses the {backend} backend; eplb's control plane runs on the CPU: give "
                f"a gloo group (vLLM's get_eplb_group().cpu_group, or "
                f"torch.distributed.new_group(ranks, backend='gloo'))")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise InvalidArgument("group=: this process is not a member of the group")
        if world_size is not None and int(world_size) != self.size:
            raise InvalidArgument(f"the group has {self.size} ranks but world_size is "
                                  f"{world_size} (eplb's ranks are the group's members)")
        if rank is not None and int(rank) != self.rank:
            raise InvalidArgument(f"this process is rank {self.rank} of the group but rank is "
                                  f"{rank} (eplb's rank is the process's rank in the group)")
        self._global = [self._global_rank(r) for r in range(self.size)]
        self._peers = None  # (host, pid) of every rank, gathered at the first collective

    def _global_rank(self, group_rank):
        dist = _dist()
        get = getattr(dist, "get_global_rank", None) or \
            getattr(dist.distributed_c10d, "_get_global_rank")
        try:
            return get(self.group, group_rank)
        except (RuntimeError, ValueError):
            return group_rank  # the default (world) group: the same numbers

    # ---------------------------------------------------------------- the collectives
    def barrier(self, seconds):
        self._peers_known(seconds)
        import torch
        t = torch.zeros(1, dtype=torch.int64)
        self._wait(_dist().all_reduce(t, group=self.group, async_op=True), seconds, "barrier")

    def all_reduce(self, values, op, seconds):
        self._peers_known(seconds)
        import torch
        dist = _dist()
        ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
        t = torch.tensor(values, dtype=torch.int64)
        self._wait(dist.all_reduce(t, op=ops[op], group=self.group, async_op=True), seconds,
                   "all_reduce")
        return t.tolist()

    def broadcast(self, data, root, seconds):
        self._peers_known(seconds)
        import torch
        dist = _dist()
        src = self._global[root]
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(dist.broadcast(n, src=src, group=self.group, async_op=True), seconds,
                   "broadcast")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root and \
            len(data) else torch.zeros(int(n), dtype=torch.uint8)
        if int(n):
            self._wait(dist.broadcast(buf, src=src, group=self.group, async_op=True), seconds,
                       "broadcast")
        return bytes(buf.numpy().tobytes())

    def all_gather(self, data, seconds):
        self._peers_known(seconds)
        return self._all_gather(data, seconds)

    def _all_gather(self, data, seconds):
        import torch
        dist = _dist()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64),
                                   group=self.group, async_op=True), seconds, "all_gather")
        width = max(int(s) for s in sizes)
        if width == 0:
            return [b""] * self.size
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, mine, group=self.group, async_op=True), seconds,
                   "all_gather")
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
