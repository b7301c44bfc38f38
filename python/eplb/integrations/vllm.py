"""eplb as a vLLM EPLB policy, and the maps and load files around it.

vLLM's EPLB (vllm/distributed/eplb/) picks a policy class from ``EPLB_POLICIES`` (in
``vllm.distributed.eplb.policy``) and calls its classmethod

    rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
                      old_global_expert_indices=None) -> phy2log [layers, num_replicas]

with the logical load of the window (``weight`` [layers, logical experts]) and the placement in
force (``old_global_expert_indices``, the phy2log [layers, num_replicas]). ``EplbPolicy`` fills
that contract with eplb's policies: ``balanced`` for a first placement, ``sticky`` against the
placement in force (within ``tolerance`` of balanced's balancedness, moving few slots), then
vLLM's own ``preserve_intragpu_slots`` so an expert that stays on its GPU keeps its slot;
``make_policy(policy="deepseek")`` gives exactly vLLM's default outputs. Under elastic EP vLLM
passes the placement in force at its own width: wider than ``num_replicas`` when ranks were
removed (the survivors are its first ranks), narrower or ``-1``-padded when ranks were added;
sticky keeps the surviving ranks' slots. Older vLLM expected (phy2log, log2phy, logcnt) from the
same call: ``rebalance_experts_with_maps`` and ``make_policy(legacy=True)`` give that.

``schedule_migration_batches`` and ``schedule_migration_batches_for_layers`` are drop-ins for
vLLM's migration scheduler (eplb.integrations.vllm_scheduler), with eplb's half-duplex schedule.

``plugin`` is the ``vllm.general_plugins`` entry point the package declares: it does nothing
unless ``EPLB_VLLM_POLICY`` or ``EPLB_VLLM_SCHEDULER`` is set (see ``plugin``).

``propose`` is vLLM's rearrangement with eplb's runtime underneath: vLLM's configured policy
(eplb's, or vLLM's own from its registry) decides, and an ``eplb.Rebalancer`` moves the weights
and installs the result (staged off the forward thread, agreed, layer by layer).

Invalid inputs raise ``PolicyError``: both an ``eplb.InvalidArgument`` (a ValueError) with
eplb's message and an ``AssertionError``, which is what vLLM's own policy raises (bare asserts).

torch is needed only for torch tensors; vLLM is imported only by ``register``.
"""

import json
import logging
import os

import numpy as np

import eplb
from eplb.integrations import (_check_step_sum, _file_errors, _integers, _is_torch, _like,
                               _loads, _logical_maps, _numpy, _policy_env)
from eplb.integrations.vllm_scheduler import (  # vLLM's migration scheduler, eplb's schedule
    ScheduleError, install as install_scheduler, install_from_env as _install_scheduler_from_env,
    schedule_migration_batches, schedule_migration_batches_for_layers)

__all__ = [
    "EplbPolicy", "PolicyError", "make_policy", "register", "plugin", "policy_from_env",
    "compute_logical_maps", "preserve_intragpu_slots", "logical_load", "save_load_window",
    "MigrationFlow", "ScheduleError", "schedule_migration_batches",
    "schedule_migration_batches_for_layers", "install_scheduler", "propose",
]


def __getattr__(name):
    if name == "MigrationFlow":  # vLLM's class where vLLM is importable, found on first use
        from eplb.integrations import vllm_scheduler
        return vllm_scheduler.MigrationFlow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_log = logging.getLogger(__name__)

_POLICIES = (None, "balanced", "sticky", "deepseek")


class PolicyError(eplb.InvalidArgument, AssertionError):
    """Bad input to EplbPolicy: an eplb.InvalidArgument (so a ValueError) and an AssertionError,
    the exception vLLM's own policy raises for the same inputs."""


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise PolicyError(f"{name} {value} must be at least 1")
    return int(value)


def _old_at_width(old, physical):
    """The placement in force `old` ([L, W]) at the new width `physical`, as vLLM's elastic EP
    lays it out: after a scale-down vLLM passes the old, wider map and the surviving ranks are
    its first ones, so their slots are the first `physical` columns; after a scale-up the new
    ranks' slots are -1 (vLLM pads them), and a narrower map is padded with -1 the same way."""
    width = old.shape[1]
    if width >= physical:
        return old[:, :physical]
    pad = np.full((old.shape[0], physical - width), -1, dtype=old.dtype)
    return np.concatenate((old, pad), axis=1)


