"""eplb's SGLang functions where SGLang calls them: ``ExpertLocationMetadata.init_by_eplb``'s
keyword call with an ``EplbAlgorithm`` member, elastic EP's ``elasticity_aware`` over the active
ranks, the metadata it builds (static dispatch map included), ``install`` into SGLang's
``eplb_algorithms``, and the stateful ``Algorithm`` that reaches sticky.

What SGLang does around the call is restated here from its sources (python/sglang/srt/eplb/
eplb_algorithms/, expert_location.py, elastic_ep/elastic_ep.py), not imported: the default suite
has no SGLang. scripts/engine-conformance.sh runs the real one.
"""

import enum
import sys
import types

import numpy as np
import pytest

import eplb
import numpy_reference
from eplb.integrations import sglang

torch = pytest.importorskip("torch")

LAYERS, EXPERTS, GROUPS = 3, 64, 8


class EplbAlgorithm(enum.Enum):
    """SGLang's enum: its members' names and values."""
    deepseek = 1
    deepseek_hierarchical = 2
    deepseek_vec = 3
    deepseek_vec_hierarchical = 4
    elasticity_aware = 5
    elasticity_aware_hierarchical = 6


def compute_algorithm(raw_algorithm, num_groups, num_nodes):
    """SGLang's compute_algorithm: a name, or "auto" (hierarchical when the groups fit nodes)."""
    if raw_algorithm != "auto":
        return EplbAlgorithm[raw_algorithm]
    if num_groups is not None and num_groups % num_nodes == 0:
        return EplbAlgorithm.deepseek_hierarchical
    return EplbAlgorithm.deepseek


def recorder_counts(seed, steps=4, layers=LAYERS, experts=EXPERTS):
    """The recorder's logical_count: int32 [buffer_size, layers, experts], all-reduced, without
    ties once summed (so the reference's outputs are exact)."""
    rng = np.random.default_rng(seed)
    total = rng.choice(np.arange(10_000, 100_000), size=(layers, experts), replace=False)
    parts = rng.multinomial(1, [1 / steps] * steps, size=(layers, experts)).transpose(2, 0, 1)
    return torch.from_numpy((parts * total).astype(np.int32))


def init_by_eplb(algorithms, logical_count, ep_size, num_physical, num_groups, nnodes,
                 raw_algorithm="auto", use_flat_topology=False):
    """ExpertLocationMetadata.init_by_eplb's call, by keyword, as SGLang makes it."""
    if logical_count.dim() == 2:
        logical_count = logical_count.unsqueeze(0)
    num_nodes = 1 if use_flat_topology else nnodes
    return algorithms.rebalance_experts(
        tokens_per_expert=logical_count,
        num_physical_experts=num_physical,
        num_local_physical_experts=num_physical // ep_size,
        num_groups=num_groups,
        num_nodes=num_nodes,
        algorithm=compute_algorithm(raw_algorithm, num_groups, num_nodes),
    )


def check_triple(out, physical, experts=EXPERTS, layers=LAYERS):
    phy2log, log2phy, count = out
    for t in out:
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu"
    assert tuple(phy2log.shape) == (layers, physical) and tuple(count.shape) == (layers, experts)
    for l in range(layers):
        for e in range(experts):
            slots = log2phy[l, e].tolist()
            n = int(count[l, e])
            assert n >= 1 and all(s >= 0 for s in slots[:n]) and all(s == -1 for s in slots[n:])
            assert all(int(phy2log[l, s]) == e for s in slots[:n])


@pytest.mark.parametrize("raw", ["auto", "deepseek", "deepseek_hierarchical", "elasticity_aware",
                                 "elasticity_aware_hierarchical"])
