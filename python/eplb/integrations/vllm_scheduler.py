"""eplb's migration schedule as a drop-in for vLLM's migration scheduler.

vLLM (0.34 and later) packs the expert transfers of one rebalanced layer into batches in
``vllm.distributed.eplb.migration_scheduler``:

    schedule_migration_batches(num_local_experts, old_indices, new_indices)
        -> list[list[MigrationFlow]]
    schedule_migration_batches_for_layers(num_local_experts, old_indices, new_indices)
        -> list[list[list[MigrationFlow]]]

``old_indices`` and ``new_indices`` are phy2log maps (int [num_physical], or [layers,
num_physical] for the second), the ranks' slots in order, ``num_local_experts`` slots per rank,
-1 for a slot that holds no expert. A ``MigrationFlow(src_rank, dst_rank, expert_ids)`` moves
experts from one rank to another; within a batch every rank talks to one peer at most, both
directions counted together, and a batch lasts as long as its largest flow.

The functions here keep that contract and that signature and compute the batches with eplb's
half-duplex schedule (``eplb.plan_migration(..., peers_per_round=1, half_duplex=True)``, one
node): the same transfers (one per expert a rank gains: an expert it already holds in another
slot is copied locally and one it needs in two slots is received once), each from the holder
that keeps the busiest rank's transfers lowest, coloured one transfer at a time into batches.
vLLM's own scheduler coalesces each rank pair's transfers and places whole flows first-fit; on
DeepSeek-V3's layouts eplb's batches take about half its time (docs/performance.md).

Differences a caller can see: batches come in another order and number (the transfers of one
rank pair may be split over several batches, which never makes the layer slower); flows within
a batch are ordered by (src_rank, dst_rank), a flow's experts ascending. Bad input raises
``ScheduleError`` (an ``eplb.InvalidArgument`` and an ``AssertionError``, which vLLM's scheduler
raises for maps of different shapes) where vLLM's would go on: an expert id that is neither -1
nor in [0, eplb.MAX_EXPERTS), and an expert that a rank gains but that no slot of the old map
holds (vLLM skips that transfer, and the rank's slot is left with stale weights).

``MigrationFlow`` is vLLM's class where vLLM can be imported (so batches compare equal to
vLLM's), else a frozen dataclass with the same fields. ``install`` puts these functions in
vLLM's place; the package's vLLM plugin does it when ``EPLB_VLLM_SCHEDULER=eplb``.
"""

import dataclasses
import importlib
import importlib.util
import logging
import os
import sys

import numpy as np

import eplb

__all__ = [
    "MigrationFlow", "ScheduleError", "schedule_migration_batches",
    "schedule_migration_batches_for_layers", "install", "uninstall", "scheduler_from_env",
    "install_from_env", "ENV_SCHEDULER",
]

_log = logging.getLogger(__name__)

ENV_SCHEDULER = "EPLB_VLLM_SCHEDULER"
_VLLM_MODULE = "vllm.distributed.eplb.migration_scheduler"
# Where vLLM 0.34 binds the scheduler's names by `from ... import`: each keeps its own reference.
_VLLM_IMPORTERS = ("vllm.distributed.eplb.rebalance_execute",
                   "vllm.distributed.eplb.async_worker")
_NAMES = ("schedule_migration_batches", "schedule_migration_batches_for_layers")


class ScheduleError(eplb.InvalidArgument, AssertionError):
    """Bad input to the scheduler: an eplb.InvalidArgument (so a ValueError) and an
    AssertionError, the exception vLLM's scheduler raises for maps of different shapes."""


@dataclasses.dataclass(frozen=True, slots=True)
class _MigrationFlow:
    """Expert transfers from one rank to another (vLLM's MigrationFlow, where vLLM is absent)."""

    src_rank: int
    dst_rank: int
    expert_ids: tuple[int, ...]


_MigrationFlow.__name__ = _MigrationFlow.__qualname__ = "MigrationFlow"
_flow_type = None  # the class batches are made of, found on first use


def _find_flow_type():
    """vLLM's MigrationFlow when vLLM can be imported, else eplb's own."""
    module = sys.modules.get(_VLLM_MODULE)
    if module is None and importlib.util.find_spec("vllm") is not None:
        try:
            module = importlib.import_module(_VLLM_MODULE)
        except Exception as e:  # an older vLLM, or one that cannot be imported here
            _log.debug("eplb: vLLM's MigrationFlow is not importable (%s); using eplb's own", e)
    flow = getattr(module, "MigrationFlow", None)
    return flow if isinstance(flow, type) else _MigrationFlow


def _flow():
    global _flow_type
    if _flow_type is None:
        _flow_type = _find_flow_type()
    return _flow_type


