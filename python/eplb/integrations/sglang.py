"""eplb for SGLang: placement in SGLang's conventions, and the files SGLang reads and writes.

SGLang (python/sglang/srt/eplb/) places experts with ``eplb_algorithms.rebalance_experts(
tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups, num_nodes,
algorithm)``, builds its ``ExpertLocationMetadata`` from the phy2log it returns, starts from
``--init-expert-location FILE`` (``{"physical_to_logical_map": ...}`` or ``{"logical_count":
...}``), and its expert-distribution recorder dumps ``{"logical_count": [steps][L][E], ...}``.

- ``rebalance_experts``: that call with eplb's policies, the same outputs' shapes and types.
- ``expert_location_metadata``: the maps ExpertLocationMetadata holds, for a phy2log.
- ``write_init_expert_location``: the file of ``--init-expert-location``.
- ``read_expert_distribution`` / ``write_expert_distribution``: the recorder's statistics.

Words as in SGLang: physical slot p lives on rank p // num_local_physical_experts.
"""

import json

import numpy as np

import eplb
from eplb.integrations import _integers, _like, _loads, _logical_maps

__all__ = [
    "ALGORITHMS", "rebalance_experts", "expert_location_metadata", "write_init_expert_location",
    "read_expert_distribution", "write_expert_distribution",
]

# eplb's policies and SGLang's algorithm names (--eplb-algorithm) this module takes.
ALGORITHMS = ("balanced", "sticky", "deepseek", "deepseek_hierarchical", "auto")


def _algorithm_name(policy):
    # SGLang's EplbAlgorithm enum members are accepted by name.
    name = getattr(policy, "name", policy)
    if not isinstance(name, str):
        raise TypeError(f"policy must be a string, got {policy!r}")
    if name not in ALGORITHMS:
        raise eplb.InvalidArgument(
            f"policy {name!r} is not one of {', '.join(ALGORITHMS)} (SGLang's deepseek_vec and "
            f"elasticity_aware algorithms have no eplb counterpart)")
    return name


def rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts,
                      num_groups, num_nodes, policy="balanced", *, previous=None,
                      tolerance=0.01, hierarchical=False, thorough=False):
    """Expert placement for every layer, in the argument order of SGLang's
    ``eplb_algorithms.rebalance_experts``.

    Parameters:
        tokens_per_expert: [layers, experts] or [steps, layers, experts] (steps are summed, as
            SGLang's deepseek algorithms do), the logical load; torch (any real dtype, any
            device), numpy or nested lists
        num_physical_experts: P, slots per layer (SGLang: experts + ep_num_redundant_experts)
        num_local_physical_experts: slots per rank; ranks = P // this, which must divide P
        num_groups: expert groups of the model, or None (no groups: one)
        num_nodes: nodes (SGLang's --nnodes)
        policy: "balanced" (default), "sticky" (needs previous), or SGLang's algorithm names:
            "deepseek" (the reference, global: SGLang's non-hierarchical deepseek),
            "deepseek_hierarchical" (the reference, groups packed to nodes; num_groups must be a
            multiple of num_nodes) and "auto" (eplb's choice: sticky with previous, balanced
            without); an EplbAlgorithm member by its name
        previous: [layers, P], the phy2log in force (sticky)
        tolerance: sticky: the balancedness it may give up against balanced, in [0, 1)
        hierarchical: balanced / sticky: pack groups to nodes first
        thorough: balanced / sticky at two slots per rank: also build the replica counts level
            by level (see eplb.rebalance_experts); not with the deepseek names

    Returns SGLang's triple, int64 (torch tensors on tokens_per_expert's device for a tensor,
    numpy arrays otherwise): physical_to_logical_map [layers, P], logical_to_physical_map
    [layers, experts, X] padded with -1 (X the largest replica count; replicas in the
    reference's order for the deepseek names, in slot order otherwise), logical_count
    [layers, experts].
    """
    load = _loads(tokens_per_expert, "tokens_per_expert")
    if load.ndim == 3:
        load = load.sum(axis=0)
    elif load.ndim != 2:
        raise eplb.InvalidArgument(f"tokens_per_expert must be [layers, experts] or [steps, "
                                   f"layers, experts], got shape {tuple(load.shape)}")
    physical = eplb._as_int(num_physical_experts, "num_physical_experts", 1, eplb.MAX_PHYSICAL)
    local = eplb._as_int(num_local_physical_experts, "num_local_physical_experts", 1,
                         eplb.MAX_PHYSICAL)
    if physical % local != 0:
        raise eplb.InvalidArgument(
            f"num_physical_experts {physical} is not a multiple of num_local_physical_experts "
            f"{local} (every rank holds the same number of slots)")
    ranks = physical // local
    groups = 1 if num_groups is None else eplb._as_int(num_groups, "num_groups", 1,
                                                       eplb.MAX_EXPERTS)
    nodes = eplb._as_int(num_nodes, "num_nodes", 1, eplb.MAX_RANKS)
    name = _algorithm_name(policy)
    prev = None if previous is None else _integers(previous, "previous")

    if name == "auto":
        name = "sticky" if prev is not None else "balanced"
    if name == "sticky" and prev is None:
        raise eplb.InvalidArgument("policy sticky needs previous, the physical_to_logical_map "
                                   "[layers, num_physical_experts] in force")
    if name == "deepseek":
        groups, nodes = 1, 1  # SGLang's deepseek: the reference's global policy
    elif name == "deepseek_hierarchical" and groups % nodes != 0:
        raise eplb.InvalidArgument(
            f"deepseek_hierarchical needs num_groups {groups} to be a multiple of num_nodes "
            f"{nodes} (whole groups are packed onto nodes); use deepseek or balanced")
    core = "deepseek" if name.startswith("deepseek") else name
    out = eplb.rebalance_experts(load, physical, groups, nodes, ranks, policy=core,
                                 previous=prev if core == "sticky" else None,
                                 tolerance=tolerance, hierarchical=hierarchical,
                                 thorough=thorough)
    return tuple(_like(a, tokens_per_expert) for a in out)