def _previous_placement(old, experts):
    """`old` (int64 [L, P]) as the placement eplb's sticky policy starts from: every slot holds
    an expert in [0, E). vLLM marks slots not in use (a new rank's, after a scale-up) with -1:
    those take, in order, the experts no slot holds, then slot p's p % E. An expert that still
    has no slot (it lived only on removed ranks) is left without one: sticky gives it one."""
    bad = (old < 0) | (old >= experts)
    if not bad.any():
        return old
    out = old.copy()
    for l in np.flatnonzero(bad.any(axis=1)):
        free = np.flatnonzero(bad[l])
        missing = np.setdiff1d(np.arange(experts), old[l, ~bad[l]])[:free.size]
        out[l, free] = np.concatenate((missing, free[missing.size:] % experts))
    return out


class EplbPolicy:
    """A vLLM EPLB policy (``AbstractEplbPolicy``'s contract) placing with eplb.

    Class attributes (``make_policy`` makes a subclass with others):
        policy: None (auto: "sticky" with old_global_expert_indices, "balanced" without),
            "balanced", "sticky" (as auto when there is no placement in force) or "deepseek"
            (the reference algorithm: with old indices, exactly vLLM's DefaultEplbPolicy)
        tolerance: "sticky": the balancedness it may give up against "balanced", in [0, 1)
        hierarchical: "balanced" / "sticky": pack expert groups to nodes first, like deepseek
        thorough: "balanced" / "sticky" at two slots per rank (wide decode): also build the
            replica counts level by level, several times slower, better balanced (see
            eplb.rebalance_experts); not with "deepseek"
        min_gain: 0 (default) always returns the new placement. Above 0, with a placement in
            force of the same width, the new placement is returned only when the MoE time it
            is predicted to save over the next `interval` steps reaches min_gain times its price
            (eplb.should_rebalance: its bytes at `pull_bytes_per_s`, plus `stall_s`); else the
            placement in force, so vLLM moves nothing (vLLM #47206: a rearrangement of 16-21 s
            on ROCm for a small imbalance gain). The last decision is in `last_decision`.
        cost: the eplb.cost.CostModel the check predicts with (None: the "tokens" preset)
        interval: the steps between vLLM's rearrangements (its eplb_config.step_interval)
        window_steps: the steps vLLM's load window sums (its eplb_config.window_size)
        expert_bytes: the bytes of one expert's weights in one layer (all its tensors)
        pull_bytes_per_s: the group's bandwidth moving experts (all ranks together), measured
            on a past rearrangement; 0: not known (the new placement is returned)
        stall_s: what a rearrangement stalls serving, in seconds

    Stateless but for `last_decision`: any thread may call it. The placement is computed on
    the CPU.
    """

    policy = None
    tolerance = 0.01
    hierarchical = False
    thorough = False
    min_gain = 0.0
    cost = None
    interval = 3000
    window_steps = 1000
    expert_bytes = None
    pull_bytes_per_s = 0.0
    stall_s = 0.0
    last_decision = None

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                          old_global_expert_indices=None):
        """The placement for the load `weight`.

        Parameters (vLLM's):
            weight: [layers, num_logical_experts], the logical load of the window; a torch
                tensor of any real dtype on any device (or numpy / nested lists)
            num_replicas: physical slots per layer, a multiple of num_ranks
            num_groups: expert groups (DeepSeek's group-limited routing)
            num_nodes: nodes; num_groups % num_nodes != 0 falls back to one group on one node,
                as vLLM's default policy does
            num_ranks: GPUs (EP ranks), a multiple of num_nodes
            old_global_expert_indices: the phy2log in force, or None: [layers, num_replicas],
                or under elastic EP vLLM's map at its old width (wider after a scale-down: the
                surviving ranks' slots first; narrower or with -1 slots after a scale-up)

        Returns phy2log int64 [layers, num_replicas]: a CPU torch tensor for a tensor `weight`
        on any device (vLLM asserts the map is on the CPU, and its default returns it there),
        a numpy array otherwise. Raises PolicyError for invalid input.
        """
        phy2log, _ = cls._place(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                old_global_expert_indices)
        return _cpu_like(phy2log, weight)

    @classmethod
    def rebalance_experts_with_maps(cls, weight, num_replicas, num_groups, num_nodes,
                                    num_ranks, old_global_expert_indices=None):
        """As rebalance_experts, returning older vLLM's triple (phy2log [layers, num_replicas],
        log2phy [layers, num_logical_experts, X], logcnt [layers, num_logical_experts]): log2phy
        lists each expert's slots in ascending physical index, padded with -1 to X, the largest
        replica count, as vLLM's compute_logical_maps does (vLLM pads it to its own width)."""
        phy2log, experts = cls._place(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                      old_global_expert_indices)
        log2phy, logcnt = _logical_maps(phy2log, experts)
        return tuple(_cpu_like(a, weight) for a in (phy2log, log2phy, logcnt))

    @classmethod
    def preserve_intragpu_slots(cls, phy2log, num_ranks, old_phy2log):
        """vLLM's ``DefaultEplbPolicy.preserve_intragpu_slots(phy2log, num_ranks, old_phy2log)``
        on the policy class, as vLLM's tests call it: `phy2log` with each GPU's slots reordered
        so an expert it held in `old_phy2log` keeps its old slot (see the module function).
        `old_phy2log` may be wider (its first columns are compared) or narrower (-1 padded),
        as vLLM's elastic EP passes it. numpy in, numpy out; a torch tensor gives a tensor."""
        new = _integers(phy2log, "phy2log")
        old = _integers(old_phy2log, "old_phy2log")
        if new.ndim != 2 or old.ndim != 2 or old.shape[0] != new.shape[0]:
            raise PolicyError(f"phy2log {tuple(new.shape)} and old_phy2log {tuple(old.shape)} "
                              f"must both be [layers, physical] with the same layers")
        return _typed_like(_preserve(new, int(num_ranks), _old_at_width(old, new.shape[1])),
                           phy2log)

    @classmethod
    def _place(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old):
        """(phy2log int64 numpy [L, P], experts E); eplb.InvalidArgument becomes PolicyError."""
        try:
            return cls._place_checked(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                      old)
        except PolicyError:
            raise
        except eplb.InvalidArgument as e:
            raise PolicyError(str(e)) from e

    @classmethod
    def _place_checked(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old):
        w = _loads(weight, "weight")
        if w.ndim != 2:
            raise PolicyError(f"weight must be a 2-D [layers, num_logical_experts] load, got "
                              f"shape {tuple(w.shape)}")
        layers, experts = w.shape
        physical = _positive(num_replicas, "num_replicas")
        groups = _positive(num_groups, "num_groups")
        nodes = _positive(num_nodes, "num_nodes")
        ranks = _positive(num_ranks, "num_ranks")
        if groups % nodes != 0:
            # vLLM's default policy: global balancing, one group on one node, no error.
            groups, nodes = 1, 1
        if cls.policy not in _POLICIES:
            raise PolicyError(f"{cls.__name__}.policy is {cls.policy!r}, expected one of "
                              f"{_POLICIES}")

        previous = None
        if old is not None:
            previous = _integers(old, "old_global_expert_indices")
            if previous.ndim != 2 or previous.shape[0] != layers or previous.shape[1] < 1:
                raise PolicyError(
                    f"old_global_expert_indices has shape {tuple(previous.shape)}, expected "
                    f"[layers, slots] with layers = {layers} (the phy2log in force; "
                    f"num_replicas = {physical} slots, or vLLM's old width under elastic EP)")
            previous = _old_at_width(previous, physical)

        policy = cls.policy
        if policy is None or policy == "sticky":
            policy = "sticky" if previous is not None else "balanced"
        prev = None
        if policy == "sticky":
            prev = _previous_placement(previous, experts)
        phy2log, _, _ = eplb.rebalance_experts(w, physical, groups, nodes, ranks, policy=policy,
                                               previous=prev, tolerance=float(cls.tolerance),
                                               hierarchical=bool(cls.hierarchical),
                                               thorough=bool(cls.thorough))
        if previous is not None:
            # Same experts on every GPU, each kept where it was: free, and never worse.
            phy2log = cls.preserve_intragpu_slots(phy2log, ranks, previous)
        if cls.min_gain and previous is not None and old is not None \
                and _integers(old, "old_global_expert_indices").shape[1] == physical \
                and (previous >= 0).all():
            # A rebalance only when it pays: else the placement in force, and nothing moves.
            decision = eplb.should_rebalance(
                w, previous, phy2log, ranks, interval=cls.interval,
                pull_bytes_per_s=cls.pull_bytes_per_s, min_gain=float(cls.min_gain),
                cost=cls.cost, window_steps=cls.window_steps, stall_s=cls.stall_s,
                expert_bytes=cls.expert_bytes, num_nodes=nodes)
            cls.last_decision = decision
            if not decision["rebalance"]:
                _log.info("eplb: keeping the placement in force: %s", decision["reason"])
                return np.array(previous, dtype=np.int64), experts
        return phy2log, experts


