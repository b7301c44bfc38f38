"""eplb for SGLang: placement in SGLang's conventions, and the files SGLang reads and writes.

SGLang (python/sglang/srt/eplb/) places experts with ``eplb_algorithms.rebalance_experts(
tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups, num_nodes,
algorithm)`` (``ExpertLocationMetadata.init_by_eplb`` calls it by keyword), builds its
``ExpertLocationMetadata`` from the phy2log and log2phy it returns, starts from
``--init-expert-location FILE`` (``{"physical_to_logical_map": ...}`` or ``{"logical_count":
...}``), and its expert-distribution recorder dumps ``{"logical_count": [steps][L][E], ...}``.

- ``rebalance_experts``: that call, positional or by keyword, with SGLang's algorithms
  (``EplbAlgorithm`` members or their names) and eplb's policies; ``active_ranks`` places over
  the live ranks of an elastic deployment only.
- ``rebalance_experts_elasticity_aware``: the signature of SGLang's inner
  ``elasticity_aware.rebalance_experts`` (weight, ..., enable_hierarchical, active_ranks).
- ``Algorithm``: the same call, keeping the placement in force between calls, so SGLang (which
  never passes it) reaches eplb's migration-aware ``sticky`` policy.
- ``install`` / ``uninstall``: put an ``Algorithm`` behind SGLang's
  ``eplb_algorithms.rebalance_experts`` in this process, and take it out again; ``plugin``, the
  package's ``sglang.srt.plugins`` entry point, installs in every SGLang process when
  ``EPLB_SGLANG_POLICY`` asks for it.
- ``expert_location_metadata``: every field of ExpertLocationMetadata for a placement, the static
  dispatch map included.
- ``write_init_expert_location``: the file of ``--init-expert-location``.
- ``read_expert_distribution`` / ``write_expert_distribution``: the recorder's statistics.

Words as in SGLang: physical slot p lives on rank p // num_local_physical_experts.
"""

import json
import os
import random
import sys
import threading

import numpy as np

import eplb
from eplb.integrations import (_check_step_sum, _file_errors, _integers, _is_torch, _like,
                               _loads, _logical_maps, _numpy, _policy_env)

__all__ = [
    "ALGORITHMS", "rebalance_experts", "rebalance_experts_elasticity_aware", "Algorithm",
    "install", "uninstall", "plugin", "policy_from_env", "expert_location_metadata", "write_init_expert_location",
    "read_expert_distribution", "write_expert_distribution",
]

# The algorithms this module takes (SGLang's --eplb-algorithm names, and eplb's policies).
# SGLang's "deepseek_vec" and "deepseek_vec_hierarchical" balance step by step and have no
# counterpart here.
SGLANG_ALGORITHMS = ("deepseek", "deepseek_hierarchical", "elasticity_aware",
                     "elasticity_aware_hierarchical")
ALGORITHMS = ("balanced", "sticky", "auto") + SGLANG_ALGORITHMS


def _algorithm_name(algorithm):
    # SGLang's EplbAlgorithm enum members are accepted by name.
    name = getattr(algorithm, "name", algorithm)
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a string or an EplbAlgorithm member, got "
                        f"{algorithm!r}")
    if name not in ALGORITHMS:
        raise eplb.InvalidArgument(
            f"algorithm {name!r} is not one of {', '.join(ALGORITHMS)} (SGLang's deepseek_vec "
            f"algorithms balance step by step and have no eplb counterpart: use deepseek, or "
            f"eplb's balanced or sticky)")
    return name


def _steps_load(tokens_per_expert):
    """The [layers, experts] float64 load of a [layers, experts] or [steps, layers, experts]
    input, each step checked before the sum (a negative count in one step must not hide behind
    the others)."""
    load = _loads(tokens_per_expert, "tokens_per_expert")
    if load.ndim not in (2, 3):
        raise eplb.InvalidArgument(f"tokens_per_expert must be [layers, experts] or [steps, "
                                   f"layers, experts], got shape {tuple(load.shape)}")
    if load.ndim == 3:
        if load.shape[0] == 0:
            raise eplb.InvalidArgument(f"tokens_per_expert has no steps (shape "
                                       f"{tuple(load.shape)}): there is no load to place by")
        bad = ~np.isfinite(load) | (load < 0)
        if bad.any():
            s, l, e = np.argwhere(bad)[0]
            raise eplb.InvalidArgument(
                f"tokens_per_expert[{s}][{l}][{e}] is {load[s, l, e]}: loads must be finite and "
                f"non-negative token counts")
        with np.errstate(over="ignore"):
            total = load.sum(axis=0)
        _check_step_sum(load, total, "tokens_per_expert")
        load = total
    return load


