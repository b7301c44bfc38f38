"""eplb.rebalance_experts: the reference's example, parity with a NumPy re-statement of the
reference algorithm, input validation, the numpy / list / torch paths, and our policies."""

import subprocess
import sys
import threading

import numpy as np
import pytest

import eplb
import numpy_reference

# The example of deepseek-ai/EPLB's README.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
README_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                 [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
README_LOG2PHY = [[[12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2], [1, -1], [3, -1],
                   [4, -1], [9, -1], [8, 10], [14, -1]],
                  [[13, -1], [15, 11], [8, -1], [14, -1], [9, -1], [10, 12], [2, 4], [0, -1],
                   [6, 3], [7, -1], [1, -1], [5, -1]]]

# (layers, experts, physical, groups, nodes, gpus): hierarchical, global (groups % nodes != 0,
# including a group count that does not divide the experts, as the reference allows there),
# one group, one slot per rank, DeepSeek-V3's shape.
SHAPES = [
    (2, 12, 16, 4, 2, 8),
    (4, 16, 20, 4, 2, 4),
    (3, 64, 80, 8, 2, 8),
    (3, 64, 72, 1, 1, 8),
    (2, 120, 160, 6, 4, 16),
    (3, 30, 40, 7, 2, 8),
    (5, 32, 64, 4, 4, 16),
    (4, 16, 16, 4, 4, 16),
    (2, 256, 288, 8, 4, 32),
]


def tie_free_load(seed, layers, experts):
    """Skewed float32 loads with a random fraction: no two loads (or sums) tie in practice."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, 1.2, (layers, experts)) * 1000 + rng.random((layers, experts))
    return w.astype(np.float32)


def check_placement(phy2log, log2phy, logcnt, experts, physical):
    """The invariants every policy's output must hold."""
    layers = phy2log.shape[0]
    assert phy2log.shape == (layers, physical) and logcnt.shape == (layers, experts)
    assert log2phy.shape == (layers, experts, int(logcnt.max()))
    for a in (phy2log, log2phy, logcnt):
        assert a.dtype == np.int64
    for l in range(layers):
        assert np.array_equal(np.bincount(phy2log[l], minlength=experts), logcnt[l])
        for e in range(experts):
            slots = log2phy[l, e, :logcnt[l, e]]
            assert np.all(phy2log[l, slots] == e)
            assert np.all(log2phy[l, e, logcnt[l, e]:] == -1)


def assert_same_replica_sets(ours, theirs, context):
    """log2phy equal up to the order of each expert's replicas."""
    assert ours.shape == theirs.shape, context
    assert np.array_equal(np.sort(ours, axis=-1), np.sort(theirs, axis=-1)), context


def test_readme_example():
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert isinstance(phy2log, np.ndarray)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == README_LOGCNT
    assert log2phy.tolist() == README_LOG2PHY
    check_placement(phy2log, log2phy, logcnt, 12, 16)


def test_readme_example_from_nested_lists():
    phy2log, log2phy, logcnt = eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert log2phy.tolist() == README_LOG2PHY
    assert logcnt.tolist() == README_LOGCNT


def test_numpy_reference_restates_readme_example():
    phy2log, log2phy, logcnt = numpy_reference.rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert log2phy.tolist() == README_LOG2PHY
    assert logcnt.tolist() == README_LOGCNT


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_as_numpy_reference(shape, seed):
    layers, experts, physical, groups, nodes, gpus = shape
    w = tie_free_load(seed, layers, experts)
    ours = eplb.rebalance_experts(w, physical, groups, nodes, gpus)
    ref = numpy_reference.rebalance_experts(w, physical, groups, nodes, gpus)
    context = f"seed {seed}, shape {shape}"
    assert np.array_equal(ours[0], ref[0]), context
    assert np.array_equal(ours[2], ref[2]), context
    # The replicas of one expert tie exactly; the reference orders them as torch's unstable
    # sort does, the NumPy re-statement by a stable sort (see test_same_log2phy_order_as_torch).
    assert_same_replica_sets(ours[1], ref[1], context)
    check_placement(*ours, experts, physical)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_same_log2phy_order_as_torch_sort(shape):
    torch = pytest.importorskip("torch")

    def torch_order(weight):
        return torch.from_numpy(np.ascontiguousarray(weight)).sort(
            -1, descending=True).indices.numpy()

    layers, experts, physical, groups, nodes, gpus = shape
    w = tie_free_load(7, layers, experts)
    ours = eplb.rebalance_experts(w, physical, groups, nodes, gpus)
    ref = numpy_reference.rebalance_experts(w, physical, groups, nodes, gpus, order=torch_order)
    for name, a, b in zip(("phy2log", "log2phy", "logcnt"), ours, ref):
        assert np.array_equal(a, b), f"{name} differs, shape {shape}"


def test_input_dtypes_give_the_same_result():
    w = tie_free_load(3, 3, 64)
    expected = eplb.rebalance_experts(w, 80, 8, 2, 8)
    for variant in (w.astype(np.float64), w.tolist(), np.asfortranarray(w),
                    np.concatenate([w, w], axis=1)[:, :64]):
        got = eplb.rebalance_experts(variant, 80, 8, 2, 8)
        for a, b in zip(got, expected):
            assert np.array_equal(a, b)


def test_integer_loads_with_ties_are_deterministic():
    w = np.ones((4, 32), dtype=np.int64)
    first = eplb.rebalance_experts(w, 48, 4, 2, 8)
    again = eplb.rebalance_experts(w, 48, 4, 2, 8)
    for a, b in zip(first, again):
        assert np.array_equal(a, b)
    check_placement(*first, 32, 48)


def test_concurrent_calls_from_threads_agree():
    # The computation runs with the GIL released; results must not depend on the interleaving.
    w = tie_free_load(5, 8, 256)
    expected = eplb.rebalance_experts(w, 288, 8, 4, 32)
    results = [None] * 4

    def work(i):
        results[i] = eplb.rebalance_experts(w, 288, 8, 4, 32)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        for a, b in zip(got, expected):
            assert np.array_equal(a, b)


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("weight, match", [
    (np.ones(12), "2-D"),
    (np.ones((2, 3, 12)), "2-D"),
    (np.ones((0, 12)), "empty"),
    ([[1.0, -1.0] + [1.0] * 10], "-1"),
    ([[1.0, float("nan")] + [1.0] * 10], "nan"),
    ([[1.0, float("inf")] + [1.0] * 10], "inf"),
    ([["a"] * 12], "numeric"),
])
def test_bad_weight_raises_value_error(weight, match):
    with pytest.raises(ValueError, match=match):
        eplb.rebalance_experts(weight, 16, 4, 2, 8)


def test_integer_loads_a_double_would_round_are_refused():
    # Loads are doubles: counts above 2^53 are refused (as load files refuse them), not rounded;
    # 2^53 itself is exact and accepted.
    w = np.ones((2, 12), dtype=np.int64)
    w[1, 3] = 2**53
    assert eplb.rebalance_experts(w, 16, 4, 2, 8)[0].shape == (2, 16)
    w[1, 3] = 2**53 + 1
    message = r"weight\[1, 3\] is 9007199254740993, above 2\^53"
    with pytest.raises(eplb.InvalidArgument, match=message):
        eplb.rebalance_experts(w, 16, 4, 2, 8)
    w[1, 3] = -(2**60)
    with pytest.raises(eplb.InvalidArgument, match="above 2\\^53"):
        eplb.rebalance_experts(w, 16, 4, 2, 8)
    u = np.ones((2, 12), dtype=np.uint64)
    u[0, 0] = 2**63 + 5
    with pytest.raises(eplb.InvalidArgument, match=r"weight\[0, 0\] is 9223372036854775813"):
        eplb.rebalance_experts(u, 16, 4, 2, 8)
    torch = pytest.importorskip("torch")
    w[1, 3] = 2**53 + 1
    with pytest.raises(eplb.InvalidArgument, match=message):
        eplb.rebalance_experts(torch.from_numpy(w), 16, 4, 2, 8)


@pytest.mark.parametrize("args, match", [
    ((15, 4, 2, 8), "physical 15 is not a multiple of ranks 8"),
    ((18, 4, 4, 6), "ranks 6 is not a multiple of nodes 4"),
    ((16, 8, 2, 8), "groups 8 does not divide experts 12"),
    ((8, 4, 2, 8), "physical 8 is below experts 12"),
    ((16, 4, 0, 8), "nodes 0"),
    ((16, 4, 2, 0), "num_gpus 0 is outside"),
])
def test_bad_layout_raises_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        eplb.rebalance_experts(README_WEIGHT, *args)


def test_errors_are_eplb_errors_and_value_errors():
    with pytest.raises(eplb.InvalidArgument) as info:
        eplb.rebalance_experts(README_WEIGHT, 15, 4, 2, 8)
    assert isinstance(info.value, eplb.Error)
    assert isinstance(info.value, ValueError)
    for cls in (eplb.InvalidArgument, eplb.NotSupported, eplb.IoError, eplb.Timeout):
        assert issubclass(cls, eplb.Error)
    assert not issubclass(eplb.NotSupported, ValueError)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="fastest")
    with pytest.raises(ValueError, match="previous"):
        eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="sticky")
    with pytest.raises(ValueError, match="tolerance"):
        eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="sticky",
                               previous=README_PHY2LOG, tolerance=1.5)
    # Experts without a slot in previous (they lived on ranks that are gone) each get one.
    phy2log = eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="sticky",
                                     previous=[[0] * 16, [1] * 16])[0]
    assert all(set(row.tolist()) == set(range(12)) for row in phy2log)
    with pytest.raises(ValueError, match="outside"):
        eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="sticky",
                               previous=[[12] * 16, [0] * 16])
    with pytest.raises(ValueError, match="integer"):
        eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="sticky",
                               previous=np.zeros((2, 16)) + 0.5)
    with pytest.raises(TypeError):
        eplb.rebalance_experts(README_WEIGHT, 16.0, 4, 2, 8)