def __getattr__(name):
    if name == "MigrationFlow":
        return _flow()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as_map(indices, name):
    """An int64 numpy copy of a phy2log map (numpy, torch or nested lists)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    a = np.asarray(indices)
    if a.dtype.kind not in "iu":
        raise ScheduleError(f"{name} must hold integer expert ids (-1: an empty slot), got dtype "
                            f"{a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_ids(a, name):
    """Refuses an id that is neither -1 (an empty slot) nor an expert eplb can hold."""
    bad = (a != -1) & ((a < 0) | (a >= eplb.MAX_EXPERTS))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        where = "".join(f"[{i}]" for i in at)
        raise ScheduleError(f"{name}{where} is {int(a[at])}: an expert id must be in [0, "
                            f"{eplb.MAX_EXPERTS}), or -1 for a slot that holds no expert")


def _maps(num_local_experts, old_indices, new_indices, ndim):
    """The checked maps, [layers, num_physical], and the number of ranks."""
    old = _as_map(old_indices, "old_indices")
    new = _as_map(new_indices, "new_indices")
    shape = "[num_physical]" if ndim == 1 else "[layers, num_physical]"
    if old.shape != new.shape:
        raise ScheduleError(f"old_indices has shape {tuple(old.shape)} and new_indices "
                            f"{tuple(new.shape)}: both maps must have the same shape {shape}")
    if old.ndim != ndim:
        other = ("schedule_migration_batches_for_layers takes [layers, num_physical]"
                 if ndim == 1 else "schedule_migration_batches takes one layer's map")
        raise ScheduleError(f"the maps have shape {tuple(old.shape)}, expected {shape} "
                            f"({other})")
    if isinstance(num_local_experts, bool) or not isinstance(num_local_experts,
                                                              (int, np.integer)):
        raise TypeError(f"num_local_experts must be an integer, got {num_local_experts!r}")
    if num_local_experts < 1:
        raise ScheduleError(f"num_local_experts {num_local_experts} must be at least 1")
    physical = old.shape[-1]
    if physical % num_local_experts:
        raise ScheduleError(f"the maps have {physical} slots per layer, not a multiple of "
                            f"num_local_experts {num_local_experts} (every rank holds the same "
                            f"number of slots)")
    _check_ids(old, "old_indices")
    _check_ids(new, "new_indices")
    if ndim == 1:
        old, new = old[None], new[None]
    return old, new, physical // int(num_local_experts)


def _check_sources(old, new, num_local_experts, single):
    """Refuses a transfer with no source: an expert a slot needs that no old slot holds."""
    for layer, (o, n) in enumerate(zip(old, new)):
        missing = (n >= 0) & ~np.isin(n, o)
        if missing.any():
            slot = int(np.flatnonzero(missing)[0])
            where = "" if single else f"layer {layer}: "
            raise ScheduleError(
                f"{where}new_indices puts expert {int(n[slot])} in slot {slot} (rank "
                f"{slot // num_local_experts}) but no slot of old_indices holds it: a transfer "
                f"with no source (every expert of the new map must have a replica in the old)")


def _without_empty_slots(old, new):
    """Maps eplb's planner takes (no -1): an empty old slot holds an expert no one needs, an
    empty new slot keeps what it holds. Neither adds nor removes a transfer."""
    if not (old == -1).any() and not (new == -1).any():
        return old, new
    used = np.union1d(old[old >= 0], new[new >= 0])
    unused = int(used[-1]) + 1 if used.size else 0
    if unused >= eplb.MAX_EXPERTS:
        free = np.setdiff1d(np.arange(used.size + 1), used)
        unused = int(free[0])
    old = np.where(old == -1, unused, old)
    new = np.where(new == -1, old, new)
    return old, new


def _batches(layer, flow):
    """One layer of eplb.plan_migration's result as vLLM's batches of flows."""
    reads = layer["reads"]
    rounds = {}
    for r, src, dst, expert in zip(reads["round"].tolist(), reads["src_rank"].tolist(),
                                   reads["dst_rank"].tolist(), reads["expert"].tolist()):
        rounds.setdefault(r, {}).setdefault((src, dst), []).append(expert)
    return [[flow(src, dst, tuple(sorted(experts)))
             for (src, dst), experts in sorted(rounds[r].items())]
            for r in sorted(rounds)]


def _schedule(num_local_experts, old, new, ranks, single):
    _check_sources(old, new, num_local_experts, single)
    if old.shape[1] == 0:
        return [[] for _ in range(old.shape[0])]
    old, new = _without_empty_slots(old, new)
    plan = eplb.plan_migration(old, new, ranks, 1, 1, 1, half_duplex=True)
    flow = _flow()
    return [_batches(layer, flow) for layer in plan["layers"]]


def schedule_migration_batches(num_local_experts, old_indices, new_indices):
    """vLLM's ``schedule_migration_batches``, eplb's schedule: the transfers of one layer in
    batches where every rank talks to one peer at most.

    Parameters:
        num_local_experts: slots per rank
        old_indices, new_indices: int [num_physical] phy2log maps of the layer (numpy, torch or
            a list), rank by rank; -1: a slot that holds no expert

    Returns a list of batches, each a list of MigrationFlow(src_rank, dst_rank, expert_ids):
    every expert a rank gains (holds in new_indices, not in old_indices) arrives once, from a
    rank that holds it in old_indices. Raises ScheduleError on maps of different shapes, an id
    that is neither -1 nor in [0, eplb.MAX_EXPERTS), or an expert gained that no rank holds."""
    old, new, ranks = _maps(num_local_experts, old_indices, new_indices, 1)
    return _schedule(int(num_local_experts), old, new, ranks, True)[0]


def schedule_migration_batches_for_layers(num_local_experts, old_indices, new_indices):
    """vLLM's ``schedule_migration_batches_for_layers``: ``schedule_migration_batches`` of
    every layer of [layers, num_physical] maps, in one call (one eplb.plan_migration)."""
    old, new, ranks = _maps(num_local_experts, old_indices, new_indices, 2)
    return _schedule(int(num_local_experts), old, new, ranks, False)


_originals = {}  # vLLM's functions, while eplb's are installed


def _modules_binding(function):
    """vLLM's modules (imported so far) that hold `function` under one of the names."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("vllm"):
            for name in _NAMES:
                if getattr(module, name, None) is function.get(name):
                    yield module, name