def _live_ranks(active_ranks, ranks):
    """The live rank ids (ascending) of SGLang's active_ranks flags (int32 0/1 or bool, one per
    rank; entries past `ranks`, which SGLang reserves for ranks that may join, must be 0), or
    None when every rank is live."""
    if active_ranks is None:
        return None
    flags = _numpy(active_ranks)
    if flags.ndim != 1 or (flags.size and flags.dtype.kind not in "biu"):
        raise eplb.InvalidArgument(
            f"active_ranks must be SGLang's 1-D flags, one 0/1 (or bool) per rank, got shape "
            f"{tuple(flags.shape)} dtype {flags.dtype}")
    flags = flags.astype(np.int64)
    if np.any((flags != 0) & (flags != 1)):
        raise eplb.InvalidArgument(f"active_ranks must hold 0 or 1 per rank, got "
                                   f"{flags.tolist()}")
    if flags.size < ranks or np.any(flags[ranks:]):
        raise eplb.InvalidArgument(
            f"active_ranks has {flags.size} flags {flags.tolist()} for {ranks} ranks: one per "
            f"rank is needed (flags past the last rank, reserved for joining ranks, must be 0)")
    live = np.flatnonzero(flags[:ranks])
    if live.size == 0:
        raise eplb.InvalidArgument("active_ranks marks no rank live: there is nowhere to place "
                                   "the experts")
    return None if live.size == ranks else live.tolist()


def _only_live(phy2log, log2phy, local, live):
    """SGLang's view of a placement on live ranks: the other ranks' slots hold expert 0, and
    log2phy / the counts list the live replicas only (front-packed, padded with -1 to the most
    live replicas of any expert)."""
    phy2log = phy2log.copy()
    ranks = phy2log.shape[1] // local
    dead = np.setdiff1d(np.arange(ranks), live)
    dead_slot = np.zeros(phy2log.shape[1], dtype=bool)
    for r in dead:
        dead_slot[r * local:(r + 1) * local] = True
    phy2log[:, dead_slot] = 0
    keep = (log2phy >= 0) & ~dead_slot[np.maximum(log2phy, 0)]
    count = keep.sum(axis=-1).astype(np.int64)
    # The live entries moved to the front in their order (a stable sort on "not kept").
    order = np.argsort(~keep, axis=-1, kind="stable")
    out = np.where(np.take_along_axis(keep, order, axis=-1),
                   np.take_along_axis(log2phy, order, axis=-1), -1)
    width = max(int(count.max()) if count.size else 0, 1)
    return phy2log, np.ascontiguousarray(out[..., :width]), count


def _place(load, physical, local, groups, nodes, name, *, previous, tolerance, hierarchical,
           thorough, live):
    """(phy2log, log2phy, count) int64 numpy for an algorithm name, SGLang's semantics."""
    ranks = physical // local
    reference = name in SGLANG_ALGORITHMS
    if name == "auto":
        name = "sticky" if previous is not None else "balanced"
    if name == "sticky" and previous is None:
        raise eplb.InvalidArgument("policy sticky needs previous, the physical_to_logical_map "
                                   "[layers, num_physical_experts] in force")
    if reference:
        if hierarchical is not None:
            raise eplb.InvalidArgument(f"hierarchical is for eplb's balanced and sticky; "
                                       f"{name} says it in its name")
        if thorough:
            raise eplb.InvalidArgument(f"thorough applies to eplb's balanced and sticky "
                                       f"policies, not {name} (the reference's replica counts)")
        tree = name.endswith("_hierarchical")
        if live is not None or not tree:
            # SGLang's global policy; on live ranks always global (elasticity_aware's rule).
            groups, nodes = 1, 1
        elif groups % nodes != 0:
            raise eplb.InvalidArgument(
                f"{name} needs num_groups {groups} to be a multiple of num_nodes {nodes} (whole "
                f"groups are packed onto nodes); use deepseek or balanced")
        policy, previous = "deepseek", None
    else:
        policy = name
    out = eplb.rebalance_experts(load, physical, groups, nodes, ranks, policy=policy,
                                 previous=previous if policy == "sticky" else None,
                                 tolerance=tolerance, hierarchical=bool(hierarchical),
                                 thorough=thorough, live_ranks=live)
    if live is None:
        return out
    return _only_live(out[0], out[1], local, live)


def _as_cpu(a, template):
    """`a` (numpy) as SGLang's algorithms return it: a CPU torch tensor for a tensor input."""
    if _is_torch(template):
        import torch
        return torch.from_numpy(np.ascontiguousarray(a))
    return a


def rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts,
                      num_groups, num_nodes, algorithm=None, *, policy=None, previous=None,
                      tolerance=0.01, hierarchical=None, thorough=False, active_ranks=None):
    """Expert placement for every layer: SGLang's ``eplb_algorithms.rebalance_experts`` call,
    positional or by keyword, with eplb's policies beside SGLang's algorithms.

    Parameters (SGLang's first six):
        tokens_per_expert: [steps, layers, experts] (SGLang's recorder; the steps are summed, as
            SGLang's deepseek algorithms do) or [layers, experts], the logical load; torch (any
            real dtype, any device), numpy or nested lists
        num_physical_experts: P, slots per layer (SGLang: experts + ep_num_redundant_experts)
        num_local_physical_experts: slots per rank; ranks = P // this, which must divide P
        num_groups: expert groups of the model, or None (no groups: one)
        num_nodes: nodes (SGLang's --nnodes)
        algorithm: an EplbAlgorithm member or its name, or one of eplb's policies:
            "deepseek" (the reference, global: SGLang's own outputs), "deepseek_hierarchical"
            (the reference with groups packed to nodes; num_groups must be a multiple of
            num_nodes), "elasticity_aware" / "elasticity_aware_hierarchical" (SGLang's: as the
            deepseek names with every rank live; on live ranks only, the global reference on
            them), "balanced" (default), "sticky" (needs previous) or "auto" (sticky with
            previous, balanced without)
    eplb's keywords:
        policy: eplb's spelling of `algorithm` (give one of them)
        previous: [layers, P], the phy2log in force (sticky)
        tolerance: sticky: the balancedness it may give up against balanced, in [0, 1)
        hierarchical: balanced / sticky: pack groups to nodes first
        thorough: balanced / sticky at two slots per rank: also build the replica counts level
            by level (see eplb.rebalance_experts)
        active_ranks: SGLang's elastic-EP flags, [ranks] int32 0/1 (or bool), 1 for a live
            rank; None: every rank live. Every expert is then placed on live ranks only, with
            any algorithm: the dead ranks' slots hold expert 0 (as SGLang's elasticity_aware
            writes them) and log2phy and the counts list live replicas only. The live ranks'
            slots must be at least the experts.

    Returns SGLang's triple, int64 (CPU torch tensors for a tensor input, as SGLang's
    algorithms return them; numpy arrays otherwise): physical_to_logical_map [layers, P],
    logical_to_physical_map [layers, experts, X] padded with -1 (X the most replicas of an
    expert; replicas in the reference's order for SGLang's algorithms, in slot order for eplb's
    policies), logical_count [layers, experts].

    Raises eplb.InvalidArgument (a ValueError) naming the bad value.
    """
    if algorithm is not None and policy is not None:
        raise eplb.InvalidArgument(f"give algorithm ({getattr(algorithm, 'name', algorithm)!r}) "
                                   f"or policy ({policy!r}), not both: they name the same thing")
    name = _algorithm_name(algorithm if algorithm is not None else
                           policy if policy is not None else "balanced")
    load = _steps_load(tokens_per_expert)
    physical = eplb._as_int(num_physical_experts, "num_physical_experts", 1, eplb.MAX_PHYSICAL)
    local = eplb._as_int(num_local_physical_experts, "num_local_physical_experts", 1,
                         eplb.MAX_PHYSICAL)
    if physical % local != 0:
        raise eplb.InvalidArgument(
            f"num_physical_experts {physical} is not a multiple of num_local_physical_experts "
            f"{local} (every rank holds the same number of slots)")
    groups = 1 if num_groups is None else eplb._as_int(num_groups, "num_groups", 1,
                                                       eplb.MAX_EXPERTS)
    nodes = eplb._as_int(num_nodes, "num_nodes", 1, eplb.MAX_RANKS)
    prev = None if previous is None else _integers(previous, "previous")
    live = _live_ranks(active_ranks, physical // local)
    if live is not None and len(live) * local < load.shape[1]:
        raise eplb.InvalidArgument(
            f"active_ranks leave {len(live)} live ranks x {local} slots = {len(live) * local} "
            f"slots for {load.shape[1]} experts: every expert needs a slot on a live rank")
    out = _place(load, physical, local, groups, nodes, name, previous=prev,
                 tolerance=tolerance, hierarchical=hierarchical, thorough=thorough, live=live)
    return tuple(_as_cpu(a, tokens_per_expert) for a in out)


def rebalance_experts_elasticity_aware(weight, num_replicas, num_groups, num_nodes, num_gpus,
                                       enable_hierarchical, active_ranks, *, policy="deepseek",
                                       previous=None, tolerance=0.01, thorough=False):
    """SGLang's inner ``elasticity_aware.rebalance_experts`` signature: `weight` [layers,
    experts] (already summed), `num_replicas` slots per layer on `num_gpus` ranks, and
    `active_ranks` flags. With every rank live it is the reference, hierarchical when
    `enable_hierarchical`; with a rank dead, the global reference on the live ranks only (dead
    ranks' slots hold expert 0). policy="balanced" / "sticky" / "auto" places with eplb's policy
    instead (enable_hierarchical then packs groups to nodes). Returns rebalance_experts'
    triple."""
    ranks = eplb._as_int(num_gpus, "num_gpus", 1, eplb.MAX_RANKS)
    physical = eplb._as_int(num_replicas, "num_replicas", 1, eplb.MAX_PHYSICAL)
    if physical % ranks != 0:
        raise eplb.InvalidArgument(f"num_replicas {physical} is not a multiple of num_gpus "
                                   f"{ranks} (every rank holds the same number of slots)")
    if policy == "deepseek":
        algorithm = ("elasticity_aware_hierarchical" if enable_hierarchical else
                     "elasticity_aware")
        return rebalance_experts(weight, physical, physical // ranks, num_groups, num_nodes,
                                 algorithm, active_ranks=active_ranks)
    return rebalance_experts(weight, physical, physical // ranks, num_groups, num_nodes,
                             policy=policy, previous=previous, tolerance=tolerance,
                             hierarchical=bool(enable_hierarchical), thorough=thorough,
                             active_ranks=active_ranks)


class Algorithm:
    """SGLang's ``rebalance_experts`` call with eplb's policy, keeping the placement in force
    between calls: SGLang never passes it, and eplb's ``sticky`` needs it to move few slots.

    Algorithm(policy="sticky", tolerance=0.01, hierarchical=None, thorough=False,
              current=None)

        policy: "sticky" (default: sticky against the placement in force, balanced for the
            first), "balanced", or "deepseek" (SGLang's algorithms as asked: its own outputs)
        hierarchical: balanced / sticky: pack groups to nodes; None follows SGLang's algorithm
            (its *_hierarchical names)
        current: a callable returning the phy2log in force ([layers, P]) or None; when it gives
            a map of the call's shape, sticky starts from it (``install`` reads SGLang's global
            ExpertLocationMetadata). Otherwise the last placement this object returned is used.

    ``algo(tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups,
    num_nodes, algorithm=None, active_ranks=None)`` (also ``algo.rebalance_experts``) returns
    the triple of ``rebalance_experts``. SGLang's algorithm picks only what its name says beyond
    the policy: hierarchical (``*_hierarchical``) and live ranks (``active_ranks``, any name).
    ``previous`` is the placement it remembers; ``reset()`` forgets it. Every rank calls it with
    the same all-reduced load in the same order, so every rank holds the same placement.
    Calls are serialized by a lock.
    """

    def __init__(self, policy="sticky", tolerance=0.01, hierarchical=None, thorough=False,
                 current=None):
        if policy not in ("sticky", "balanced", "deepseek"):
            raise eplb.InvalidArgument(f"policy {policy!r} is not one of sticky, balanced, "
                                       f"deepseek")
        tolerance = eplb._as_float(tolerance, "tolerance")
        if not 0 <= tolerance < 1:
            raise eplb.InvalidArgument(f"tolerance {tolerance} must be in [0, 1) (a loss of "
                                       f"balancedness)")
        if policy == "deepseek" and (thorough or hierarchical is not None):
            raise eplb.InvalidArgument("hierarchical and thorough are for eplb's balanced and "
                                       "sticky; with policy deepseek SGLang's algorithm decides")
        self.policy, self.tolerance, self.thorough = policy, tolerance, bool(thorough)
        self.hierarchical = hierarchical
        self.current = current
        self.previous = None
        self._lock = threading.Lock()

    def reset(self):
        with self._lock:
            self.previous = None

    def _in_force(self, layers, physical):
        prev = None
        if self.current is not None:
            got = self.current()
            if got is not None:
                got = _integers(got, "the placement in force")
                if got.shape == (layers, physical):
                    prev = got
        if prev is None and self.previous is not None and \
                self.previous.shape == (layers, physical):
            prev = self.previous
        return prev

    def rebalance_experts(self, tokens_per_expert, num_physical_experts,
                          num_local_physical_experts, num_groups, num_nodes, algorithm=None,
                          active_ranks=None):
        sglang_name = _algorithm_name(algorithm if algorithm is not None else "deepseek")
        with self._lock:
            if self.policy == "deepseek":
                if sglang_name not in SGLANG_ALGORITHMS:
                    sglang_name = "deepseek"
                out = rebalance_experts(tokens_per_expert, num_physical_experts,
                                        num_local_physical_experts, num_groups, num_nodes,
                                        sglang_name, active_ranks=active_ranks)
            else:
                hierarchical = self.hierarchical
                if hierarchical is None:
                    hierarchical = sglang_name.endswith("_hierarchical")
                    groups = 1 if num_groups is None else int(num_groups)
                    hierarchical = hierarchical and groups % int(num_nodes) == 0
                load = _steps_load(tokens_per_expert)
                prev = self._in_force(load.shape[0], int(num_physical_experts))
                policy = "sticky" if self.policy == "sticky" and prev is not None else "balanced"
                out = rebalance_experts(load, num_physical_experts, num_local_physical_experts,
                                        num_groups, num_nodes, policy=policy, previous=prev,
                                        tolerance=self.tolerance, hierarchical=hierarchical,
                                        thorough=self.thorough, active_ranks=active_ranks)
                out = tuple(_as_cpu(a, tokens_per_expert) for a in out)
            self.previous = _integers(out[0], "phy2log").copy()
            return out

    __call__ = rebalance_experts


_installed = None  # (module, the function it held, the Algorithm put there)


def _sglang_map_in_force():
    """SGLang's global ExpertLocationMetadata's phy2log (CPU), or None outside a server."""
    module = sys.modules.get("sglang.srt.eplb.expert_location")
    getter = getattr(module, "get_global_expert_location_metadata", None)
    if getter is None:
        return None
    try:
        metadata = getter()
    except Exception:  # no runtime context published: not inside a server
        return None
    return getattr(metadata, "physical_to_logical_map_cpu", None)


def _sglang_active_ranks():
    """SGLang's elastic-EP active ranks (its ElasticEPStateManager), or None when elastic EP is
    off: then every rank is live, as SGLang's healthy_rank_state() says."""
    module = sys.modules.get("sglang.srt.elastic_ep.elastic_ep")
    manager = getattr(module, "ElasticEPStateManager", None)
    state = manager.instance() if manager is not None else None
    return None if state is None else state.active_ranks


def install(policy="sticky", tolerance=0.01, hierarchical=None, thorough=False):
    """Puts eplb behind SGLang's ``sglang.srt.eplb.eplb_algorithms.rebalance_experts`` in this
    process (the function ``ExpertLocationMetadata.init_by_eplb`` calls) and returns the
    ``Algorithm`` it installed. Arguments as ``Algorithm``'s. The placement in force is read from
    SGLang's global ExpertLocationMetadata, and under elastic EP the live ranks from its
    ElasticEPStateManager, so sticky moves few slots and no expert goes to a dead rank.
    SGLang's --eplb-algorithm still says hierarchical or not; policy="deepseek" keeps SGLang's
    outputs (its deepseek_vec algorithms are passed to SGLang's own function).

    Call it in every process that places (SGLang's scheduler processes: see
    docs/integrations.md); installing again replaces the Algorithm. ``uninstall()`` restores
    SGLang's function. Raises ImportError without SGLang.
    """
    global _installed
    try:
        from sglang.srt.eplb import eplb_algorithms as module
    except ImportError as e:
        raise ImportError(f"eplb.integrations.sglang.install() needs SGLang's "
                          f"sglang.srt.eplb.eplb_algorithms, which is not importable: {e}") from e
    algo = Algorithm(policy, tolerance, hierarchical, thorough, current=_sglang_map_in_force)
    original = _installed[1] if _installed is not None else module.rebalance_experts

    def rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts,
                          num_groups, num_nodes, algorithm):
        name = getattr(algorithm, "name", algorithm)
        if policy == "deepseek" and name not in SGLANG_ALGORITHMS:
            return original(tokens_per_expert, num_physical_experts,
                            num_local_physical_experts, num_groups, num_nodes, algorithm)
        if name not in ALGORITHMS:
            name = "deepseek"  # deepseek_vec*: eplb's policy, not hierarchical
        return algo(tokens_per_expert, num_physical_experts, num_local_physical_experts,
                    num_groups, num_nodes, name, active_ranks=_sglang_active_ranks())

    rebalance_experts.__doc__ = (f"eplb's {policy} placement behind SGLang's "
                                 f"eplb_algorithms.rebalance_experts (eplb.integrations.sglang."
                                 f"install); uninstall() restores SGLang's.")
    rebalance_experts.eplb_algorithm = algo
    module.rebalance_experts = rebalance_experts
    _installed = (module, original, algo)
    return algo