# --- our policies -------------------------------------------------------------------------

@pytest.mark.parametrize("hierarchical", [False, True])
def test_balanced_policy(hierarchical):
    w = tie_free_load(11, 6, 64)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="balanced",
                                                      hierarchical=hierarchical)
    check_placement(phy2log, log2phy, logcnt, 64, 80)
    got = eplb.balancedness(w, phy2log, 8)
    best = eplb.lower_bound(w, 80, 8)
    assert np.all(got.per_layer <= best.balancedness + 1e-9)


def test_thorough_balanced_at_two_slots_per_rank():
    # 512 slots for 256 experts on 256 ranks: thorough counts are never worse, and on lognormal
    # loads far better, than the default's.
    rng = np.random.default_rng(5)
    w = np.round(rng.lognormal(0.0, 1.0, (2, 256)) * 1000)
    fast = eplb.rebalance_experts(w, 512, 8, 32, 256, policy="balanced")
    deep = eplb.rebalance_experts(w, 512, 8, 32, 256, policy="balanced", thorough=True)
    check_placement(*deep, 256, 512)
    got = eplb.balancedness(w, deep[0], 256).per_layer
    assert np.all(got >= eplb.balancedness(w, fast[0], 256).per_layer - 1e-12)
    assert got.mean() >= 0.97
    with pytest.raises(ValueError, match="thorough applies to the balanced and sticky"):
        eplb.rebalance_experts(w, 512, 8, 32, 256, policy="deepseek", thorough=True)


