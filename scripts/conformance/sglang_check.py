"""eplb against the real SGLang, on the CPU: the functions SGLang's EPLB calls, with eplb behind them.

1. SGLang's dispatcher ``eplb_algorithms.rebalance_experts`` (its own deepseek, hierarchical and
   elasticity_aware algorithms) against ``eplb.integrations.sglang.rebalance_experts`` called the
   same way: identical placements on tie-free loads, with SGLang's EplbAlgorithm members.
2. ``eplb.integrations.sglang.install()``: SGLang's dispatcher now places with eplb (deepseek mode:
   still SGLang's outputs; sticky: few moves from the map in force), ``uninstall()`` restores it.
3. ``ExpertLocationMetadata.init_by_eplb``, the call site itself, with a minimal runtime context
   standing in for a server's (a model config, ep_size, nnodes, static dispatch) and eplb
   installed; eplb's ``expert_location_metadata`` builds the same fields, and SGLang's own
   dataclass accepts them.
4. ``ExpertLocationMetadata.init_by_mapping(moe_ep_rank=r)`` for every rank, without and with an
   all-to-all backend (which narrows each expert's replicas to the one nearest rank r), against
   ``expert_location_metadata(ep_rank=r, a2a_backend=...)``.
Prints one line per check and "sglang conformance: N/N" last; exits 1 if any fails.
"""

import os
import sys
import tempfile
import traceback
import types

import numpy as np
import torch

import sglang
from sglang.srt.eplb import eplb_algorithms as algorithms

import eplb
from eplb.integrations import sglang as eplb_sglang

L, E, P, G, NODES, GROUPS = 4, 64, 96, 8, 2, 8
Alg = algorithms.EplbAlgorithm
results = []


def check(name):
    def wrap(fn):
        try:
            detail = fn()
            results.append((name, True, detail or ""))
        except Exception as e:  # report and go on: every check is tried
            results.append((name, False, f"{type(e).__name__}: {str(e)[:300]}"))
            traceback.print_exc(file=sys.stderr)
        return fn
    return wrap


def counts(seed, steps=3):
    """A recorder-like int32 [steps, L, E] load whose sum has no ties."""
    rng = np.random.default_rng(seed)
    total = rng.choice(np.arange(10_000, 100_000), size=(L, E), replace=False)
    parts = rng.multinomial(1, [1 / steps] * steps, size=(L, E)).transpose(2, 0, 1)
    return torch.from_numpy((parts * total).astype(np.int32))


def same(a, b):
    return all(torch.equal(torch.as_tensor(x).cpu(), torch.as_tensor(y).cpu())
               for x, y in zip(a, b))


def call(fn, c, algorithm):
    # ExpertLocationMetadata.init_by_eplb's keywords.
    return fn(tokens_per_expert=c, num_physical_experts=P, num_local_physical_experts=P // G,
              num_groups=GROUPS, num_nodes=NODES, algorithm=algorithm)


ORIGINAL = algorithms.rebalance_experts


def init_single_process_group():
    """SGLang reads torch.distributed's rank and world here and there (a server has a group)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="eplb-sglang-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


class ElasticState:
    """SGLang's elastic EP state while `active` (int32 flags) says which ranks are live."""

    def __init__(self, active):
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
        self.manager, self.active = ElasticEPStateManager, active

    def __enter__(self):
        self.saved = self.manager._instance
        self.manager._instance = types.SimpleNamespace(active_ranks=self.active)

    def __exit__(self, *exc):
        self.manager._instance = self.saved


init_single_process_group()


@check("eplb's rebalance_experts = SGLang's (deepseek, deepseek_hierarchical, elasticity_aware)")
def _():
    c = counts(1)
    for alg in (Alg.deepseek, Alg.deepseek_hierarchical):
        theirs, ours = call(ORIGINAL, c, alg), call(eplb_sglang.rebalance_experts, c, alg)
        assert same(theirs[0::2], ours[0::2]), f"{alg.name}: phy2log or counts differ"
        assert torch.equal(theirs[1].sort(-1).values, ours[1].sort(-1).values), alg.name
    active = torch.ones(G, dtype=torch.int32)
    active[5] = 0
    for flags in (torch.ones(G, dtype=torch.int32), active):
        with ElasticState(flags):
            theirs = call(ORIGINAL, c, Alg.elasticity_aware)
        ours = eplb_sglang.rebalance_experts(c, P, P // G, GROUPS, NODES, Alg.elasticity_aware,
                                             active_ranks=flags)
        assert same(theirs[0::2], ours[0::2]), "elasticity_aware: phy2log or counts differ"
        assert torch.equal(theirs[1].sort(-1).values, ours[1].sort(-1).values)
    return "identical placements (elasticity_aware with every rank live, and rank 5 dead)"