ENV_POLICY = "EPLB_SGLANG_POLICY"
ENV_TOLERANCE = "EPLB_SGLANG_TOLERANCE"


def policy_from_env(environ=None):
    """The ``install`` arguments ``EPLB_SGLANG_POLICY`` asks for, as a dict, or None when it is
    unset, empty or "off". Values: "sticky" (few moves from SGLang's map in force), "balanced",
    "deepseek" (SGLang's own outputs: switch first, then turn on sticky);
    ``EPLB_SGLANG_TOLERANCE`` sets sticky's tolerance (default 0.01). Raises
    eplb.InvalidArgument naming the variable for any other value."""
    environ = os.environ if environ is None else environ
    asked = _policy_env(environ, ENV_POLICY, ENV_TOLERANCE, ["sticky", "balanced", "deepseek"],
                        "SGLang keeps its own")
    if asked is None:
        return None
    value, tolerance = asked
    return {"policy": value, "tolerance": tolerance}


def plugin():
    """The ``sglang.srt.plugins`` entry point the package declares (SGLang's plugin framework
    runs it early in every process: server, schedulers, workers). With ``EPLB_SGLANG_POLICY``
    unset (or "off") it does nothing; set, it ``install``s that policy. SGLang's own
    ``SGLANG_PLUGINS`` allow-list (entry point name "eplb") also keeps it out. Returns the
    installed Algorithm, or None."""
    arguments = policy_from_env()
    if arguments is None:
        return None
    return install(**arguments)