def test_sticky_policy_keeps_a_good_placement():
    w = tie_free_load(12, 4, 64)
    previous = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="balanced")[0]
    phy2log, log2phy, logcnt = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="sticky",
                                                      previous=previous, tolerance=0.05)
    check_placement(phy2log, log2phy, logcnt, 64, 80)
    # The previous placement is as balanced as balanced's: nothing needs to move.
    assert np.array_equal(phy2log, previous)


def test_sticky_policy_within_tolerance_of_balanced():
    w = tie_free_load(13, 4, 64)
    previous = np.tile(np.arange(80) % 64, (4, 1))  # the trivial placement
    tolerance = 0.02
    phy2log = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="sticky", previous=previous,
                                     tolerance=tolerance)[0]
    balanced = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="balanced")[0]
    ours = eplb.balancedness(w, phy2log, 8).per_layer
    best = eplb.balancedness(w, balanced, 8).per_layer
    assert np.all(ours >= best - tolerance - 1e-9)


# --- torch --------------------------------------------------------------------------------

def test_numpy_input_does_not_import_torch():
    code = ("import sys, numpy as np, eplb\n"
            "eplb.rebalance_experts(np.ones((2, 12)), 16, 4, 2, 8)\n"
            "sys.exit('torch' in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    w = torch.tensor(README_WEIGHT, dtype=torch.float32)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(w, 16, 4, 2, 8)
    for t in (phy2log, log2phy, logcnt):
        assert isinstance(t, torch.Tensor)
        assert t.dtype == torch.int64
        assert t.device.type == "cpu"
    assert phy2log.tolist() == README_PHY2LOG
    assert log2phy.tolist() == README_LOG2PHY
    assert logcnt.tolist() == README_LOGCNT


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int64"])
def test_torch_dtypes(dtype):
    torch = pytest.importorskip("torch")
    w = torch.tensor(README_WEIGHT).to(getattr(torch, dtype))
    phy2log, _, logcnt = eplb.rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == README_LOGCNT


def test_torch_matches_numpy_path():
    torch = pytest.importorskip("torch")
    w = tie_free_load(21, 4, 256)
    from_numpy = eplb.rebalance_experts(w, 288, 8, 4, 32)
    t = torch.from_numpy(w).t().contiguous().t()  # a non-contiguous view
    t.requires_grad_(True)
    from_torch = eplb.rebalance_experts(t, 288, 8, 4, 32)
    for a, b in zip(from_numpy, from_torch):
        assert np.array_equal(a, b.numpy())


def test_torch_previous_and_bad_input():
    torch = pytest.importorskip("torch")
    w = torch.tensor(README_WEIGHT, dtype=torch.float32)
    previous = torch.tensor(README_PHY2LOG)
    phy2log = eplb.rebalance_experts(w, 16, 4, 2, 8, policy="sticky", previous=previous)[0]
    assert isinstance(phy2log, torch.Tensor)
    with pytest.raises(ValueError, match="2-D"):
        eplb.rebalance_experts(w[0], 16, 4, 2, 8)
    with pytest.raises(ValueError, match="nan"):
        eplb.rebalance_experts(torch.full((2, 12), float("nan")), 16, 4, 2, 8)


# --- bounds: checked before anything is sized, as ValueError naming the argument ------------

@pytest.mark.parametrize("args, match", [
    ((np.ones((2, 4), dtype=np.complex128), 4, 1, 1, 2), "weight must be a numeric .* complex128"),
    ((np.ones((2, 4)), 2**40, 1, 1, 2**20),
     r"num_replicas 1099511627776 is outside \[1, 1048576\]"),
    ((np.ones((2, 4)), 2**63, 1, 1, 2), r"num_replicas 9223372036854775808 is outside"),
    ((np.ones((2, 4)), 4, 1, 1, 2**20), r"num_gpus 1048576 is outside \[1, 65536\]"),
    ((np.ones((2, 4)), 4, 1, -2**70, 2), r"num_nodes -1180591620717411303424 is outside"),
])
def test_huge_or_complex_inputs_raise_value_error(args, match):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning on the way
        with pytest.raises(ValueError, match=match):
            eplb.rebalance_experts(*args)


def test_complex_torch_loads_raise_value_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="complex"):
        eplb.rebalance_experts(torch.ones((2, 4), dtype=torch.complex64), 4, 1, 1, 2)