@check("elasticity_aware over active ranks = SGLang's inner elasticity_aware")
def _():
    from sglang.srt.eplb.eplb_algorithms import elasticity_aware
    c = counts(2).sum(0)
    active = torch.ones(G, dtype=torch.int32)
    active[3] = 0
    theirs = elasticity_aware.rebalance_experts(weight=c, num_replicas=P, num_groups=GROUPS,
                                                num_nodes=NODES, num_gpus=G,
                                                enable_hierarchical=False, active_ranks=active)
    ours = eplb_sglang.rebalance_experts_elasticity_aware(
        weight=c, num_replicas=P, num_groups=GROUPS, num_nodes=NODES, num_gpus=G,
        enable_hierarchical=False, active_ranks=active)
    assert same(theirs[0::2], ours[0::2]), "phy2log or counts differ"
    assert torch.equal(theirs[1].sort(-1).values, ours[1].sort(-1).values)
    return "rank 3 dead: identical"


@check("install(): SGLang's dispatcher places with eplb; uninstall() restores it")
def _():
    c = counts(3)
    eplb_sglang.install(policy="deepseek")
    try:
        assert algorithms.rebalance_experts is not ORIGINAL
        assert same(call(algorithms.rebalance_experts, c, Alg.deepseek_hierarchical),
                    call(ORIGINAL, c, Alg.deepseek_hierarchical)), "deepseek mode differs"
        algo = eplb_sglang.install(policy="sticky")
        first = call(algorithms.rebalance_experts, c, Alg.deepseek)
        drift = (c.double() * torch.exp(0.1 * torch.randn(c.shape,
                 generator=torch.Generator().manual_seed(3)))).round().to(torch.int32)
        second = call(algorithms.rebalance_experts, drift, Alg.deepseek)
        moved = (second[0] != first[0]).float().mean().item()
        reference = call(ORIGINAL, drift, Alg.deepseek)[0]
        ref_moved = (reference != call(ORIGINAL, c, Alg.deepseek)[0]).float().mean().item()
        assert np.array_equal(algo.previous, second[0].numpy())
        active = torch.ones(G, dtype=torch.int32)
        active[2] = 0
        local = P // G
        with ElasticState(active):  # under elastic EP: never a slot on the dead rank
            third = call(algorithms.rebalance_experts, drift, Alg.elasticity_aware)
        assert (third[0][:, 2 * local:3 * local] == 0).all()
        assert not ((third[1] >= 2 * local) & (third[1] < 3 * local)).any()
    finally:
        assert eplb_sglang.uninstall()
    assert algorithms.rebalance_experts is ORIGINAL
    return f"sticky moved {moved:.1%} of the slots under drift, SGLang's deepseek {ref_moved:.1%}"


@check("the sglang.srt.plugins entry point installs eplb when EPLB_SGLANG_POLICY asks")
def _():
    import importlib
    from importlib.metadata import entry_points
    names = [e.name for e in entry_points(group="sglang.srt.plugins")]
    assert "eplb" in names, f"no eplb entry point in sglang.srt.plugins ({names})"
    plugins = importlib.import_module("sglang.srt.plugins")
    os.environ["EPLB_SGLANG_POLICY"] = "sticky"
    try:
        plugins._plugins_loaded = False
        plugins.load_plugins()
        installed = getattr(algorithms.rebalance_experts, "eplb_algorithm", None)
        assert installed is not None and installed.policy == "sticky", "not installed"
    finally:
        del os.environ["EPLB_SGLANG_POLICY"]
        eplb_sglang.uninstall()
    return "SGLang's load_plugins() installed eplb's sticky"


def stub_context(el, ep_size, nnodes, redundant, raw_algorithm, a2a_backend="none"):
    """The runtime context init_by_eplb and init_by_mapping read, as a server with these
    settings publishes it."""
    moe = types.SimpleNamespace(eplb_algorithm=raw_algorithm, ep_num_redundant_experts=redundant,
                                ep_dispatch_algorithm="static", ep_join_mode=None,
                                moe_a2a_backend=a2a_backend, elastic_ep_backend=None)
    parallel = types.SimpleNamespace(ep_size=ep_size, nnodes=nnodes, elastic_ep_initial_size=None,
                                     tp_size=ep_size, ep_join_rank_offset=0,
                                     max_world_size=ep_size)
    saved = {k: getattr(el, k) for k in ("get_exec", "get_parallel", "get_device")}
    el.get_exec = lambda: types.SimpleNamespace(moe=moe)
    el.get_parallel = lambda: parallel
    el.get_device = lambda: types.SimpleNamespace(device=torch.device("cpu"))
    config = el.ModelConfigForExpertLocation(num_layers=L, num_logical_experts=E,
                                             num_groups=GROUPS)
    saved_from = el.ModelConfigForExpertLocation.__dict__["from_model_config"]
    el.ModelConfigForExpertLocation.from_model_config = staticmethod(lambda model_config: config)

    def restore():
        for k, v in saved.items():
            setattr(el, k, v)
        el.ModelConfigForExpertLocation.from_model_config = saved_from
    return restore