def test_init_by_eplb_keyword_call_is_the_reference(raw):
    counts = recorder_counts(1)
    out = init_by_eplb(sglang, counts, 8, 80, GROUPS, 2, raw)
    check_triple(out, 80)
    hierarchical = raw in ("auto", "deepseek_hierarchical", "elasticity_aware_hierarchical")
    groups, nodes = (GROUPS, 2) if hierarchical else (1, 1)
    ref = numpy_reference.rebalance_experts(counts.sum(0).numpy().astype(np.float32), 80, groups,
                                            nodes, 8)
    assert np.array_equal(out[0].numpy(), ref[0]) and np.array_equal(out[2].numpy(), ref[2])
    # A 2-D count is unsqueezed by init_by_eplb; positional calls take the same arguments.
    again = sglang.rebalance_experts(counts.sum(0), 80, 10, GROUPS, 2,
                                     compute_algorithm(raw, GROUPS, 2))
    assert all(torch.equal(a, b) for a, b in zip(out, again))


def test_init_by_eplb_then_init_raw_fields():
    # _init_raw pads the algorithm's log2phy to P, counts the valid entries, keeps CPU copies and
    # (static dispatch) this rank's dispatch row, all from the algorithm's own log2phy.
    counts = recorder_counts(2)
    phy2log, log2phy, _ = init_by_eplb(sglang, counts, 8, 80, GROUPS, 2)
    rows = []
    for rank in range(8):
        meta = sglang.expert_location_metadata(phy2log, EXPERTS, 8, logical_to_physical_map=log2phy,
                                               ep_rank=rank, num_nodes=2)
        assert meta["ep_size"] == 8
        padded = meta["logical_to_all_physical_map"]
        assert tuple(padded.shape) == (LAYERS, EXPERTS, 80)
        assert torch.equal(padded[..., :log2phy.shape[2]], log2phy)
        assert (padded[..., log2phy.shape[2]:] == -1).all()
        assert torch.equal(meta["logical_to_all_physical_map_num_valid"], (log2phy != -1).sum(-1))
        assert torch.equal(meta["physical_to_logical_map_cpu"], phy2log)
        rows.append(meta["logical_to_rank_dispatch_physical_map"])
    local = 10
    for rank, row in enumerate(rows):
        assert tuple(row.shape) == (LAYERS, EXPERTS) and row.dtype == torch.int64
        for l in range(LAYERS):
            for e in range(EXPERTS):
                slot = int(row[l, e])
                assert int(phy2log[l, slot]) == e  # a replica of the expert
                mine = [s for s in log2phy[l, e].tolist() if s >= 0 and s // local == rank]
                if mine:
                    assert slot == mine[0]  # the rank's own replica first


def test_static_dispatch_map_golden():
    # SGLang's example: 4 logical experts in 8 slots on 4 ranks, node preference off.
    log2phy = torch.tensor([[[0, 3, 5], [1, 6, -1], [2, 7, -1], [4, -1, -1]]])
    phy2log = torch.tensor([[0, 1, 2, 0, 3, 0, 1, 2]])
    want = [[0, 1, 7, 4], [3, 6, 2, 4], [5, 1, 2, 4], [5, 6, 7, 4]]
    for rank in range(4):
        meta = sglang.expert_location_metadata(phy2log, 4, 4, logical_to_physical_map=log2phy,
                                               ep_rank=rank)
        assert meta["logical_to_rank_dispatch_physical_map"][0].tolist() == want[rank]
    assert sglang.expert_location_metadata(phy2log, 4, 4, dispatch=None)[
        "logical_to_rank_dispatch_physical_map"] is None


def elasticity_aware_by_hand(weight, physical, ranks, active):
    """SGLang's elasticity_aware with some rank dead: the global reference on the live ranks
    only, the k-th live rank taking the k-th chunk, dead ranks' slots expert 0, log2phy and the
    counts of live replicas only."""
    local = physical // ranks
    live = [r for r in range(ranks) if active[r]]
    phy, log2phy, count = numpy_reference.rebalance_experts(weight, local * len(live), 1, 1,
                                                            len(live))
    out = np.zeros((weight.shape[0], physical), dtype=np.int64)
    real = np.concatenate([np.arange(r * local, (r + 1) * local) for r in live])
    out[:, real] = phy
    log2phy = np.where(log2phy >= 0, real[np.maximum(log2phy, 0)], -1)
    return out, log2phy, count


@pytest.mark.parametrize("dead", [[3], [0, 5]])
def test_elasticity_aware_over_active_ranks(dead):
    counts = recorder_counts(3)
    active = torch.ones(8, dtype=torch.int32)  # SGLang's flags: int32 0/1 per rank
    active[dead] = 0
    out = sglang.rebalance_experts(counts, 96, 12, GROUPS, 2,
                                   EplbAlgorithm.elasticity_aware_hierarchical,
                                   active_ranks=active)
    check_triple(out, 96)
    phy2log, log2phy, count = (t.numpy() for t in out)
    want = elasticity_aware_by_hand(counts.sum(0).numpy().astype(np.float32), 96, 8,
                                    active.tolist())
    assert np.array_equal(phy2log, want[0]) and np.array_equal(count, want[2])
    assert np.array_equal(np.sort(log2phy, -1), np.sort(want[1][..., :log2phy.shape[2]], -1))
    for r in dead:  # nothing placed on, or routed to, a dead rank
        assert (phy2log[:, r * 12:(r + 1) * 12] == 0).all()
        assert not np.isin(log2phy, np.arange(r * 12, (r + 1) * 12)).any()
    # SGLang's inner signature gives the same; a bool tensor and a list are the same flags.
    inner = sglang.rebalance_experts_elasticity_aware(
        weight=counts.sum(0), num_replicas=96, num_groups=GROUPS, num_nodes=2, num_gpus=8,
        enable_hierarchical=True, active_ranks=active.bool())
    assert all(torch.equal(a, b) for a, b in zip(out, inner))
    listed = sglang.rebalance_experts(counts, 96, 12, GROUPS, 2, "elasticity_aware",
                                      active_ranks=active.tolist())
    assert all(torch.equal(a, b) for a, b in zip(out, listed))


@pytest.mark.parametrize("policy", ["balanced", "sticky"])
def test_eplb_policies_over_active_ranks(policy):
    counts = recorder_counts(4)
    previous = sglang.rebalance_experts(counts, 96, 12, GROUPS, 2)[0]
    active = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.int32)
    out = sglang.rebalance_experts(counts, 96, 12, GROUPS, 2, policy=policy, previous=previous,
                                   active_ranks=active)
    check_triple(out, 96)
    assert (out[0][:, 24:36] == 0).all() and not ((out[1] >= 24) & (out[1] < 36)).any()
    if policy == "sticky":  # the live ranks keep most of their slots
        live = torch.cat([torch.arange(0, 24), torch.arange(36, 96)])
        assert (out[0][:, live] == previous[:, live]).float().mean() > 0.6