def install():
    """Puts eplb's schedule_migration_batches and schedule_migration_batches_for_layers in
    vLLM's place: in vllm.distributed.eplb.migration_scheduler and in every vLLM module that
    imported them from there (rebalance_execute, async_worker). Returns the names of the
    modules changed. Running it again is harmless. Raises ImportError when vLLM, or its
    migration scheduler (vLLM 0.34 and later), cannot be imported."""
    try:
        module = importlib.import_module(_VLLM_MODULE)
    except ImportError as e:
        raise ImportError(f"eplb's migration schedule replaces vLLM's {_VLLM_MODULE} (vLLM 0.34 "
                          f"and later), which is not importable here: {e}") from e
    for importer in _VLLM_IMPORTERS:
        try:
            importlib.import_module(importer)
        except ImportError as e:
            _log.debug("eplb: %s is not importable (%s)", importer, e)
    ours = {"schedule_migration_batches": schedule_migration_batches,
            "schedule_migration_batches_for_layers": schedule_migration_batches_for_layers}
    if not _originals:
        for name in _NAMES:
            if getattr(module, name, None) is None:
                raise ImportError(f"this vLLM's {_VLLM_MODULE} has no {name}")
            _originals[name] = getattr(module, name)
    changed = set()
    for target, name in list(_modules_binding(_originals)):
        setattr(target, name, ours[name])
        changed.add(target.__name__)
    return sorted(changed | {m.__name__ for m, _ in _modules_binding(ours)})


def uninstall():
    """Gives vLLM its own scheduler back wherever install() put eplb's."""
    if not _originals:
        return []
    ours = {"schedule_migration_batches": schedule_migration_batches,
            "schedule_migration_batches_for_layers": schedule_migration_batches_for_layers}
    changed = set()
    for target, name in list(_modules_binding(ours)):
        setattr(target, name, _originals[name])
        changed.add(target.__name__)
    _originals.clear()
    return sorted(changed)


def scheduler_from_env(environ=None):
    """Whether ``EPLB_VLLM_SCHEDULER`` asks for eplb's schedule: "eplb" yes; unset, empty,
    "off" or "vllm" no (vLLM keeps its own). Raises eplb.InvalidArgument naming the variable
    for any other value."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_SCHEDULER, "")
    value = raw.strip().lower()
    if value in ("", "off", "0", "none", "vllm"):
        return False
    if value == "eplb":
        return True
    raise eplb.InvalidArgument(f"{ENV_SCHEDULER}={raw!r} is not 'eplb' (eplb's migration "
                               f"schedule) or 'vllm' / off / unset (vLLM keeps its own)")


def install_from_env(environ=None):
    """install() when ``EPLB_VLLM_SCHEDULER=eplb`` (see scheduler_from_env); else nothing.
    Returns the modules changed, or None."""
    if not scheduler_from_env(environ):
        return None
    changed = install()
    _log.info("eplb: vLLM's migration scheduler is now eplb's (%s=eplb; in %s)", ENV_SCHEDULER,
              ", ".join(changed))
    return changed