def expert_location_metadata(physical_to_logical_map, num_logical_experts, ep_size):
    """What SGLang's ExpertLocationMetadata holds for the placement `physical_to_logical_map`
    ([layers, P] expert ids) on `ep_size` ranks, as a dict:

        physical_to_logical_map: [layers, P]
        logical_to_all_physical_map: [layers, experts, P], each expert's slots in ascending
            physical id, padded with -1 to P (SGLang's _compute_logical_to_all_physical_map,
            padded as its _init_raw does)
        logical_to_all_physical_map_num_valid: [layers, experts], the replica counts

    All int64; torch tensors on the input's device for a tensor, numpy arrays otherwise.
    P must be a multiple of ep_size and every expert hold a slot (SGLang's dispatch divides by
    the count).
    """
    phy2log = _integers(physical_to_logical_map, "physical_to_logical_map")
    if phy2log.ndim != 2:
        raise eplb.InvalidArgument(f"physical_to_logical_map must be [layers, physical], got "
                                   f"shape {tuple(phy2log.shape)}")
    layers, physical = phy2log.shape
    experts = eplb._as_int(num_logical_experts, "num_logical_experts", 1, eplb.MAX_EXPERTS)
    ranks = eplb._as_int(ep_size, "ep_size", 1, eplb.MAX_RANKS)
    if physical % ranks != 0:
        raise eplb.InvalidArgument(f"physical experts {physical} is not a multiple of ep_size "
                                   f"{ranks} (every rank holds the same number of slots)")
    if np.any(phy2log < 0):
        raise eplb.InvalidArgument("physical_to_logical_map holds a negative expert id")
    log2phy, count = _logical_maps(phy2log, experts, width=physical)
    if np.any(count == 0):
        l, e = np.argwhere(count == 0)[0]
        raise eplb.InvalidArgument(f"layer {l} expert {e} has no slot (every logical expert "
                                   f"needs at least one)")
    out = {
        "physical_to_logical_map": phy2log,
        "logical_to_all_physical_map": log2phy,
        "logical_to_all_physical_map_num_valid": count,
    }
    return {k: _like(v, physical_to_logical_map) for k, v in out.items()}


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
        torch.save({"physical_to_logical_map": torch.from_numpy(phy2log)}, path)
    elif path.endswith(".json"):
        with open(path, "w") as f:
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
        data = torch.load(path, weights_only=True, map_location="cpu")
    elif path.endswith(".json"):
        with open(path) as f:
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
    with open(path, "w") as f:
        json.dump({"logical_count": value.tolist()}, f, separators=(",", ":"))
        f.write("\n")