def test_algorithm_reaches_sticky_and_keeps_the_map_in_force():
    algo = sglang.Algorithm()  # sticky against the placement it returned last
    base = recorder_counts(5).sum(0).double()
    rng = np.random.default_rng(5)
    moved_sticky, moved_reference = [], []
    last_sticky = last_reference = None
    for step in range(5):
        drift = torch.from_numpy(rng.lognormal(0, 0.2, (LAYERS, EXPERTS)))
        counts = (base * drift).round().to(torch.int32).unsqueeze(0)
        out = init_by_eplb(algo, counts, 8, 80, GROUPS, 2)
        ref = init_by_eplb(sglang, counts, 8, 80, GROUPS, 2, "deepseek_hierarchical")
        check_triple(out, 80)
        if step:
            moved_sticky.append((out[0] != last_sticky).float().mean().item())
            moved_reference.append((ref[0] != last_reference).float().mean().item())
        last_sticky, last_reference = out[0], ref[0]
        assert np.array_equal(algo.previous, out[0].numpy())
    assert np.mean(moved_sticky) < np.mean(moved_reference) / 2
    # The map in force from `current` wins over the remembered one.
    forced = torch.from_numpy(np.tile(np.arange(80) % EXPERTS, (LAYERS, 1)))
    algo2 = sglang.Algorithm(current=lambda: forced)
    out = algo2(counts, 80, 10, GROUPS, 2, EplbAlgorithm.deepseek)
    want = sglang.rebalance_experts(counts, 80, 10, GROUPS, 2, policy="sticky", previous=forced,
                                    hierarchical=False)
    assert torch.equal(out[0], want[0])
    deepseek = sglang.Algorithm(policy="deepseek")  # SGLang's own outputs, any call
    assert torch.equal(init_by_eplb(deepseek, counts, 8, 80, GROUPS, 2)[0],
                       init_by_eplb(sglang, counts, 8, 80, GROUPS, 2)[0])


