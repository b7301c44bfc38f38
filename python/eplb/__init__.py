"""eplb: expert-parallel load balancing for Mixture-of-Experts inference.

A drop-in for deepseek-ai/EPLB's ``rebalance_experts`` (same signature, same outputs), better
placement policies, the placement metrics, and the migration planner, all computed in C++ with
the GIL released. Inputs may be numpy arrays, nested lists or torch tensors; torch is imported
only when a torch tensor is passed in.

``Rebalancer`` is the runtime an engine embeds: it records loads, serves dispatch tables, holds
the expert weights and rebalances them while the engine serves, and goes on serving when a
rank is lost (``Rebalancer.reconfigure``, ``Rebalancer.join``; see ``eplb.runtime``).

Words (as in the C++ library): layer ``l``, logical expert ``e`` (``E`` per layer), physical
slot ``p`` (``P`` per layer), rank ``g`` (``G``, a GPU: slot ``p`` is on rank ``p // (P // G)``),
node (``N``), group (DeepSeek's expert groups).

Errors: ``eplb.InvalidArgument`` (also a ``ValueError``) for bad input, with the library's
message; ``eplb.Error`` is the base of ``InvalidArgument``, ``NotSupported``, ``IoError`` and
``Timeout``.
"""

import importlib
import operator
import sys
from collections import namedtuple

import numpy as np

try:
    _eplb = importlib.import_module(__name__ + "._eplb")
except ModuleNotFoundError as first:
    # The extension may also sit in a folder of its own on sys.path (next to a build tree's
    # copy of this package rather than in it); accept that layout too.
    try:
        _eplb = importlib.import_module("_eplb")
    except ModuleNotFoundError:
        raise ImportError(
            "eplb's extension module _eplb was not found: build it with CMake "
            "(EPLB_WITH_PYTHON=ON) and put <build>/python on PYTHONPATH, or `pip install .` "
            "from the repository") from first

__version__ = _eplb.__version__

Error = _eplb.Error
InvalidArgument = _eplb.InvalidArgument
NotSupported = _eplb.NotSupported
IoError = _eplb.IoError
Timeout = _eplb.Timeout

# Migration action codes: plan_migration()'s per-slot "action" array holds indices into this.
ACTIONS = _eplb.ACTIONS

Balancedness = namedtuple("Balancedness", ["per_layer", "mean", "step"])
Balancedness.__doc__ = """Balancedness of a placement under a load.

per_layer: float64 [layers], mean rank load / max rank load of each layer, in (0, 1]
mean: float, the mean of per_layer (a run's figure)
step: float, sum over layers of the mean rank load / sum of the max rank load
"""

LowerBound = namedtuple("LowerBound", ["per_layer", "balancedness", "balancedness_mean"])
LowerBound.__doc__ = """The best any placement can do on a load.

per_layer: float64 [layers], the smallest max rank load any placement can reach:
    max(total / G, min over replica counts summing to P of max_e w_e / r_e)
balancedness: float64 [layers], mean rank load / per_layer, the best reachable balancedness
balancedness_mean: float, the mean of balancedness
"""

# The largest deployment the library takes (eplb/core/types.h): experts and physical slots per
# layer, ranks, layers. Inputs past them are refused before anything is sized.
MAX_EXPERTS = _eplb.MAX_EXPERTS
MAX_PHYSICAL = _eplb.MAX_PHYSICAL
MAX_RANKS = _eplb.MAX_RANKS
MAX_LAYERS = _eplb.MAX_LAYERS

NO_AGREEMENT = _eplb.NO_AGREEMENT
control_backends = _eplb.control_backends
transport_backends = _eplb.transport_backends

__all__ = [
    "Rebalancer", "empty", "NO_AGREEMENT", "control_backends", "transport_backends", "rebalance_experts", "balancedness", "lower_bound", "plan_migration", "should_rebalance", "Balancedness",
    "LowerBound", "ACTIONS", "Error", "InvalidArgument", "NotSupported", "IoError", "Timeout",
]


def _is_torch(x):
    # A tensor can only exist if torch is already imported: never import it for other inputs.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _to_numpy(x):
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return x


# Loads are doubles: an integer count above 2^53 would be rounded, so it is refused, as the load
# files refuse it (stats/load_file.h).
_MAX_EXACT_LOAD = 2**53