def make_policy(policy=None, tolerance=0.01, hierarchical=False, name=None, legacy=False,
                thorough=False, min_gain=0.0, cost=None, interval=3000, window_steps=1000,
                expert_bytes=None, pull_bytes_per_s=0.0, stall_s=0.0):
    """A subclass of EplbPolicy with these class attributes (see EplbPolicy), named `name`
    (default: from the policy). legacy=True: its rebalance_experts returns older vLLM's triple
    (rebalance_experts_with_maps). With min_gain > 0 it returns the placement in force when
    the new one does not pay (see EplbPolicy's min_gain): expert_bytes is then required."""
    if policy not in _POLICIES:
        raise eplb.InvalidArgument(f"policy {policy!r} is not one of {_POLICIES} (None: sticky "
                                   f"against the placement in force, balanced without)")
    tolerance = eplb._as_float(tolerance, "tolerance")
    if not 0 <= tolerance < 1:
        raise eplb.InvalidArgument(f"tolerance {tolerance} must be in [0, 1) (a loss of "
                                   f"balancedness)")
    if thorough and policy == "deepseek":
        raise eplb.InvalidArgument("thorough applies to the balanced and sticky policies (and "
                                   "None), not deepseek, whose replica counts are the "
                                   "reference's own")
    min_gain = float(min_gain)
    if not 0 <= min_gain < float("inf"):
        raise eplb.InvalidArgument(f"min_gain is {min_gain} (must be a finite number >= 0: the "
                                   f"factor on a rearrangement's price its predicted gain must "
                                   f"reach; 0 always rearranges)")
    if min_gain > 0 and expert_bytes is None:
        raise eplb.InvalidArgument("min_gain > 0 needs expert_bytes (the bytes of one expert's "
                                   "weights in one layer) to price the moves")
    if name is None:
        name = "EplbPolicy" + (policy or "auto").capitalize() + ("Legacy" if legacy else "")
    attrs = {"policy": policy, "tolerance": tolerance, "hierarchical": bool(hierarchical),
             "thorough": bool(thorough), "min_gain": min_gain, "cost": cost,
             "interval": interval, "window_steps": window_steps, "expert_bytes": expert_bytes,
             "pull_bytes_per_s": pull_bytes_per_s, "stall_s": stall_s,
             "__module__": __name__, "__doc__": EplbPolicy.__doc__}
    if legacy:
        attrs["rebalance_experts"] = classmethod(EplbPolicy.rebalance_experts_with_maps.__func__)
    return type(name, (EplbPolicy,), attrs)