def fake_sglang(monkeypatch, active_ranks=None, in_force=None):
    """sglang.srt.eplb.eplb_algorithms with SGLang's dispatcher signature, the global metadata
    getter of expert_location and the elastic state manager, as module attributes."""
    names = ["sglang", "sglang.srt", "sglang.srt.eplb", "sglang.srt.eplb.eplb_algorithms",
             "sglang.srt.eplb.expert_location", "sglang.srt.elastic_ep",
             "sglang.srt.elastic_ep.elastic_ep"]
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        if "." in n:
            parent, child = n.rsplit(".", 1)
            setattr(mods[parent], child, m)
        monkeypatch.setitem(sys.modules, n, m)
    calls = []

    def original(tokens_per_expert, num_physical_experts, num_local_physical_experts,
                 num_groups, num_nodes, algorithm):
        calls.append(algorithm)
        return "sglang's own"

    algorithms = mods["sglang.srt.eplb.eplb_algorithms"]
    algorithms.rebalance_experts, algorithms.EplbAlgorithm = original, EplbAlgorithm
    metadata = types.SimpleNamespace(physical_to_logical_map_cpu=in_force)
    mods["sglang.srt.eplb.expert_location"].get_global_expert_location_metadata = \
        lambda: metadata if in_force is not None else None
    state = None if active_ranks is None else types.SimpleNamespace(active_ranks=active_ranks)
    mods["sglang.srt.elastic_ep.elastic_ep"].ElasticEPStateManager = types.SimpleNamespace(
        instance=lambda: state)
    return algorithms, calls


def test_install_and_uninstall(monkeypatch):
    algorithms, calls = fake_sglang(monkeypatch)
    original = algorithms.rebalance_experts
    counts = recorder_counts(6)
    algo = sglang.install()
    try:
        assert algorithms.rebalance_experts is not original
        out = init_by_eplb(algorithms, counts, 8, 80, GROUPS, 2)  # SGLang's call, now eplb's
        check_triple(out, 80)
        assert not calls and np.array_equal(algo.previous, out[0].numpy())
        again = init_by_eplb(algorithms, counts, 8, 80, GROUPS, 2)
        assert torch.equal(again[0], out[0])  # sticky from the map in force: nothing moves
        sglang.install(policy="deepseek")  # replaces; SGLang's vec algorithms stay SGLang's
        assert init_by_eplb(algorithms, counts, 8, 80, GROUPS, 2, "deepseek_vec") == "sglang's own"
        ref = init_by_eplb(algorithms, counts, 8, 80, GROUPS, 2, "deepseek")
        assert torch.equal(ref[0], sglang.rebalance_experts(counts, 80, 10, GROUPS, 2,
                                                            "deepseek")[0])
    finally:
        assert sglang.uninstall()
    assert algorithms.rebalance_experts is original and not sglang.uninstall()


def test_install_reads_sglangs_map_in_force_and_active_ranks(monkeypatch):
    counts = recorder_counts(7)
    in_force = sglang.rebalance_experts(counts, 96, 12, GROUPS, 2)[0]
    active = torch.ones(8, dtype=torch.int32)
    active[6] = 0
    algorithms, _ = fake_sglang(monkeypatch, active_ranks=active, in_force=in_force)
    sglang.install()
    try:
        out = init_by_eplb(algorithms, counts, 8, 96, GROUPS, 2, "elasticity_aware")
        check_triple(out, 96)
        assert (out[0][:, 72:84] == 0).all() and not ((out[1] >= 72) & (out[1] < 84)).any()
        live = torch.cat([torch.arange(0, 72), torch.arange(84, 96)])
        assert (out[0][:, live] == in_force[:, live]).float().mean() > 0.6
    finally:
        sglang.uninstall()