def _check_exact(a, name):
    """Raises InvalidArgument where the integer array `a` holds a count a double would round."""
    if a.dtype.kind not in "iu" or a.size == 0:
        return
    big = a > _MAX_EXACT_LOAD
    if a.dtype.kind == "i":
        big |= a < -_MAX_EXACT_LOAD
    if big.any():
        at = tuple(int(i) for i in np.argwhere(big)[0])
        raise InvalidArgument(f"{name}{list(at)} is {int(a[at])}, above 2^53 = {_MAX_EXACT_LOAD}, "
                              f"the largest integer a double holds exactly (eplb holds loads as "
                              f"doubles and would round it)")


def _torch_load_numpy(weight, name):
    """A float64 numpy copy of the torch tensor of loads `weight` (any device and real dtype);
    integer counts a double would round are refused."""
    import torch
    if weight.is_complex() or weight.dtype == torch.bool:
        raise InvalidArgument(f"{name} must hold real-valued loads, got dtype {weight.dtype}")
    w = weight.detach().to(device="cpu")
    if not w.is_floating_point():
        _check_exact(w.to(dtype=torch.int64).numpy(), name)
    # float64 holds every float32/float16/bfloat16 load exactly, and integers up to 2^53; the
    # C++ side rounds to float32 where the reference does.
    return w.to(dtype=torch.float64).contiguous().numpy()


def _as_load(weight, name="weight"):
    """A C-contiguous float64 [layers, experts] copy or view of `weight`."""
    if _is_torch(weight):
        w = _torch_load_numpy(weight, name)
    else:
        try:
            a = np.asarray(weight)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"{name} must be a numeric [layers, experts] array: {e}") from e
        # Real numbers only: a complex load would lose its imaginary part (with a warning),
        # strings, objects and booleans are no loads (a torch bool tensor is refused too).
        if a.dtype.kind not in "iuf" and not (a.dtype.kind == "O" and a.size == 0):
            raise InvalidArgument(f"{name} must be a numeric [layers, experts] array of real "
                                  f"numbers (integers or floats), got dtype {a.dtype}")
        _check_exact(a, name)
        w = np.ascontiguousarray(a, dtype=np.float64)
    if w.ndim != 2:
        raise InvalidArgument(
            f"{name} must be a 2-D [layers, experts] array, got shape {tuple(w.shape)}")
    return w


def _as_phy2log(phy2log, name):
    """A C-contiguous int64 [layers, physical] array; integer dtypes only."""
    a = np.asarray(_to_numpy(phy2log))
    if a.dtype.kind not in "iu":
        if a.size == 0 and a.dtype.kind == "f":
            a = a.astype(np.int64)
        else:
            raise InvalidArgument(
                f"{name} must hold integer expert ids, got dtype {a.dtype}")
    if a.ndim != 2:
        raise InvalidArgument(
            f"{name} must be a 2-D [layers, physical] array, got shape {tuple(a.shape)}")
    return np.ascontiguousarray(a, dtype=np.int64)