def uninstall():
    """Restores SGLang's own ``eplb_algorithms.rebalance_experts``; True if eplb was installed."""
    global _installed
    if _installed is None:
        return False
    module, original, _ = _installed
    module.rebalance_experts = original
    _installed = None
    return True


def _dispatch_row(candidates, local, rank, gpus_per_node):
    """SGLang's nearest replica for `rank`: the only one, else the first on the rank, else the
    first on its node when that narrows the choice; -1 when none is nearer than another."""
    if len(candidates) == 1:
        return candidates[0]
    for c in candidates:
        if c // local == rank:
            return c
    if gpus_per_node is not None:
        per_node = local * gpus_per_node
        node = [c for c in candidates if c // per_node == rank // gpus_per_node]
        if 0 < len(node) < len(candidates):
            return node[0]
    return -1


def _rank_dispatch_maps(log2phy, ranks, physical, nodes, seed):
    """SGLang's compute_logical_to_rank_dispatch_physical_map for every rank: [ranks, L, E], the
    replica each rank sends an expert's tokens to. Same rank first, then same node, then the
    ranks left are dealt the replicas evenly in an order drawn from random.Random(seed), one
    generator over all layers and experts, as SGLang draws it (so every rank agrees)."""
    rng = random.Random(seed)
    local = physical // ranks
    gpus_per_node = ranks // nodes or None  # as SGLang: ep_size // nnodes
    layers, experts, _ = log2phy.shape
    out = np.full((ranks, layers, experts), -1, dtype=np.int64)
    for l in range(layers):
        for e in range(experts):
            candidates = [int(c) for c in log2phy[l, e] if c != -1]
            rest = []
            for g in range(ranks):
                out[g, l, e] = _dispatch_row(candidates, local, g, gpus_per_node)
                if out[g, l, e] == -1:
                    rest.append(g)
            if rest:
                q, m = divmod(len(rest), len(candidates))
                dealt = candidates * q + rng.sample(candidates, k=m)
                rng.shuffle(dealt)
                out[rest, l, e] = dealt
    return out


def _nearest_replicas(log2phy, rank, local, gpus_per_node):
    """SGLang's per-rank narrowing of init_by_mapping with an all-to-all backend: each expert's
    replicas, for `rank`, become its nearest one alone (the only one, else the first on the
    rank, else the first on its node when that narrows the choice), or stay all of them when
    none is nearer; padded with -1 to the longest list left."""
    lists = []
    for row in log2phy.reshape(-1, log2phy.shape[-1]):
        candidates = [int(c) for c in row if c != -1]
        nearest = _dispatch_row(candidates, local, rank, gpus_per_node) if candidates else -1
        lists.append([nearest] if nearest != -1 else candidates)
    width = max((len(x) for x in lists), default=1)
    out = np.full((len(lists), width), -1, dtype=np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out.reshape(*log2phy.shape[:2], width)


def expert_location_metadata(physical_to_logical_map, num_logical_experts, ep_size, *,
                             logical_to_physical_map=None, ep_rank=None, num_nodes=1,
                             dispatch="static", active_ranks=None, seed=42, a2a_backend=None):
    """Every field of SGLang's ExpertLocationMetadata for the placement `physical_to_logical_map`
    ([layers, P] expert ids) on `ep_size` ranks, as a dict in the dataclass's field order:

        physical_to_logical_map: [layers, P]
        physical_to_logical_map_cpu: the same, on the CPU
        logical_to_all_physical_map: [layers, experts, P], each expert's slots padded with -1 to
            P (SGLang's _init_raw); the slots in ascending physical id (init_by_mapping), or as
            `logical_to_physical_map` lists them (init_by_eplb: the algorithm's log2phy, which
            rebalance_experts returns as its second output)
        logical_to_all_physical_map_cpu: the same, on the CPU
        logical_to_all_physical_map_num_valid: [layers, experts], the replica counts
        ep_size: int
        logical_to_rank_dispatch_physical_map: [layers, experts], the replica rank `ep_rank`
            sends each expert's tokens to: SGLang's static dispatch (same rank, then same node,
            then a fair draw from random.Random(seed) that every rank makes alike); None for
            dispatch=None (SGLang's other dispatch algorithms)

    ep_rank: this rank (default: torch.distributed's rank % ep_size where a process group is
    initialized, else 0); num_nodes: SGLang's --nnodes (same-node preference). active_ranks:
    SGLang's elastic flags; the slots of dead ranks are left out of the maps.
    a2a_backend: SGLang's --moe-a2a-backend (None or "none": no all-to-all backend). With one
    set and `ep_rank` given, each expert's replica list is, as SGLang's
    ``init_by_mapping(moe_ep_rank=ep_rank)`` builds it, narrowed to the replica nearest to that
    rank (the only one, else one on the rank, else one on its node when that narrows it): the
    logical_to_all_physical_map, its counts and the dispatch map are then that rank's own. The
    maps of an algorithm's log2phy (`logical_to_physical_map`, init_by_eplb) are never narrowed.

    All int64; for a torch input the device fields are on its device and the _cpu ones on the
    CPU; numpy arrays otherwise. P must be a multiple of ep_size and every expert hold a slot
    (SGLang's dispatch divides by the count).
    """
    phy2log = _integers(physical_to_logical_map, "physical_to_logical_map")
    if phy2log.ndim != 2:
        raise eplb.InvalidArgument(f"physical_to_logical_map must be [layers, physical], got "
                                   f"shape {tuple(phy2log.shape)}")
    layers, physical = phy2log.shape
    experts = eplb._as_int(num_logical_experts, "num_logical_experts", 1, eplb.MAX_EXPERTS)
    ranks = eplb._as_int(ep_size, "ep_size", 1, eplb.MAX_RANKS)
    nodes = eplb._as_int(num_nodes, "num_nodes", 1, eplb.MAX_RANKS)
    if physical % ranks != 0:
        raise eplb.InvalidArgument(f"physical experts {physical} is not a multiple of ep_size "
                                   f"{ranks} (every rank holds the same number of slots)")
    if dispatch not in ("static", None):
        raise eplb.InvalidArgument(f"dispatch {dispatch!r} is not 'static' or None (SGLang "
                                   f"computes a dispatch map for its static algorithm only)")
    if np.any(phy2log < 0):
        raise eplb.InvalidArgument("physical_to_logical_map holds a negative expert id")
    live = _live_ranks(active_ranks, ranks)
    if logical_to_physical_map is None:
        log2phy, _ = _logical_maps(phy2log, experts, width=physical)
        if live is not None:
            _, log2phy, _ = _only_live(phy2log, log2phy, physical // ranks, live)
    else:
        log2phy = _integers(logical_to_physical_map, "logical_to_physical_map")
        if log2phy.ndim != 3 or log2phy.shape[:2] != (layers, experts) or \
                log2phy.shape[2] > physical:
            raise eplb.InvalidArgument(
                f"logical_to_physical_map has shape {tuple(log2phy.shape)}, expected [{layers}, "
                f"{experts}, at most {physical}] (the algorithm's log2phy)")
        if np.any((log2phy < -1) | (log2phy >= physical)):
            raise eplb.InvalidArgument(f"logical_to_physical_map holds a slot outside "
                                       f"[0, {physical}) (or -1 for padding)")
    narrow = ep_rank is not None and a2a_backend not in (None, "none") and \
        logical_to_physical_map is None
    if narrow:
        log2phy = _nearest_replicas(log2phy, _ep_rank(ep_rank, ranks), physical // ranks,
                                    ranks // nodes or None)
    count = (log2phy != -1).sum(axis=-1).astype(np.int64)
    if np.any(count == 0):
        l, e = np.argwhere(count == 0)[0]
        raise eplb.InvalidArgument(f"layer {l} expert {e} has no slot (every logical expert "
                                   f"needs at least one)")
    padded = np.full((layers, experts, physical), -1, dtype=np.int64)
    padded[..., :log2phy.shape[2]] = log2phy
    rank_map = None
    if dispatch == "static":
        rank = _ep_rank(ep_rank, ranks)
        rank_map = _rank_dispatch_maps(log2phy, ranks, physical, nodes, seed)[rank]
    on_device = lambda a: None if a is None else _like(a, physical_to_logical_map)  # noqa: E731
    return {
        "physical_to_logical_map": on_device(phy2log),
        "physical_to_logical_map_cpu": _as_cpu(phy2log, physical_to_logical_map),
        "logical_to_all_physical_map": on_device(padded),
        "logical_to_all_physical_map_cpu": _as_cpu(padded, physical_to_logical_map),
        "logical_to_all_physical_map_num_valid": on_device(count),
        "ep_size": ranks,
        "logical_to_rank_dispatch_physical_map": on_device(rank_map),
    }


def _ep_rank(ep_rank, ranks):
    if ep_rank is not None:
        return eplb._as_int(ep_rank, "ep_rank", 0, ranks - 1)
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() % ranks
    return 0


def write_init_expert_location(path, physical_to_logical_map):
    """Writes the file SGLang's ``--init-expert-location`` reads: ``{"physical_to_logical_map":
    [[...]]}`` and nothing else (SGLang passes the file's keys as arguments). `path` ends in
    .json (or .pt: the same dict through torch.save); SGLang parses any other argument as
    inline JSON, not a file."""
    phy2log = _integers(physical_to_logical_map, "physical_to_logical_map")
    if phy2log.ndim != 2 or phy2log.size == 0:
        raise eplb.InvalidArgument(f"physical_to_logical_map must be a non-empty [layers, "
                                   f"physical] map, got shape {tuple(phy2log.shape)}")
    if np.any(phy2log < 0):
        raise eplb.InvalidArgument("physical_to_logical_map holds a negative expert id")
    path = str(path)
    if path.endswith(".pt"):
        import torch
        with _file_errors(path, "write"):
            torch.save({"physical_to_logical_map": torch.from_numpy(phy2log)}, path)
    elif path.endswith(".json"):
        with _file_errors(path, "write"), open(path, "w") as f:
            json.dump({"physical_to_logical_map": phy2log.tolist()}, f, separators=(",", ":"))
            f.write("\n")
    else:
        raise eplb.InvalidArgument(f"{path}: SGLang reads --init-expert-location from a file "
                                   f"ending in .json or .pt (anything else is parsed as inline "
                                   f"JSON)")


def _logical_count(value, source):
    a = _loads(value, f"{source}: logical_count")
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or a.size == 0:
        raise eplb.InvalidArgument(f"{source}: logical_count must be [layers][experts] or "
                                   f"[steps][layers][experts], got shape {tuple(a.shape)}")
    return a


def read_expert_distribution(path):
    """The loads in an SGLang expert-distribution file: the recorder's ``stat`` dump (``.pt``,
    read with torch.load(weights_only=True)) or a JSON file (``.json``) with key
    "logical_count", [layers][experts] or [steps][layers][experts]. Returns float64 numpy
    [steps, layers, experts] (one step for a 2-D count)."""
    path = str(path)
    if path.endswith(".pt"):
        import torch
        with _file_errors(path, "read"):
            data = torch.load(path, weights_only=True, map_location="cpu")
    elif path.endswith(".json"):
        with _file_errors(path, "read"), open(path) as f:
            data = json.load(f)
    else:
        raise eplb.InvalidArgument(f"{path}: expected an SGLang expert distribution file "
                                   f"ending in .pt or .json")
    if not isinstance(data, dict) or "logical_count" not in data:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        hint = (" (a per_pass / per_token dump holds one rank's physical counts: record with "
                "--expert-distribution-recorder-mode stat)") if isinstance(data, dict) and \
            "records" in data else ""
        raise eplb.InvalidArgument(f"{path}: no key \"logical_count\" (found {keys}){hint}")
    return _logical_count(data["logical_count"], path)


def write_expert_distribution(path, logical_count):
    """Writes loads as SGLang's JSON ``{"logical_count": ...}``: [layers][experts] for one step
    (as SGLang's published statistics are), [steps][layers][experts] for more. The file
    ``eplb plan --load`` and ``--init-expert-location`` read (e.g. a .pt dump converted)."""
    a = _logical_count(logical_count, str(path))
    value = a[0] if a.shape[0] == 1 else a
    if np.all(value == np.round(value)):
        value = value.astype(np.int64)
    with _file_errors(path, "write"), open(path, "w") as f:
        json.dump({"logical_count": value.tolist()}, f, separators=(",", ":"))
        f.write("\n")