def register(name="eplb", policy=None):
    """Puts `policy` (default EplbPolicy) into vLLM's policy registry under `name` and returns
    the registered class (a subclass of vLLM's AbstractEplbPolicy as well).

    vLLM's config admits only the policy names of its EPLBPolicyOption literal ("default"), and
    async EPLB (the default) only the "default" policy: register(name="default") replaces vLLM's
    policy for every engine of this process; another name needs vLLM's literal extended (see
    docs/integrations.md). vLLM picks the policy in each worker process, so register there (a
    vllm.general_plugins entry point calling ``plugin`` does). Raises ImportError without vLLM.
    """
    try:
        from vllm.distributed.eplb import policy as registry
    except ImportError as e:
        raise ImportError(
            "eplb.integrations.vllm.register() needs vLLM with the EPLB policy registry "
            "(vllm.distributed.eplb.policy.EPLB_POLICIES); vLLM is not importable here: "
            f"{e}") from e
    policies = getattr(registry, "EPLB_POLICIES", None)
    if not isinstance(policies, dict):
        raise ImportError("this vLLM has no EPLB policy registry (vllm.distributed.eplb.policy."
                          "EPLB_POLICIES is missing): it predates pluggable EPLB policies")
    cls = EplbPolicy if policy is None else policy
    abstract = getattr(registry, "AbstractEplbPolicy", None)
    if abstract is not None and not issubclass(cls, abstract):
        cls = type(cls.__name__, (cls, abstract),
                   {"__module__": cls.__module__, "__doc__": cls.__doc__})
    policies[name] = cls
    return cls