_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _as_int(value, name, lo=_INT64_MIN, hi=_INT64_MAX):
    """An integer in [lo, hi] (within int64 always, as the C++ library takes it)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if not max(lo, _INT64_MIN) <= v <= min(hi, _INT64_MAX):
        raise InvalidArgument(f"{name} {v} is outside [{max(lo, _INT64_MIN)}, "
                              f"{min(hi, _INT64_MAX)}]")
    return v


def _as_float(value, name):
    """A real number: a Python or numpy float or integer (not a string, a bool or None);
    InvalidArgument (a ValueError, as float() of a string raised) naming `name` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise InvalidArgument(f"{name} must be a number, got {value!r}")
    return float(value)


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, *,
                      policy="deepseek", previous=None, tolerance=0.01, hierarchical=False,
                      thorough=False, live_ranks=None):
    """Expert placement for every layer: a drop-in for deepseek-ai/EPLB's ``rebalance_experts``.

    Parameters:
        weight: [layers, num_logical_experts], the load of each logical expert (tokens routed
            over the window); a torch tensor (any device, any real dtype), a numpy array or a
            nested list. Loads must be finite and non-negative.
        num_replicas: number of physical slots P per layer, a multiple of num_gpus
        num_groups: number of expert groups (DeepSeek's group-limited routing)
        num_nodes: number of server nodes (the intra-node network is faster)
        num_gpus: number of GPUs (ranks), a multiple of num_nodes
        policy: "deepseek" (default: the reference algorithm, identical outputs; hierarchical
            when num_groups % num_nodes == 0, global otherwise, exactly as the reference),
            "balanced" (better balance), or "sticky" (within `tolerance` of balanced's
            balancedness, keep as many slots as possible where `previous` has them)
        previous: [layers, num_replicas] phy2log in force now; required by "sticky". Every
            slot holds an expert id; an expert without a slot (it lived on ranks that are gone)
            gets one
        tolerance: "sticky": accepted loss of balancedness, in [0, 1)
        hierarchical: "balanced" / "sticky": pack groups to nodes first, like deepseek
        thorough: "balanced" / "sticky" at two slots per rank: also build the replica counts
            level by level (at 256 ranks 0.987 instead of 0.930 on lognormal loads, about 3x
            balanced's time; sticky then moves about three times the slots); with
            "deepseek" it raises InvalidArgument
        live_ranks: the ranks that may hold experts (elastic serving, after a rank is lost),
            ascending rank ids; None: every rank. Every expert is placed on these ranks only;
            the slots of the other ranks keep the expert `previous` has there (slot p mod
            num_logical_experts without one) and must receive no tokens. An expert that lived
            only on lost ranks gets a slot on a live one. Their slots must hold every expert.

    Returns (int64; torch CPU tensors for a torch input, numpy arrays otherwise):
        phy2log: [layers, num_replicas], the logical expert of each physical slot
        log2phy: [layers, num_logical_experts, X], the slots of each expert padded with -1,
            X the largest replica count; replicas in the reference's order for "deepseek",
            in slot order for the others; with live_ranks, the replicas on live ranks first,
            then the kept slots of the other ranks
        logcnt: [layers, num_logical_experts], the replica count of each expert

    Raises InvalidArgument (a ValueError) naming the bad value, e.g. a weight that is not 2-D,
    a negative or NaN load, or num_replicas not a multiple of num_gpus.
    """
    torch_in = _is_torch(weight)
    w = _as_load(weight)
    physical = _as_int(num_replicas, "num_replicas", 1, MAX_PHYSICAL)
    groups = _as_int(num_groups, "num_groups", 1, MAX_EXPERTS)
    nodes = _as_int(num_nodes, "num_nodes", 1, MAX_RANKS)
    ranks = _as_int(num_gpus, "num_gpus", 1, MAX_RANKS)
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a string, got {policy!r}")
    prev = None if previous is None else _as_phy2log(previous, "previous")
    live = [] if live_ranks is None else _as_rank_list(live_ranks, ranks)
    if policy == "deepseek" and groups > 0 and nodes > 0 and groups % nodes != 0:
        # The reference's global policy is its hierarchical one with one group on one node, and
        # checks neither the groups' nor the nodes' divisibility: so do we.
        groups, nodes = 1, 1
    phy2log, log2phy, logcnt = _eplb.place(w, physical, ranks, nodes, groups, policy, prev,
                                           _as_float(tolerance, "tolerance"), bool(hierarchical),
                                           bool(thorough),
                                           live)
    if torch_in:
        import torch
        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt


def _as_rank_list(ranks, count):
    """A list of rank ids from an iterable of integers (or a 1-D integer array), each in
    [0, count), strictly ascending."""
    a = np.asarray(_to_numpy(ranks))
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgument(f"live_ranks must be a 1-D list of rank ids, got "
                              f"{a.tolist() if a.size <= 16 else a.shape}")
    out = [int(r) for r in a]
    for i, r in enumerate(out):
        if not 0 <= r < count:
            raise InvalidArgument(f"live rank {r} is outside [0, {count}) (num_gpus is {count})")
        if i and r <= out[i - 1]:
            raise InvalidArgument(f"live_ranks must be ascending without repeats, got {out}")
    if not out:
        raise InvalidArgument("live_ranks is empty: at least one rank must hold the experts")
    return out