def test_plugin_switch(monkeypatch):
    algorithms, _ = fake_sglang(monkeypatch)
    original = algorithms.rebalance_experts
    monkeypatch.delenv(sglang.ENV_POLICY, raising=False)
    assert sglang.plugin() is None and algorithms.rebalance_experts is original  # opt-in
    monkeypatch.setenv(sglang.ENV_POLICY, "sticky")
    monkeypatch.setenv(sglang.ENV_TOLERANCE, "0.02")
    try:
        algo = sglang.plugin()
        assert (algo.policy, algo.tolerance) == ("sticky", 0.02)
        assert algorithms.rebalance_experts.eplb_algorithm is algo
    finally:
        sglang.uninstall()
    assert sglang.policy_from_env({sglang.ENV_POLICY: "off"}) is None
    with pytest.raises(eplb.InvalidArgument, match="EPLB_SGLANG_POLICY='fast' is not one of"):
        sglang.policy_from_env({sglang.ENV_POLICY: "fast"})
    with pytest.raises(eplb.InvalidArgument, match="EPLB_SGLANG_TOLERANCE=2"):
        sglang.policy_from_env({sglang.ENV_POLICY: "sticky", sglang.ENV_TOLERANCE: "2"})


def test_install_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="needs SGLang"):
        sglang.install()


@pytest.mark.parametrize("change, message", [
    (dict(algorithm="deepseek_vec"), "'deepseek_vec' is not one of"),
    (dict(algorithm="greedy"), "'greedy' is not one of"),
    (dict(algorithm="deepseek", policy="balanced"), "not both"),
    (dict(tokens_per_expert=torch.full((1, LAYERS, EXPERTS), float("nan"))), "nan"),
    (dict(tokens_per_expert=torch.cat([-torch.ones(1, LAYERS, EXPERTS),
                                       3 * torch.ones(1, LAYERS, EXPERTS)])),
     r"tokens_per_expert\[0\]\[0\]\[0\] is -1.0"),
    (dict(tokens_per_expert=torch.ones(0, LAYERS, EXPERTS)), "no steps"),
    (dict(tokens_per_expert=torch.ones(EXPERTS)), r"\[steps, layers, experts\]"),
    (dict(tokens_per_expert=torch.ones(1, LAYERS, EXPERTS, dtype=torch.bool)), "real-valued"),
    (dict(active_ranks=torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int32)),
     "10 slots for 64 experts"),
    (dict(active_ranks=torch.zeros(8, dtype=torch.int32)), "no rank live"),
    (dict(active_ranks=torch.ones(7, dtype=torch.int32)), "7 flags"),
    (dict(active_ranks=torch.tensor([1, 1, 2, 1, 1, 1, 1, 1])), "0 or 1"),
    (dict(previous=torch.zeros(LAYERS, 80), algorithm="sticky"), "integer"),
])
def test_bad_input_names_the_value(change, message):
    args = dict(tokens_per_expert=recorder_counts(8), num_physical_experts=80,
                num_local_physical_experts=10, num_groups=GROUPS, num_nodes=2)
    args.update(change)
    with pytest.raises(eplb.InvalidArgument, match=message):
        sglang.rebalance_experts(**args)


def test_reserved_flags_past_the_ranks():
    # SGLang sizes active_ranks by --max-ep-size: flags past the ranks (joiners) are 0.
    counts = recorder_counts(9)
    active = torch.tensor([1] * 8 + [0] * 4, dtype=torch.int32)
    out = sglang.rebalance_experts(counts, 80, 10, GROUPS, 2, "elasticity_aware",
                                   active_ranks=active)
    assert torch.equal(out[0], sglang.rebalance_experts(counts, 80, 10, GROUPS, 2,
                                                        "deepseek")[0])