ENV_POLICY = "EPLB_VLLM_POLICY"
ENV_TOLERANCE = "EPLB_VLLM_TOLERANCE"
_ENV_POLICIES = {"auto": None, "sticky": "sticky", "balanced": "balanced",
                 "deepseek": "deepseek"}


def policy_from_env(environ=None):
    """The policy class ``EPLB_VLLM_POLICY`` asks for, or None when it is unset, empty or
    "off". Values: "auto" (sticky against the placement in force, balanced without), "sticky",
    "balanced", "deepseek" (exactly vLLM's default: switch first, then turn on sticky);
    ``EPLB_VLLM_TOLERANCE`` sets sticky's tolerance (default 0.01). Raises eplb.InvalidArgument
    naming the variable for any other value."""
    environ = os.environ if environ is None else environ
    asked = _policy_env(environ, ENV_POLICY, ENV_TOLERANCE, list(_ENV_POLICIES),
                        "vLLM keeps its own policy")
    if asked is None:
        return None
    value, tolerance = asked
    return make_policy(policy=_ENV_POLICIES[value], tolerance=tolerance,
                       name="EplbPolicy" + value.capitalize())


def plugin():
    """The ``vllm.general_plugins`` entry point the package declares (vLLM runs it in every
    process it starts). With ``EPLB_VLLM_POLICY``, ``EPLB_VLLM_SCHEDULER`` and
    ``EPLB_VLLM_COMMUNICATOR`` unset (or "off") it does nothing: installing eplb changes nothing
    in vLLM. ``EPLB_VLLM_POLICY`` set to a policy (see ``policy_from_env``) registers that policy
    as vLLM's "default" EPLB policy, the one name vLLM's config (and async EPLB) accepts.
    ``EPLB_VLLM_SCHEDULER=eplb`` puts eplb's migration schedule in place of vLLM's
    (eplb.integrations.vllm_scheduler.install). ``EPLB_VLLM_COMMUNICATOR=eplb`` installs eplb's
    EPLB communicator (eplb.integrations.vllm_communicator.install_from_env). Running it again
    is harmless. vLLM's own ``VLLM_PLUGINS`` allow-list (entry point name "eplb") also keeps it
    out. A value it does not know raises eplb.InvalidArgument naming the variable."""
    _install_scheduler_from_env()
    from eplb.integrations.vllm_communicator import install_from_env
    install_from_env()
    cls = policy_from_env()
    if cls is None:
        return None
    registered = register("default", cls)
    _log.info("eplb: vLLM's default EPLB policy is now %s (%s=%s)", registered.__name__,
              ENV_POLICY, os.environ.get(ENV_POLICY))
    return registered