def empty(shape, dtype=np.float32):
    """A zero-filled array in host memory the ranks of this machine can map: allocate an
    engine's expert tensors from here and register them (``Rebalancer(weights={name: [...]})``)
    to have peers on the shm transport copy them at memcpy speed (other host memory is read
    with cross-memory attach: about half of that, and only with ptrace permission between the
    ranks). A torch dtype gives a torch CPU tensor, anything else a numpy array; either keeps
    the memory alive. Free it (drop the array) only after the Rebalancer that registered it
    is shut down."""
    shape = tuple(_as_int(s, "shape", 0) for s in ((shape,) if not isinstance(shape, (tuple, list))
                                                   else shape))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        size = torch.empty((), dtype=dtype).element_size()
        raw = _eplb.shareable_array(max(1, _prod(shape) * size))
        return torch.from_numpy(raw)[: _prod(shape) * size].view(dtype).view(shape)
    dtype = np.dtype(dtype)
    raw = _eplb.shareable_array(max(1, _prod(shape) * dtype.itemsize))
    return raw[: _prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def _prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def balancedness(weight, phy2log, num_gpus):
    """Balancedness of the placement `phy2log` under the load `weight`.

    Parameters:
        weight: [layers, num_logical_experts] loads (numpy, list or torch)
        phy2log: [layers, num_physical] integer expert ids (e.g. rebalance_experts()'s first
            output); every expert must hold at least one slot
        num_gpus: number of ranks; num_physical must be a multiple of it

    Replicas share their expert's load equally. Returns a ``Balancedness`` named tuple
    (per_layer float64 [layers], mean float, step float). A layer with no load is a dense
    layer: 1 in per_layer, left out of mean and step (both 1 when every layer is dense).
    """
    w = _as_load(weight)
    p = _as_phy2log(phy2log, "phy2log")
    m = _eplb.evaluate(w, p, _as_int(num_gpus, "num_gpus", 1, MAX_RANKS))
    return Balancedness(m["balancedness"], m["balancedness_mean"], m["balancedness_step"])


def lower_bound(weight, num_replicas, num_gpus):
    """The smallest max rank load any placement of `num_replicas` slots on `num_gpus` ranks can
    reach, per layer, and the balancedness that bound allows.

    Parameters:
        weight: [layers, num_logical_experts] loads (numpy, list or torch)
        num_replicas: physical slots per layer, a multiple of num_gpus
        num_gpus: number of ranks

    Returns a ``LowerBound`` named tuple (per_layer float64 [layers], balancedness float64
    [layers], balancedness_mean float). An all-zero layer is a dense layer: bound 0 and
    balancedness 1, and left out of balancedness_mean (1 when every layer is dense).
    """
    w = _as_load(weight)
    ranks = _as_int(num_gpus, "num_gpus", 1, MAX_RANKS)
    bound = _eplb.lower_bound(w, _as_int(num_replicas, "num_replicas", 1, MAX_PHYSICAL), ranks)
    mean = w.sum(axis=1) / ranks
    with np.errstate(divide="ignore", invalid="ignore"):
        best = np.where(bound > 0, mean / np.where(bound > 0, bound, 1.0), 1.0)
    moe = bound > 0
    return LowerBound(bound, best, float(best[moe].mean()) if moe.any() else 1.0)


def plan_migration(old_phy2log, new_phy2log, num_gpus, num_nodes, expert_bytes,
                   peers_per_round=1, *, half_duplex=False):
    """Plans and schedules the weight moves from one placement to another, layer by layer.

    Parameters:
        old_phy2log, new_phy2log: [layers, num_physical] integer expert ids (numpy, list or
            torch), the placement in force and the one to move to
        num_gpus: number of ranks (num_physical must be a multiple of it)
        num_nodes: number of nodes (num_gpus must be a multiple of it)
        expert_bytes: bytes of one expert's weights in one layer, >= 1
        peers_per_round: k, the most peers a rank reads from (and serves) in one round
        half_duplex: count both directions together against k (default: duplex links)

    Returns a dict:
        "layers": one dict per layer:
            "action": uint8 [num_physical], how each slot gets its new expert, an index into
                eplb.ACTIONS ("unchanged", "local_copy", "free_ride", "read_same_node",
                "read_other_node", "restore"; a restore, of an expert no live slot holds,
                happens only in elastic serving, which this function does not plan)
            "expert", "src_rank", "src_slot": int64 [num_physical], the slot's new expert and
                where it comes from (the slot itself when unchanged)
            "reads": dict of int64 [reads] columns "src_rank", "src_slot", "dst_rank",
                "dst_slot", "expert", "round" (the round of each read, in [0, rounds))
            "slots": dict action name -> slots
            "rank_bytes_in", "rank_bytes_out": int64 [num_gpus], bytes each rank reads / serves
            "bytes_total", "bytes_intra_node", "bytes_inter_node", "bytes_local_copy",
            "max_rank_bytes_in", "max_rank_bytes_out", "staging_slots", "rounds",
            "rounds_lower_bound", "max_peers": ints
            "link_time": the sum over rounds of the most reads between two ranks in the round
                (one way in duplex, both ways in half duplex): the schedule's time when a read
                takes one unit and a round ends with its largest flow
            "link_time_lower_bound": no schedule is shorter: the most reads one rank takes
                part in (the larger of in and out in duplex, in plus out in half duplex),
                divided by peers_per_round, rounded up
        "totals": sums over the layers: "slots" (dict), "bytes_total", "bytes_intra_node",
            "bytes_inter_node", "bytes_local_copy", "max_rank_bytes_in", "max_rank_bytes_out"
            (of each rank's bytes summed over layers), "max_layer_rank_bytes_in",
            "max_layer_rank_bytes_out", "reads", "rounds", "rounds_lower_bound",
            "max_layer_rounds", "link_time", "link_time_lower_bound", "staging_slots"

    Half duplex (a rank's reads in and out share its link, vLLM's model): every read's source
    is the holder that keeps the busiest rank's reads in plus out lowest, and the reads are
    coloured one by one into rounds where a rank talks to at most peers_per_round peers.
    Duplex: sources on the reader's node first, spreading the bytes served; all reads between
    two ranks in one round, in the fewest rounds.
    """
    return _eplb.plan_migration(
        _as_phy2log(old_phy2log, "old_phy2log"), _as_phy2log(new_phy2log, "new_phy2log"),
        _as_int(num_gpus, "num_gpus"), _as_int(num_nodes, "num_nodes"),
        _as_int(expert_bytes, "expert_bytes"), _as_int(peers_per_round, "peers_per_round"),
        bool(half_duplex))


def should_rebalance(load, current, proposed, num_gpus, *, interval, pull_bytes_per_s,
                     min_gain=1.0, cost=None, window_steps=1, stall_s=0.0, expert_bytes=None,
                     bytes_to_move=None, num_nodes=1):
    """Whether moving from the placement in force to a new one pays: the same decision as the
    runtime's config "min_gain" (docs/runtime.md, "A rebalance only when it pays"), for engines
    that keep their own runtime.

    The MoE time of one step under `cost` is modeled for both placements on the window's load
    (each expert's tokens split evenly over its replicas; per layer the expected slowest
    rank), and the gain over the next `interval` steps, (current - proposed) * interval, is
    set against the price: the bytes to move at the pull bandwidth, plus the stall. The move
    pays unless gain < min_gain * price.

    Parameters:
        load: [layers, experts] tokens per expert over the window (torch, numpy or lists),
            summed over `window_steps` steps (1: the load of one step)
        current, proposed: [layers, physical] phy2log of the placement in force and the new one
        num_gpus: ranks; num_nodes: nodes (for the moves' accounting)
        interval: the steps until the next chance to rebalance, >= 1
        pull_bytes_per_s: the group's pull bandwidth (all ranks' reads together), as measured
            on the engine's last rebalance; 0 or None: not known, and the move goes ahead
        min_gain: the factor on the price the gain must reach, finite and >= 0 (0: always)
        cost: an eplb.cost.CostModel (default: the "tokens" preset, 1 us per token)
        stall_s: the serving loop's stall a rebalance costs, in seconds
        bytes_to_move: the bytes the move reads from other ranks; default: planned from
            `expert_bytes` (the bytes of one expert's weights in one layer) by plan_migration

    Returns a dict: "rebalance" (bool), "current_us" and "proposed_us" (modeled MoE time per
    step), "steps", "gain_us", "price_us", "priced" (False when the bandwidth is not known),
    "bytes", "min_gain", "reason" (why it does not pay; empty when it does). Raises
    eplb.InvalidArgument naming a bad value (a min_gain that is negative, NaN or inf, shapes
    that do not match, an expert without a slot).
    """
    pull = 0.0 if pull_bytes_per_s is None else _as_float(pull_bytes_per_s, "pull_bytes_per_s")
    stall = _as_float(stall_s, "stall_s")
    if not (stall >= 0 and stall < float("inf")):
        raise InvalidArgument(f"stall_s is {stall} (a finite number of seconds >= 0)")
    if bytes_to_move is None and expert_bytes is None:
        raise InvalidArgument("should_rebalance needs bytes_to_move, or expert_bytes to plan "
                              "the moves from")
    moved = -1.0
    if bytes_to_move is not None:
        moved = _as_float(bytes_to_move, "bytes_to_move")
        if not (moved >= 0 and moved < float("inf")):
            raise InvalidArgument(f"bytes_to_move is {moved} (a finite number of bytes >= 0)")
    return _eplb.should_rebalance(
        _as_load(load, "load"), _as_phy2log(current, "current"),
        _as_phy2log(proposed, "proposed"), _as_int(num_gpus, "num_gpus"),
        _as_int(interval, "interval"), _as_float(window_steps, "window_steps"), pull,
        stall * 1e6, _as_float(min_gain, "min_gain"), cost, _as_int(num_nodes, "num_nodes"),
        -1 if expert_bytes is None else _as_int(expert_bytes, "expert_bytes"), moved)


# Last: the runtime module imports names defined above.
from .runtime import Rebalancer  # noqa: E402
from . import cost  # noqa: E402  (eplb.cost: the cost model, without an import of its own)
