"""eplb.plan_migration: executing the plan yields the new placement; reads, rounds and bytes
agree with each other and with the limits."""

import numpy as np
import pytest

import eplb

UNCHANGED, LOCAL_COPY, FREE_RIDE, READ_SAME_NODE, READ_OTHER_NODE = range(5)


def execute(old, layer):
    """Runs one layer's plan on the old phy2log (planner.h's execution order)."""
    live = np.array(old, copy=True)
    action, src_slot = layer["action"], layer["src_slot"]
    staged = {p: old[src_slot[p]] for p in range(len(old))
              if action[p] in (LOCAL_COPY, READ_SAME_NODE, READ_OTHER_NODE)}
    for p, expert in staged.items():
        live[p] = expert
    for p in range(len(old)):
        if action[p] == FREE_RIDE:
            assert src_slot[p] < p and src_slot[p] in staged
            live[p] = live[src_slot[p]]
    return live


def check_plan(old, new, plan, gpus, nodes, expert_bytes, k):
    old, new = np.asarray(old), np.asarray(new)
    physical = old.shape[1]
    per_rank = physical // gpus
    ranks_per_node = gpus // nodes
    assert len(plan["layers"]) == old.shape[0]
    totals_reads = totals_rounds = 0
    for l, layer in enumerate(plan["layers"]):
        assert layer["action"].dtype == np.uint8 and layer["action"].shape == (physical,)
        assert np.array_equal(execute(old[l], layer), new[l])
        assert np.array_equal(layer["expert"], new[l])
        reads = layer["reads"]
        n = len(reads["dst_slot"])
        remote = np.isin(layer["action"], (READ_SAME_NODE, READ_OTHER_NODE))
        assert n == remote.sum()
        assert np.array_equal(np.sort(reads["dst_slot"]), np.flatnonzero(remote))
        assert np.all(old[l][reads["src_slot"]] == reads["expert"])
        assert np.all(reads["src_slot"] // per_rank == reads["src_rank"])
        assert np.all(reads["dst_slot"] // per_rank == reads["dst_rank"])
        same_node = reads["src_rank"] // ranks_per_node == reads["dst_rank"] // ranks_per_node
        assert layer["bytes_intra_node"] == same_node.sum() * expert_bytes
        assert layer["bytes_inter_node"] == (~same_node).sum() * expert_bytes
        assert layer["bytes_total"] == n * expert_bytes
        assert np.array_equal(layer["rank_bytes_in"],
                              np.bincount(reads["dst_rank"], minlength=gpus) * expert_bytes)
        assert np.array_equal(layer["rank_bytes_out"],
                              np.bincount(reads["src_rank"], minlength=gpus) * expert_bytes)
        assert sum(layer["slots"].values()) == physical
        assert layer["slots"] == {name: int((layer["action"] == a).sum())
                                  for a, name in enumerate(eplb.ACTIONS)}
        # Rounds: every read in one, each rank reading from and serving at most k peers.
        rounds = layer["rounds"]
        assert layer["rounds_lower_bound"] <= rounds
        assert np.all((reads["round"] >= 0) & (reads["round"] < max(rounds, 1)))
        for r in range(rounds):
            pairs = {(a, b) for a, b, rr in zip(reads["dst_rank"], reads["src_rank"],
                                                reads["round"]) if rr == r}
            for g in range(gpus):
                assert sum(1 for a, _ in pairs if a == g) <= k
                assert sum(1 for _, b in pairs if b == g) <= k
        totals_reads += n
        totals_rounds += rounds
    assert plan["totals"]["reads"] == totals_reads
    assert plan["totals"]["rounds"] == totals_rounds
    assert plan["totals"]["bytes_total"] == totals_reads * expert_bytes


def test_actions_are_named():
    assert eplb.ACTIONS == ("unchanged", "local_copy", "free_ride", "read_same_node",
                            "read_other_node", "restore")


def test_same_placement_moves_nothing():
    old = np.tile(np.arange(16) % 12, (3, 1))
    plan = eplb.plan_migration(old, old, 8, 2, 1024)
    assert plan["totals"]["bytes_total"] == 0 and plan["totals"]["rounds"] == 0
    assert plan["totals"]["slots"]["unchanged"] == 3 * 16
    for layer in plan["layers"]:
        assert np.all(layer["action"] == UNCHANGED)
        assert len(layer["reads"]["src_rank"]) == 0


@pytest.mark.parametrize("k", [1, 2])
def test_trivial_to_rebalanced(k):
    rng = np.random.default_rng(17)
    w = rng.lognormal(0, 1.2, (4, 64)) * 100
    old = np.tile(np.arange(80) % 64, (4, 1))
    new = eplb.rebalance_experts(w, 80, 8, 2, 8)[0]
    plan = eplb.plan_migration(old, new, 8, 2, 4096, peers_per_round=k)
    check_plan(old, new, plan, 8, 2, 4096, k)
    assert plan["totals"]["bytes_total"] > 0


def test_half_duplex_and_torch_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(18)
    w = torch.tensor(rng.lognormal(0, 1.2, (2, 32)) * 100)
    old = eplb.rebalance_experts(w, 48, 4, 2, 8)[0]
    new = eplb.rebalance_experts(w, 48, 4, 2, 8, policy="balanced")[0]
    plan = eplb.plan_migration(old, new, 8, 2, 100, half_duplex=True)
    check_plan(old.numpy(), new.numpy(), plan, 8, 2, 100, 1)


@pytest.mark.parametrize("args, match", [
    (([[0, 1, 2, 3]], [[0, 1, 2, 3], [0, 1, 2, 3]], 2, 1, 8), "layers"),
    (([[0, 1, 2, 3]], [[0, 1, 2, 3, 0, 1]], 2, 1, 8), "physical"),
    (([[0, 1, 2, 3]], [[0, 1, 2, 3]], 3, 1, 8), "multiple of ranks"),
    (([[0, 1, 2, 3]], [[0, 1, 2, 3]], 2, 1, 0), "expert bytes 0"),
    (([[0, 1, 2, 3]], [[0, 1, 2, 4]], 2, 1, 8), "expert 4"),
    (([[0, 1, 2, -1]], [[0, 1, 2, 3]], 2, 1, 8), "outside"),
    (([0, 1, 2, 3], [[0, 1, 2, 3]], 2, 1, 8), "2-D"),
])
def test_bad_input_raises_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        eplb.plan_migration(*args)


def test_bad_peers_per_round():
    with pytest.raises(ValueError, match="peers per round 0"):
        eplb.plan_migration([[0, 1, 2, 3]], [[1, 0, 2, 3]], 2, 1, 8, peers_per_round=0)


def test_huge_values_raise_value_error():
    old = np.array([[0, 1, 2, 3]])
    with pytest.raises(ValueError,
                       match=r"new_phy2log holds expert 1099511627776, outside \[0, 65536\)"):
        eplb.plan_migration(old, np.array([[0, 1, 2, 2**40]]), 2, 1, 8)
    with pytest.raises(ValueError, match="does not fit a 64-bit byte count"):
        eplb.plan_migration(old, old[:, ::-1], 2, 1, 2**63 - 1)
    with pytest.raises(ValueError, match="expert_bytes 9223372036854775808 is outside"):
        eplb.plan_migration(old, old, 2, 1, 2**63)
    # The largest that fits still plans, with exact byte counts.
    most = (2**63 - 1) // 4
    assert eplb.plan_migration(old, old[:, ::-1], 2, 1, most)["totals"]["bytes_total"] == 4 * most


@pytest.mark.parametrize("k", [1, 2])
def test_half_duplex_link_time(k):
    # Half duplex: in every round a rank has at most k flows (a peer it reads from or serves),
    # link_time is the sum over rounds of the largest flow between two ranks, at least its bound
    # (the most reads one rank takes part in, over k), and every layer's figures sum to totals.
    rng = np.random.default_rng(19)
    w = rng.lognormal(0, 1.2, (3, 64)) * 100
    old = eplb.rebalance_experts(w, 96, 8, 2, 16)[0]
    new = eplb.rebalance_experts(w[::-1].copy(), 96, 8, 2, 16)[0]
    plan = eplb.plan_migration(old, new, 16, 2, 10, peers_per_round=k, half_duplex=True)
    check_plan(old, new, plan, 16, 2, 10, k)
    link = bound = 0
    for layer in plan["layers"]:
        r = layer["reads"]
        flows = {}
        for src, dst, rnd in zip(r["src_rank"].tolist(), r["dst_rank"].tolist(),
                                 r["round"].tolist()):
            flows.setdefault(rnd, []).append((src, dst))
        total = 0
        for rnd, pairs in flows.items():
            for g in range(16):
                assert len({p for p in pairs if g in p}) <= k, (rnd, g)
            total += max(np.unique([(min(p), max(p)) for p in pairs], axis=0,
                                   return_counts=True)[1])
        degree = np.bincount(np.concatenate([r["src_rank"], r["dst_rank"]]), minlength=16)
        assert layer["link_time"] == total
        assert layer["link_time_lower_bound"] == -(-degree.max() // k)
        assert layer["link_time"] >= layer["link_time_lower_bound"]
        link += total
        bound += layer["link_time_lower_bound"]
    assert plan["totals"]["link_time"] == link
    assert plan["totals"]["link_time_lower_bound"] == bound