def compute_logical_maps(physical_to_logical_map, num_logical_experts):
    """vLLM's compute_logical_maps: the logical maps of a phy2log.

    physical_to_logical_map: [layers, P] or [P] (one layer) expert ids; -1 marks a slot not in
    use and is left out. Returns (logical_to_physical_map [layers, E, X], logical_replica_count
    [layers, E]), [E, X] and [E] for a 1-D input: each expert's slots in ascending physical
    index, padded with -1 to X, the largest replica count over all layers and experts. Both in
    the input's dtype; torch tensors on the input's device for a tensor (vLLM's requires a CPU
    tensor), numpy arrays otherwise.
    """
    a = _integers(physical_to_logical_map, "physical_to_logical_map")
    if a.ndim not in (1, 2):
        raise eplb.InvalidArgument(f"physical_to_logical_map must be [layers, physical] or "
                                   f"[physical], got shape {tuple(a.shape)}")
    experts = eplb._as_int(num_logical_experts, "num_logical_experts", 1, eplb.MAX_EXPERTS)
    log2phy, count = _logical_maps(a.reshape(-1, a.shape[-1]), experts)
    if a.ndim == 1:
        log2phy, count = log2phy[0], count[0]
    source = physical_to_logical_map
    if _is_torch(source):
        return _like(log2phy, source).to(source.dtype), _like(count, source).to(source.dtype)
    dtype = np.asarray(source).dtype
    return log2phy.astype(dtype), count.astype(dtype)


def _cpu_like(a, template):
    """`a` (numpy) as vLLM takes a policy's output: a CPU torch tensor for a tensor input (vLLM
    asserts the map is on the CPU), the numpy array itself otherwise."""
    if _is_torch(template):
        import torch
        return torch.from_numpy(np.ascontiguousarray(a))
    return a


def _typed_like(a, template):
    """`a` (int64 numpy) in `template`'s type and integer dtype (and device, for a tensor)."""
    if _is_torch(template):
        return _like(a, template).to(template.dtype)
    return a.astype(np.asarray(template).dtype, copy=False)


def _preserve(new, ranks, old):
    """preserve_intragpu_slots on int numpy arrays [L, P] (same shape)."""
    layers, physical = new.shape
    out = new.copy()
    if ranks <= 0 or physical % ranks != 0:
        return out
    per = physical // ranks
    position = np.arange(per)[None, :]
    for g in range(ranks):
        segment = slice(g * per, (g + 1) * per)
        fresh, before, post = new[:, segment], old[:, segment], out[:, segment]
        used = np.zeros((layers, per), dtype=bool)  # new entries placed in a kept slot
        kept = np.zeros((layers, per), dtype=bool)  # slots keeping their old expert
        # Step 1: each old slot in order keeps its expert if the GPU's new experts still hold an
        # unclaimed copy of it (the first one), so duplicates match one to one.
        for s in range(per):
            match = (fresh == before[:, s:s + 1]) & ~used
            rows = np.nonzero(match.any(axis=1))[0]
            used[rows, match[rows].argmax(axis=1)] = True
            kept[rows, s] = True
            post[rows, s] = before[rows, s]
        # Step 2: the unclaimed new entries, in their order, fill the other slots in order.
        rest = np.argsort(used, axis=1, kind="stable")   # unclaimed entries first
        free = np.argsort(kept, axis=1, kind="stable")   # slots not kept first
        open_slots = per - kept.sum(axis=1, keepdims=True)
        values = np.where(position < open_slots, np.take_along_axis(fresh, rest, axis=1),
                          np.take_along_axis(post, free, axis=1))
        np.put_along_axis(post, free, values, axis=1)
    return out


def preserve_intragpu_slots(new_phy2log, num_ranks, old_phy2log):
    """vLLM's DefaultEplbPolicy.preserve_intragpu_slots: `new_phy2log` with each GPU's slots
    reordered so an expert it held before keeps its old slot.

    GPU g owns slots [g*P/G, (g+1)*P/G). On each GPU, every old slot (in order) whose expert is
    among the GPU's new experts keeps it (copies matched one to one); the other new experts fill
    the remaining slots in their order. No expert changes GPU, so the balancedness is
    unchanged. Both maps [layers, P]; num_ranks not dividing P returns new_phy2log unchanged.
    Returns the input's type: a numpy array or a torch tensor (dtype and device of
    new_phy2log).
    """
    new = _integers(new_phy2log, "new_phy2log")
    old = _integers(old_phy2log, "old_phy2log")
    if new.ndim != 2 or new.shape != old.shape:
        raise eplb.InvalidArgument(
            f"new_phy2log {tuple(new.shape)} and old_phy2log {tuple(old.shape)} must both be "
            f"[layers, physical] of one shape (the same GPUs and slots per GPU)")
    return _typed_like(_preserve(new, int(num_ranks), old), new_phy2log)


