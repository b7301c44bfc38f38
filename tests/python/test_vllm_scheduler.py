"""eplb's drop-in for vLLM's migration scheduler (eplb.integrations.vllm_scheduler), without vLLM:
the contract vLLM's rebalance_execute relies on, checked on random placements with fixed seeds,
vLLM's own small cases, bad input, and installing it into a stand-in of vLLM's modules.

The contract (vllm/distributed/eplb/migration_scheduler.py and its callers): every expert a rank
gains (holds in the new map, not in the old; -1 is an empty slot) arrives exactly once, in a flow
from a rank that holds it in the old map; within a batch a rank is in at most one flow.
scripts/engine-conformance.sh runs vLLM's own tests/distributed/test_eplb_migration_scheduler.py
with it in place.
"""

import collections
import sys
import types

import numpy as np
import pytest

import eplb
from eplb.integrations import vllm, vllm_scheduler

SEED = 20250


def gained(num_local, old, new):
    """{(rank, expert)} every rank must receive: vLLM's rule."""
    out = set()
    for rank in range(len(old) // num_local):
        rows = slice(rank * num_local, (rank + 1) * num_local)
        for e in set(new[rows].tolist()) - set(old[rows].tolist()) - {-1}:
            out.add((rank, e))
    return out


def check_contract(num_local, old, new, batches):
    """Asserts the contract; returns (link time, per-rank bound): the sum over batches of the
    largest flow, and the most transfers one rank takes part in."""
    old, new = np.asarray(old), np.asarray(new)
    received = collections.Counter()
    degree = collections.Counter()
    link = 0
    for batch in batches:
        assert batch, "an empty batch"
        busy = set()
        for flow in batch:
            assert isinstance(flow, vllm.MigrationFlow)
            assert flow.src_rank != flow.dst_rank
            assert flow.src_rank not in busy and flow.dst_rank not in busy, batch
            busy |= {flow.src_rank, flow.dst_rank}
            assert flow.expert_ids and list(flow.expert_ids) == sorted(set(flow.expert_ids))
            src = old[flow.src_rank * num_local:(flow.src_rank + 1) * num_local]
            for e in flow.expert_ids:
                assert e in src, f"rank {flow.src_rank} sends expert {e} it does not hold"
                received[(flow.dst_rank, e)] += 1
                degree[flow.src_rank] += 1
                degree[flow.dst_rank] += 1
        link += max(len(f.expert_ids) for f in batch)
    assert set(received) == gained(num_local, old, new)
    assert all(n == 1 for n in received.values()), "a (rank, expert) received twice"
    return link, max(degree.values(), default=0)


def placement(rng, ranks, num_local, experts, empty=0):
    """A vLLM-like map: every expert at least once, random redundant copies, shuffled; the last
    `empty` ranks' slots -1 (ranks added by elastic EP hold nothing yet)."""
    physical = ranks * num_local
    held = (ranks - empty) * num_local
    slots = np.concatenate([np.arange(experts), rng.integers(0, experts, held - experts)])
    return np.concatenate([rng.permutation(slots), np.full(physical - held, -1)]).astype(np.int64)


def test_random_placements_keep_the_contract_near_the_bound():
    rng = np.random.default_rng(SEED)
    link = bound = 0
    for case in range(120):
        ranks, num_local = int(rng.integers(2, 17)), int(rng.integers(1, 7))
        experts = int(rng.integers(1, ranks * num_local // 2 + 2))
        empty = int(rng.integers(0, ranks // 3 + 1)) if case % 3 == 0 else 0
        experts = min(experts, (ranks - empty) * num_local)
        old = placement(rng, ranks, num_local, experts, empty)
        new = placement(rng, ranks, num_local, experts, 0)
        if case % 4 == 1:  # a sticky rebalance: a few slots change
            new = old.copy()
            new[new < 0] = rng.integers(0, experts, (new < 0).sum())
            for p in rng.choice(len(new), len(new) // 5 + 1, replace=False):
                new[p] = rng.integers(0, experts)
            new[:experts] = np.where(np.isin(np.arange(experts), new), new[:experts],
                                     np.arange(experts))
        try:
            batches = vllm.schedule_migration_batches(num_local, old, new)
            a, b = check_contract(num_local, old, new, batches)
        except AssertionError as e:
            raise AssertionError(f"seed {SEED}, case {case}: {e}") from e
        assert a >= b
        link += a
        bound += b
    assert link <= 1.05 * bound, f"seed {SEED}: link time {link} against the bound {bound}"


def test_vllms_small_cases():
    # Local copies need no transfer (vLLM's test_schedule_migration_batches_excludes_local_copies).
    assert vllm.schedule_migration_batches(2, np.array([0, 1, 1, 2]), np.array([0, 1, 0, 2])) == [
        [vllm.MigrationFlow(0, 1, (0,))]]
    # Two holders, three receivers: one and two transfers each, never three from one.
    batches = vllm.schedule_migration_batches(1, np.array([0, 0, 1, 1, 1]),
                                              np.array([0, 0, 0, 0, 0]))
    flows = {(f.src_rank, f.dst_rank, e) for b in batches for f in b for e in f.expert_ids}
    assert flows == {(0, 2, 0), (1, 3, 0), (0, 4, 0)}
    # A rank pair's experts travel in one flow where nothing else is in the way.
    old, new = np.array([0, 1, 2, -1, -1, -1, -1, -1]), np.array([-1, -1, -1, -1, 0, 1, 2, -1])
    # Ranks of 2 slots: rank 0 holds 0, 1; rank 1 holds 2; rank 2 wants 0, 1; rank 3 wants 2.
    assert vllm.schedule_migration_batches(2, old, new) == [
        [vllm.MigrationFlow(0, 2, (0, 1)), vllm.MigrationFlow(1, 3, (2,))]]
    # A rotation: each rank sends one and receives one, in two batches.
    batches = vllm.schedule_migration_batches(1, np.array([0, 1, 2, 3]), np.array([1, 2, 3, 0]))
    assert len(batches) == 2 and check_contract(1, [0, 1, 2, 3], [1, 2, 3, 0], batches) == (2, 2)


def test_for_layers_matches_single_layers():
    rng = np.random.default_rng(SEED + 1)
    old = np.stack([placement(rng, 8, 3, 20) for _ in range(4)])
    new = np.stack([placement(rng, 8, 3, 20) for _ in range(4)])
    assert vllm.schedule_migration_batches_for_layers(3, old, new) == [
        vllm.schedule_migration_batches(3, o, n) for o, n in zip(old, new)]
    assert vllm.schedule_migration_batches_for_layers(3, old[:0], new[:0]) == []


def test_beats_whole_pairs_where_a_pair_is_big():
    # Rank 0 receives experts 0, 1, 2 from rank 2 and 3 from rank 1, which also sends 4 to rank 3
    # and 5 to rank 4 (every expert has one holder). Whole pair flows take 3 + 1 + 1 (rank 1's
    # three peers need three batches, one of them beside the big flow); transfer by transfer,
    # rank 0's 4, the bound.
    old = np.array([10, 11, 12, 13, 3, 4, 5, 14, 0, 1, 2, 15, 16, 17, 18, 19, 20, 21, 22, 23])
    new = np.array([0, 1, 2, 3, 3, 4, 5, 14, 0, 1, 2, 15, 4, 17, 18, 19, 5, 21, 22, 23])
    batches = vllm.schedule_migration_batches(4, old, new)
    assert check_contract(4, old, new, batches) == (4, 4)


def test_no_transfer_no_batch():
    old = np.array([0, 1, 2, 3])
    assert vllm.schedule_migration_batches(2, old, old) == []
    assert vllm.schedule_migration_batches(2, old, np.array([1, 0, 3, 2])) == []  # local swaps
    assert vllm.schedule_migration_batches(2, np.array([0, 1, 2, 3]),
                                           np.array([0, -1, -1, 3])) == []
    assert vllm.schedule_migration_batches(1, np.array([], dtype=np.int64),
                                           np.array([], dtype=np.int64)) == []


def test_torch_and_list_inputs():
    torch = pytest.importorskip("torch")
    old, new = [0, 1, 2, 3], [1, 2, 3, 0]
    want = vllm.schedule_migration_batches(1, np.array(old), np.array(new))
    assert vllm.schedule_migration_batches(1, old, new) == want
    assert vllm.schedule_migration_batches(1, torch.tensor(old), torch.tensor(new)) == want
    assert vllm.schedule_migration_batches(np.int64(1), torch.tensor(old, dtype=torch.int32),
                                           torch.tensor(new, dtype=torch.int32)) == want


@pytest.mark.parametrize("args, message", [
    ((1, [0, 1], [0]), r"old_indices has shape \(2,\) and new_indices \(1,\)"),
    ((1, [[0, 1]], [[0, 1]]), r"expected \[num_physical\]"),
    ((1, [0, -5], [0, 0]), r"old_indices\[1\] is -5: an expert id must be in \[0, 65536\), or -1"),
    ((1, [0, 70000], [0, 0]), r"old_indices\[1\] is 70000"),
    ((1, [0, 1], [0, -2]), r"new_indices\[1\] is -2"),
    ((1, [0, -1], [0, 7]), r"expert 7 in slot 1 \(rank 1\) but no slot of old_indices holds it"),
    ((3, [0, 1, 2, 3], [0, 1, 2, 3]), r"4 slots per layer, not a multiple of num_local_experts 3"),
    ((0, [0, 1], [0, 1]), r"num_local_experts 0 must be at least 1"),
    ((1, [0.0, 1.0], [0.0, 1.0]), "integer expert ids"),
])
def test_bad_input_names_the_value(args, message):
    with pytest.raises(vllm.ScheduleError, match=message) as e:
        vllm.schedule_migration_batches(*[np.array(a) if isinstance(a, list) else a
                                          for a in args])
    # vLLM's scheduler raises AssertionError for maps of different shapes: so does this one.
    assert isinstance(e.value, AssertionError) and isinstance(e.value, eplb.InvalidArgument)


def test_bad_input_for_layers():
    with pytest.raises(vllm.ScheduleError, match=r"expected \[layers, num_physical\]"):
        vllm.schedule_migration_batches_for_layers(1, np.array([0, 1]), np.array([1, 0]))
    with pytest.raises(vllm.ScheduleError, match=r"layer 1: new_indices puts expert 4"):
        vllm.schedule_migration_batches_for_layers(1, np.array([[0, 1], [0, 1]]),
                                                   np.array([[1, 0], [4, 1]]))
    with pytest.raises(TypeError, match="num_local_experts must be an integer"):
        vllm.schedule_migration_batches(True, np.array([0, 1]), np.array([1, 0]))


def test_switch():
    for off in ({}, {"EPLB_VLLM_SCHEDULER": ""}, {"EPLB_VLLM_SCHEDULER": "off"},
                {"EPLB_VLLM_SCHEDULER": "vllm"}):
        assert vllm_scheduler.scheduler_from_env(off) is False
        assert vllm_scheduler.install_from_env(off) is None
    assert vllm_scheduler.scheduler_from_env({"EPLB_VLLM_SCHEDULER": " EPLB "}) is True
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_SCHEDULER='greedy' is not 'eplb'"):
        vllm_scheduler.scheduler_from_env({"EPLB_VLLM_SCHEDULER": "greedy"})


@pytest.fixture
def fake_vllm(monkeypatch):
    """Stand-ins for vLLM's migration_scheduler and the two modules that import its names."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, slots=True)
    class MigrationFlow:
        src_rank: int
        dst_rank: int
        expert_ids: tuple

    def schedule_migration_batches(num_local_experts, old_indices, new_indices):
        return "vllm's"

    def schedule_migration_batches_for_layers(num_local_experts, old_indices, new_indices):
        return "vllm's for layers"

    names = ["vllm", "vllm.distributed", "vllm.distributed.eplb",
             "vllm.distributed.eplb.migration_scheduler", "vllm.distributed.eplb.rebalance_execute",
             "vllm.distributed.eplb.async_worker"]
    modules = {n: types.ModuleType(n) for n in names}
    scheduler = modules["vllm.distributed.eplb.migration_scheduler"]
    scheduler.MigrationFlow = MigrationFlow
    scheduler.schedule_migration_batches = schedule_migration_batches
    scheduler.schedule_migration_batches_for_layers = schedule_migration_batches_for_layers
    modules["vllm.distributed.eplb.rebalance_execute"].schedule_migration_batches = \
        schedule_migration_batches
    modules["vllm.distributed.eplb.rebalance_execute"].MigrationFlow = MigrationFlow
    modules["vllm.distributed.eplb.async_worker"].schedule_migration_batches_for_layers = \
        schedule_migration_batches_for_layers
    for n, m in modules.items():
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setattr(vllm_scheduler, "_flow_type", None)
    yield modules
    vllm_scheduler.uninstall()
    vllm_scheduler._flow_type = None


def test_install_replaces_every_binding_and_uninstall_restores(fake_vllm, monkeypatch):
    scheduler = fake_vllm["vllm.distributed.eplb.migration_scheduler"]
    execute = fake_vllm["vllm.distributed.eplb.rebalance_execute"]
    worker = fake_vllm["vllm.distributed.eplb.async_worker"]
    monkeypatch.delenv("EPLB_VLLM_SCHEDULER", raising=False)
    assert vllm.plugin() is None  # opt-in: nothing changes
    assert execute.schedule_migration_batches(1, None, None) == "vllm's"
    monkeypatch.setenv("EPLB_VLLM_SCHEDULER", "eplb")
    vllm.plugin()
    assert scheduler.schedule_migration_batches is vllm.schedule_migration_batches
    assert execute.schedule_migration_batches is vllm.schedule_migration_batches
    assert scheduler.schedule_migration_batches_for_layers is \
        vllm.schedule_migration_batches_for_layers
    assert worker.schedule_migration_batches_for_layers is \
        vllm.schedule_migration_batches_for_layers
    eplb_modules = sorted(n for n in fake_vllm if n.count(".") == 3)
    assert vllm.install_scheduler() == eplb_modules  # again: harmless
    # Batches are made of vLLM's own MigrationFlow, so they compare equal to vLLM's.
    batches = execute.schedule_migration_batches(1, np.array([0, 1]), np.array([1, 0]))
    assert type(batches[0][0]) is scheduler.MigrationFlow
    assert vllm.MigrationFlow is scheduler.MigrationFlow
    assert vllm_scheduler.uninstall() == eplb_modules
    assert execute.schedule_migration_batches(1, None, None) == "vllm's"
    assert worker.schedule_migration_batches_for_layers(1, None, None) == "vllm's for layers"


def test_install_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ImportError, match="migration_scheduler"):
        vllm.install_scheduler()
    monkeypatch.setenv("EPLB_VLLM_SCHEDULER", "greedy")
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_SCHEDULER"):
        vllm.plugin()
