"""eplb's vLLM policy where vLLM calls it: the calls of ``EplbState.rearrange`` (the profile run,
a rebalance, the async worker's thread, elastic EP's scale-down with ``rank_mapping`` and its
scale-up), replayed with vLLM's argument order, shapes and dtypes, and the plugin switch.

What vLLM does around the call is restated here from its sources (vllm/distributed/eplb/
eplb_state.py, async_worker.py, rebalance_execute.py; elastic_ep/elastic_execute.py), not
imported: the default suite has no vLLM. scripts/engine-conformance.sh runs vLLM's own tests.
"""

import threading

import numpy as np
import pytest

import eplb
import numpy_reference
from eplb.integrations import vllm

torch = pytest.importorskip("torch")

LAYERS, EXPERTS, GROUPS = 4, 64, 8
SLOTS_PER_RANK = 12  # vLLM keeps the slots per rank when the world changes size


def initial_map(layers, experts, physical):
    """vLLM's first phy2log: the experts in order, then the redundant slots round-robin."""
    row = list(range(experts)) + [i % experts for i in range(physical - experts)]
    return torch.tensor([row] * layers, dtype=torch.int64)


def recorded_window(seed, window, physical):
    """expert_load_window: int32 [window, layers, physical] counts per physical slot."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.distributions.LogNormal(0.0, 1.0).sample((LAYERS, physical)) * 50
    return torch.poisson(hot.expand(window, -1, -1), generator=g).to(torch.int32)


def logical_load(window, phy2log, experts):
    """rearrange's global_expert_load_window: the window scattered to logical experts through
    the map it was recorded under (-1 slots to a dummy column), summed over steps: int64."""
    steps, layers, _ = window.shape
    out = torch.zeros(steps, layers, experts + 1, dtype=torch.int32)
    index = torch.where(phy2log < 0, experts, phy2log).expand(steps, -1, -1)
    out.scatter_add_(2, index, window[..., :phy2log.shape[1]])
    return out[..., :-1].sum(dim=0)


def distinct_load(seed, layers=LAYERS, experts=EXPERTS):
    """An int64 [layers, experts] load without ties (distinct counts, no two w / count equal at
    these sizes): where vLLM's default (numpy's argsort) and DeepSeek's reference (torch's sort)
    visit tied experts in different orders, "identical outputs" means for loads like this."""
    rng = np.random.default_rng(seed)
    values = rng.choice(np.arange(100_000, 1_000_000), size=(layers, experts), replace=False)
    return torch.from_numpy(values.astype(np.int64))


def call_policy(policy, weight, num_replicas, num_groups, num_nodes, num_gpus, old):
    """The call exactly as rearrange and the async worker make it: six positional arguments,
    on the class, a CPU int64 load and the CPU int64 map in force."""
    assert weight.dtype == torch.int64 and weight.device.type == "cpu"
    assert old.dtype == torch.int64 and old.device.type == "cpu"
    return policy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, old)


def check_vllm_output(new, layers, experts, physical):
    """What vLLM asserts or relies on: a CPU int64 [layers, physical] map (compute_logical_maps
    needs the CPU, the async commit the same width), every expert placed, ids in range."""
    assert isinstance(new, torch.Tensor) and new.dtype == torch.int64
    assert new.device.type == "cpu" and tuple(new.shape) == (layers, physical)
    assert new.is_contiguous()
    for row in new:
        assert sorted(set(row.tolist())) == list(range(experts))


def vllm_default(weight, num_replicas, num_groups, num_nodes, num_gpus, old):
    """vLLM's DefaultEplbPolicy restated: DeepSeek's reference (global when groups % nodes), then
    preserve_intragpu_slots against the map in force."""
    if num_groups % num_nodes != 0:
        num_groups, num_nodes = 1, 1
    phy2log = numpy_reference.rebalance_experts(weight.numpy().astype(np.float32), num_replicas,
                                                num_groups, num_nodes, num_gpus)[0]
    if old is not None:
        phy2log = vllm.preserve_intragpu_slots(phy2log, num_gpus, old.numpy())
    return torch.from_numpy(np.asarray(phy2log, dtype=np.int64))


POLICIES = [vllm.EplbPolicy, vllm.make_policy(policy="sticky"),
            vllm.make_policy(policy="balanced"), vllm.make_policy(policy="deepseek")]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
def test_profile_run_takes_an_all_zero_load(policy):
    # EplbState.step(is_profile=True) rearranges with an empty window, async mode included.
    physical, ranks = 80, 8
    old = initial_map(LAYERS, EXPERTS, physical)
    weight = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)
    new = call_policy(policy, weight, physical, GROUPS, 2, ranks, old)
    check_vllm_output(new, LAYERS, EXPERTS, physical)


def test_rearrange_sequence_deepseek_mode_is_vllms_default():
    # Steady serving: each rearrange places the window's load from the map in force. The
    # deepseek mode gives vLLM's default map at every call, so switching changes nothing.
    physical, ranks, nodes = 80, 8, 2
    mine = vllm.make_policy(policy="deepseek")
    phy2log = initial_map(LAYERS, EXPERTS, physical)
    for seed in range(4):
        weight = distinct_load(seed)
        new = call_policy(mine, weight, physical, GROUPS, nodes, ranks, phy2log)
        check_vllm_output(new, LAYERS, EXPERTS, physical)
        assert torch.equal(new, vllm_default(weight, physical, GROUPS, nodes, ranks, phy2log))
        phy2log = new


def test_rearrange_sequence_sticky_moves_less_than_vllms_default():
    physical, ranks, nodes = 80, 8, 2
    ours = theirs = initial_map(LAYERS, EXPERTS, physical)
    moved_ours = moved_theirs = 0.0
    base = torch.distributions.LogNormal(0.0, 1.0).sample((LAYERS, EXPERTS)) * 1000
    g = torch.Generator().manual_seed(9)
    for step in range(6):
        drift = torch.exp(torch.randn(LAYERS, EXPERTS, generator=g) * 0.2)
        weight = (base * drift).round().to(torch.int64)
        new = call_policy(vllm.EplbPolicy, weight, physical, GROUPS, nodes, ranks, ours)
        check_vllm_output(new, LAYERS, EXPERTS, physical)
        default = vllm_default(weight, physical, GROUPS, nodes, ranks, theirs)
        if step:  # the first places from the trivial map: both move most slots
            moved_ours += (new != ours).float().mean().item()
            moved_theirs += (default != theirs).float().mean().item()
        ours, theirs = new, default
    assert moved_ours < moved_theirs / 2


def test_async_worker_calls_from_a_background_thread():
    # async_worker.py runs the policy in a Python thread of the worker while serving goes on.
    physical, ranks = 80, 8
    old = initial_map(LAYERS, EXPERTS, physical)
    weight = logical_load(recorded_window(5, 8, physical), old, EXPERTS)
    out = {}

    def worker():
        out["map"] = call_policy(vllm.EplbPolicy, weight, physical, GROUPS, 2, ranks, old)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    check_vllm_output(out["map"], LAYERS, EXPERTS, physical)
    assert torch.equal(out["map"], call_policy(vllm.EplbPolicy, weight, physical, GROUPS, 2,
                                               ranks, old))


def node_count(rank_mapping, ranks_per_node):
    """_node_count_with_rank_mapping: the nodes that still host a rank."""
    return len({r // ranks_per_node for r, new in rank_mapping.items() if new != -1})


def widen_with_rank_mapping(new, rank_mapping, slots_per_rank):
    """_map_new_expert_indices_with_rank_mapping: the new [L, new_n] map at the old width, each
    surviving rank's block at its old rank's columns, removed ranks -1."""
    old_ranks = len(rank_mapping)
    out = torch.full((new.shape[0], old_ranks * slots_per_rank), -1, dtype=new.dtype)
    for old_rank, new_rank in rank_mapping.items():
        if new_rank != -1:
            out[:, old_rank * slots_per_rank:(old_rank + 1) * slots_per_rank] = \
                new[:, new_rank * slots_per_rank:(new_rank + 1) * slots_per_rank]
    return out


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
def test_elastic_scale_down(policy):
    # perform_scale_down_eplb_reshuffle: 8 ranks on 2 nodes -> 6; vLLM removes the highest ranks
    # (rank_mapping r -> r, or -1), passes the smaller num_replicas / num_ranks and the old map
    # at its full old width, and widens the result back through rank_mapping to move weights.
    old_ranks, new_ranks, ranks_per_node = 8, 6, 4
    old_physical = old_ranks * SLOTS_PER_RANK
    phy2log = vllm.EplbPolicy.rebalance_experts(
        logical_load(recorded_window(1, 8, old_physical), initial_map(LAYERS, EXPERTS,
                                                                      old_physical), EXPERTS),
        old_physical, GROUPS, 2, old_ranks)
    rank_mapping = {r: (r if r < new_ranks else -1) for r in range(old_ranks)}
    num_gpus = sum(new != -1 for new in rank_mapping.values())
    num_replicas = old_physical // old_ranks * num_gpus
    num_nodes = node_count(rank_mapping, ranks_per_node)
    if num_gpus % num_nodes != 0:
        num_nodes = 1
    weight = logical_load(recorded_window(2, 8, old_physical), phy2log, EXPERTS)
    new = call_policy(policy, weight, num_replicas, GROUPS, num_nodes, num_gpus, phy2log)
    check_vllm_output(new, LAYERS, EXPERTS, num_replicas)
    wide = widen_with_rank_mapping(new, rank_mapping, SLOTS_PER_RANK)
    assert (wide[:, new_ranks * SLOTS_PER_RANK:] == -1).all()
    if policy.policy == "deepseek":
        weight = distinct_load(12)
        new = call_policy(policy, weight, num_replicas, GROUPS, num_nodes, num_gpus, phy2log)
        assert torch.equal(new, vllm_default(weight, num_replicas, GROUPS, num_nodes, num_gpus,
                                             phy2log[:, :num_replicas]))
    elif policy.policy in (None, "sticky"):
        # The surviving ranks keep most of their slots; a fresh placement keeps few.
        kept = (new == phy2log[:, :num_replicas]).float().mean().item()
        fresh = eplb.rebalance_experts(weight, num_replicas, GROUPS, num_nodes, num_gpus,
                                       policy="balanced")[0]
        fresh_kept = (fresh == phy2log[:, :num_replicas]).float().mean().item()
        assert kept > 0.5 and kept > fresh_kept


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
def test_elastic_scale_up(policy):
    # commit_scale_up: the map is re-viewed at the new width with the new ranks' slots -1, and
    # rearrange runs without rank_mapping at the new size.
    old_ranks, new_ranks = 6, 8
    old_physical, new_physical = old_ranks * SLOTS_PER_RANK, new_ranks * SLOTS_PER_RANK
    phy2log = vllm.EplbPolicy.rebalance_experts(
        logical_load(recorded_window(3, 8, old_physical),
                     initial_map(LAYERS, EXPERTS, old_physical), EXPERTS),
        old_physical, GROUPS, 1, old_ranks)
    grown = torch.cat([phy2log, torch.full((LAYERS, new_physical - old_physical), -1,
                                           dtype=torch.int64)], dim=1)
    weight = logical_load(recorded_window(4, 8, new_physical), grown, EXPERTS)
    new = call_policy(policy, weight, new_physical, GROUPS, 2, new_ranks, grown)
    check_vllm_output(new, LAYERS, EXPERTS, new_physical)
    if policy.policy == "deepseek":
        tie_free = distinct_load(13)
        assert torch.equal(call_policy(policy, tie_free, new_physical, GROUPS, 2, new_ranks, grown),
                           vllm_default(tie_free, new_physical, GROUPS, 2, new_ranks, grown))
    # A narrower map in force (no -1 tail) is the same scale-up.
    narrow = call_policy(policy, weight, new_physical, GROUPS, 2, new_ranks, phy2log)
    assert torch.equal(narrow, new)


def test_preserve_intragpu_slots_on_the_class_as_vllms_tests_call_it():
    # tests/distributed/test_eplb_algo.py: numpy in, numpy out, on the policy class.
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    new = np.array([[1, 5, 0, 4, 6, 2, 7, 3]])
    for cls in POLICIES:
        post = cls.preserve_intragpu_slots(new, 2, old)
        assert isinstance(post, np.ndarray) and post.shape == new.shape
        assert post.tolist() == vllm.preserve_intragpu_slots(new, 2, old).tolist()
        assert post[0, :2].tolist() == [0, 1]  # rank 0 keeps experts 0 and 1 in place
    # Duplicates match one to one; a wider old map is compared on its first columns.
    old = np.array([[0, 0, 1, 2, 3, 3, 9, 9]])
    new = np.array([[0, 3, 0, 1, 2, 3]])
    post = vllm.EplbPolicy.preserve_intragpu_slots(new, 2, old)
    assert post.tolist() == [[0, 0, 3, 2, 3, 1]]
    assert vllm.EplbPolicy.preserve_intragpu_slots(torch.from_numpy(new), 2,
                                                   torch.from_numpy(old)).dtype == torch.int64


def test_plugin_switch(monkeypatch):
    monkeypatch.delenv(vllm.ENV_POLICY, raising=False)
    assert vllm.policy_from_env() is None
    for off in ("", "off", "OFF", "0"):
        assert vllm.policy_from_env({vllm.ENV_POLICY: off}) is None
    cls = vllm.policy_from_env({vllm.ENV_POLICY: "sticky", vllm.ENV_TOLERANCE: "0.03"})
    assert (cls.policy, cls.tolerance) == ("sticky", 0.03)
    assert vllm.policy_from_env({vllm.ENV_POLICY: "auto"}).policy is None
    assert vllm.policy_from_env({vllm.ENV_POLICY: "deepseek"}).policy == "deepseek"
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_POLICY='greedy' is not one of"):
        vllm.policy_from_env({vllm.ENV_POLICY: "greedy"})
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_TOLERANCE=1.5"):
        vllm.policy_from_env({vllm.ENV_POLICY: "sticky", vllm.ENV_TOLERANCE: "1.5"})
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_TOLERANCE='x'"):
        vllm.policy_from_env({vllm.ENV_POLICY: "sticky", vllm.ENV_TOLERANCE: "x"})


@pytest.mark.parametrize("bad, message", [
    (dict(weight=torch.full((LAYERS, EXPERTS), float("nan"))), "nan"),
    (dict(weight=-torch.ones(LAYERS, EXPERTS)), "negative|-1"),
    (dict(weight=torch.ones(LAYERS, EXPERTS, 2)), "2-D"),
    (dict(num_replicas=81), "81"),
    (dict(old=torch.zeros(LAYERS + 1, 80, dtype=torch.int64)), "layers = 4"),
    (dict(old=torch.zeros(LAYERS, 80)), "integer"),
])
def test_bad_input_names_the_value(bad, message):
    args = dict(weight=torch.ones(LAYERS, EXPERTS, dtype=torch.int64), num_replicas=80,
                old=initial_map(LAYERS, EXPERTS, 80))
    args.update(bad)
    with pytest.raises((AssertionError, ValueError), match=message):
        vllm.EplbPolicy.rebalance_experts(args["weight"], args["num_replicas"], GROUPS, 2, 8,
                                          args["old"])


def test_min_gain_keeps_the_placement_in_force_when_the_gain_is_too_small():
    # vLLM #47206: skip a rearrangement whose imbalance gain is small. Placed once on a load,
    # the next window's nearly equal load is not worth the moves (a second of stall here): the
    # map in force comes back, and vLLM moves nothing. From the trivial map, over a long
    # interval, the gain pays.
    physical, ranks, nodes = 80, 8, 2
    model = eplb.cost.CostModel(slot_us=20.0, token_us=1.0)
    settings = dict(cost=model, window_steps=100, expert_bytes=44_040_192,
                    pull_bytes_per_s=50e9, stall_s=1.0)
    policy = vllm.make_policy(policy="sticky", min_gain=1.0, interval=100, **settings)
    old = initial_map(LAYERS, EXPERTS, physical)
    weight = distinct_load(0) * 100
    placed = call_policy(vllm.make_policy(policy="sticky"), weight, physical, GROUPS, nodes,
                         ranks, old)
    drifted = weight + distinct_load(1)
    kept = call_policy(policy, drifted, physical, GROUPS, nodes, ranks, placed)
    check_vllm_output(kept, LAYERS, EXPERTS, physical)
    assert torch.equal(kept, placed), policy.last_decision
    assert not policy.last_decision["rebalance"]
    assert "below min_gain" in policy.last_decision["reason"]
    long = vllm.make_policy(policy="sticky", min_gain=1.0, interval=10**9, **settings)
    new = call_policy(long, weight, physical, GROUPS, nodes, ranks, old)
    assert long.last_decision["rebalance"] and long.last_decision["gain_us"] > 0
    assert not torch.equal(new, old)
    with pytest.raises(eplb.InvalidArgument, match="min_gain is -1"):
        vllm.make_policy(min_gain=-1)
    with pytest.raises(eplb.InvalidArgument, match="needs expert_bytes"):
        vllm.make_policy(min_gain=1.0)