def _logical_steps(expert_load_window, physical_to_logical_map, num_logical_experts):
    """The window as logical loads, numpy [steps, L, E] (int64 for integer counts, float64
    otherwise)."""
    window = _numpy(expert_load_window)
    if window.dtype.kind not in "iuf":
        raise eplb.InvalidArgument(f"expert_load_window must hold token counts, got dtype "
                                   f"{window.dtype}")
    # A NaN would make every sum it enters NaN, a negative count would cancel real ones.
    bad = ~np.isfinite(window) if window.dtype.kind == "f" else np.zeros(window.shape, bool)
    if window.dtype.kind in "if":
        bad |= window < 0
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise eplb.InvalidArgument(f"expert_load_window{list(at)} is {window[at]}: token counts "
                                   f"must be finite and non-negative")
    if window.ndim == 2:
        window = window[None]
    if window.ndim != 3:
        raise eplb.InvalidArgument(f"expert_load_window must be [window, layers, physical] or "
                                   f"[layers, physical], got shape {tuple(window.shape)}")
    phy2log = _integers(physical_to_logical_map, "physical_to_logical_map")
    if phy2log.ndim != 2:
        raise eplb.InvalidArgument(f"physical_to_logical_map must be [layers, physical], got "
                                   f"shape {tuple(phy2log.shape)}")
    layers, physical = phy2log.shape
    if window.shape[1] != layers or window.shape[2] < physical:
        raise eplb.InvalidArgument(
            f"expert_load_window {tuple(window.shape)} does not match physical_to_logical_map "
            f"{tuple(phy2log.shape)}: expected [window, {layers}, at least {physical}]")
    experts = eplb._as_int(num_logical_experts, "num_logical_experts", 1, eplb.MAX_EXPERTS)
    if np.any(phy2log >= experts):
        raise eplb.InvalidArgument(f"physical_to_logical_map holds expert {phy2log.max()}, "
                                   f"outside [0, {experts})")
    # vLLM counts only the slots in use: the first `physical` columns, entries >= 0.
    window = window[:, :, :physical]
    dtype = np.float64 if window.dtype.kind == "f" else np.int64
    valid = phy2log >= 0
    row, slot = np.nonzero(valid)
    column = row * experts + phy2log[row, slot]
    out = np.zeros((window.shape[0], layers * experts), dtype=dtype)
    if column.size:
        # Scatter-add as a segmented sum over the slots sorted by (layer, expert): exact for
        # integer counts, and fast on a whole window.
        order = np.argsort(column, kind="stable")
        sorted_column = column[order]
        starts = np.flatnonzero(np.r_[True, sorted_column[1:] != sorted_column[:-1]])
        values = window[:, row[order], slot[order]].astype(dtype)
        out[:, sorted_column[starts]] = np.add.reduceat(values, starts, axis=1)
    return out.reshape(-1, layers, experts)


def logical_load(expert_load_window, physical_to_logical_map, num_logical_experts):
    """The logical load vLLM's rearrangement hands its policy, from its physical load window.

    expert_load_window: [window, layers, physical] (vLLM's EplbModelState.expert_load_window)
        or [layers, physical] (one pass, expert_load_pass), token counts per physical slot
    physical_to_logical_map: [layers, physical], the placement the window was recorded under;
        -1 entries (slots not in use) are left out, as are window columns past its width
    Returns [layers, num_logical_experts], the window summed: int64 for integer counts (float64
    for floats); a torch tensor on the window's device for a tensor, numpy otherwise. vLLM
    all-reduces this over the EP group before the policy sees it: pass a window that already
    holds every rank's counts (or sum the results).
    """
    steps = _logical_steps(expert_load_window, physical_to_logical_map, num_logical_experts)
    with np.errstate(over="ignore"):
        total = steps.sum(axis=0)
    _check_step_sum(steps, total, "expert_load_window")
    return _like(total, expert_load_window)