@check("ExpertLocationMetadata.init_by_eplb with eplb installed")
def _():
    from sglang.srt.eplb import expert_location as el
    restore = stub_context(el, G, NODES, P - E, "deepseek_hierarchical")
    try:
        c = counts(4)
        theirs = el.ExpertLocationMetadata.init_by_eplb(None, c)
        eplb_sglang.install(policy="deepseek")
        try:
            ours = el.ExpertLocationMetadata.init_by_eplb(None, c)
        finally:
            eplb_sglang.uninstall()
        for f in ("physical_to_logical_map", "physical_to_logical_map_cpu",
                  "logical_to_all_physical_map_num_valid"):
            assert torch.equal(getattr(theirs, f), getattr(ours, f)), f
        assert ours.logical_to_rank_dispatch_physical_map is not None
        # eplb's metadata for the same placement: the same fields SGLang built.
        log2phy = eplb_sglang.rebalance_experts(c, P, P // G, GROUPS, NODES,
                                                Alg.deepseek_hierarchical)[1]
        mine = eplb_sglang.expert_location_metadata(ours.physical_to_logical_map, E, G,
                                                    logical_to_physical_map=log2phy, ep_rank=0,
                                                    num_nodes=NODES)
        assert list(mine) == [f.name for f in el.ExpertLocationMetadata.__dataclass_fields__
                              .values()], f"fields {list(mine)}"
        el.ExpertLocationMetadata(**mine)  # SGLang's own dataclass takes them (__post_init__)
        for f in ("physical_to_logical_map", "logical_to_all_physical_map_num_valid",
                  "logical_to_rank_dispatch_physical_map"):
            assert torch.equal(mine[f], getattr(theirs, f)), f"{f} differs from SGLang's"
        assert torch.equal(mine["logical_to_all_physical_map"].sort(-1).values,
                           theirs.logical_to_all_physical_map.sort(-1).values)
        eplb_sglang.install(policy="sticky")
        try:
            sticky = el.ExpertLocationMetadata.init_by_eplb(None, c)
        finally:
            eplb_sglang.uninstall()
        assert sticky.physical_to_logical_map.shape == (L, P)
    finally:
        restore()
    return "SGLang's fields and static dispatch map, identical in deepseek mode"


@check("init_by_mapping(moe_ep_rank=r) = expert_location_metadata(ep_rank=r), every rank, "
       "with and without an all-to-all backend")
def _():
    from sglang.srt.eplb import expert_location as el
    phy2log = eplb_sglang.rebalance_experts(counts(5), P, P // G, GROUPS, NODES,
                                            Alg.deepseek_hierarchical)[0]
    fields = ("physical_to_logical_map", "logical_to_all_physical_map",
              "logical_to_all_physical_map_num_valid", "logical_to_rank_dispatch_physical_map")
    narrowed = 0
    for backend in ("none", "deepep"):
        restore = stub_context(el, G, NODES, P - E, "deepseek", a2a_backend=backend)
        try:
            for r in range(G):
                theirs = el.ExpertLocationMetadata.init_by_mapping(None, phy2log, moe_ep_rank=r)
                mine = eplb_sglang.expert_location_metadata(phy2log, E, G, ep_rank=r,
                                                            num_nodes=NODES,
                                                            a2a_backend=backend)
                for f in fields:
                    assert torch.equal(torch.as_tensor(mine[f]), getattr(theirs, f).cpu()), \
                        f"{backend}, rank {r}: {f} differs from SGLang's"
                if backend != "none":
                    plain = eplb_sglang.expert_location_metadata(phy2log, E, G, ep_rank=r,
                                                                 num_nodes=NODES)
                    narrowed += int((plain["logical_to_all_physical_map_num_valid"] !=
                                     mine["logical_to_all_physical_map_num_valid"]).sum())
        finally:
            restore()
    assert narrowed > 0, "the all-to-all backend narrowed nothing: the check proves nothing"
    return f"{G} ranks x 2 backends identical ({narrowed} counts narrowed per rank in all)"


print(f"sglang {sglang.__version__}, torch {torch.__version__}, eplb {eplb.__version__}")
for name, ok, detail in results:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
passed = sum(ok for _, ok, _ in results)
print(f"sglang conformance: {passed}/{len(results)}")
sys.exit(0 if passed == len(results) else 1)