def save_load_window(path, expert_load_window, physical_to_logical_map, num_logical_experts,
                     window_step=None):
    """Writes vLLM's load window as eplb's load history, one entry per window step:

        {"load_history": [{"logical_expert_load": [[...]]}, ...]}

    the file ``eplb plan --load`` (which sums the steps) and ``eplb simulate --load-history``
    read. Arguments as logical_load's. window_step: vLLM's expert_load_window_step (the ring
    buffer's next slot to write), to write the steps oldest first; None keeps the buffer's
    order. Returns the number of steps written.
    """
    steps = _logical_steps(expert_load_window, physical_to_logical_map, num_logical_experts)
    if window_step is not None:
        steps = np.roll(steps, -(int(window_step) % steps.shape[0]), axis=0)
    with _file_errors(path, "write"), open(path, "w") as f:
        f.write('{"load_history": [')
        for s in range(steps.shape[0]):
            f.write(",\n" if s else "\n")
            json.dump({"logical_expert_load": steps[s].tolist()}, f, separators=(",", ":"))
        f.write("\n]}\n")
    return steps.shape[0]


def _policy_class(policy):
    """A policy class from `policy`: a class (or instance) with vLLM's ``rebalance_experts``,
    a name in vLLM's EPLB_POLICIES registry (needs vLLM), or None (EplbPolicy)."""
    if policy is None:
        return EplbPolicy
    if isinstance(policy, str):
        try:
            from vllm.distributed.eplb import policy as registry
        except ImportError as e:
            raise eplb.InvalidArgument(
                f"policy {policy!r}: a policy name is looked up in vLLM's EPLB_POLICIES, and "
                f"vLLM is not importable here ({e}); pass the policy class itself") from e
        policies = getattr(registry, "EPLB_POLICIES", {})
        if policy not in policies:
            raise eplb.InvalidArgument(f"policy {policy!r} is not in vLLM's EPLB_POLICIES "
                                       f"({', '.join(sorted(policies))})")
        return policies[policy]
    if not callable(getattr(policy, "rebalance_experts", None)):
        raise eplb.InvalidArgument(f"policy {policy!r} has no rebalance_experts (vLLM's policy "
                                   f"interface, AbstractEplbPolicy)")
    return policy


def propose(rebalancer, weight, policy=None, num_groups=1, num_nodes=1):
    """vLLM's rearrangement, with eplb's runtime moving the weights: `policy` places the load
    `weight` against the placement in force, and `rebalancer` (an eplb.Rebalancer) installs the
    result (Rebalancer.propose): the moves are planned, staged off the forward thread, agreed
    and installed layer by layer, at the same step on every rank, into the engine's tensors and
    maps. Give the Rebalancer config "interval": 0 so that only the engine's policy places.

    weight: [layers, logical experts], the global logical load of the window, as vLLM's
        rearrange() hands its policy (its expert_load_window all-reduced over the EP group,
        logical_load() of it): the same on every rank
    policy: vLLM's policy interface, a class (or instance) with ``rebalance_experts(weight,
        num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)``: eplb's
        (EplbPolicy, make_policy(...); the default), vLLM's own DefaultEplbPolicy, or the name
        of one in vLLM's EPLB_POLICIES registry. A policy that returns older vLLM's triple is
        taken too (its phy2log).
    num_groups, num_nodes: as vLLM passes them (its model's expert groups, its nodes).

    After a reconfigure() to fewer seats the policy places over the members only, as vLLM's
    elastic EP calls it: num_replicas and num_ranks the members', the placement in force at the
    members' width (member g's slots at [g * slots_per_rank, ...)). Call it on every rank at the
    same step (vLLM's rearrange runs at the same step everywhere), while no rebalance runs
    (``rebalancer.rebalancing`` False). Returns the proposed phy2log, as the policy returned it.
    """
    cls = _policy_class(policy)
    spr = rebalancer.slots_per_rank
    members = list(rebalancer.members())
    old = np.asarray(rebalancer.placement(), dtype=np.int64)
    if len(members) < rebalancer.world_size:  # the members' slots, renumbered (vLLM's view)
        old = np.concatenate([old[:, g * spr:(g + 1) * spr] for g in members], axis=1)
    if _is_torch(weight):
        import torch
        old = torch.from_numpy(old)
    # Positionally, as vLLM's rearrange() calls it.
    out = cls.rebalance_experts(weight, len(members) * spr, num_groups, num_nodes, len(members),
                                old)
    phy2log = out[0] if isinstance(out, tuple) else out
    rebalancer.propose(phy2log)
    return phy2log

