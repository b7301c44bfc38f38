"""eplb.balancedness and eplb.lower_bound against hand-computed figures."""

import numpy as np
import pytest

import eplb


def rank_loads(weight, phy2log, gpus):
    """Each rank's load: replicas share their expert's load equally."""
    weight = np.asarray(weight, dtype=np.float64)
    phy2log = np.asarray(phy2log)
    layers, physical = phy2log.shape
    out = np.zeros((layers, gpus))
    for l in range(layers):
        count = np.bincount(phy2log[l], minlength=weight.shape[1])
        for p in range(physical):
            e = phy2log[l, p]
            out[l, p // (physical // gpus)] += weight[l, e] / count[e]
    return out


def test_balancedness_by_hand():
    # 4 experts, 6 slots on 3 ranks (2 slots each); layer 1 is perfectly balanced.
    weight = [[8.0, 4.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]]
    phy2log = [[0, 1, 0, 2, 3, 1], [0, 1, 2, 3, 0, 1]]
    got = eplb.balancedness(weight, phy2log, 3)
    # Layer 0: ranks 4+2, 4+2, 2+2 -> mean 16/3, max 6. Layer 1: 2+2, 4+4, 2+2 -> mean 16/3, max 8.
    assert isinstance(got, eplb.Balancedness)
    assert got.per_layer.dtype == np.float64 and got.per_layer.shape == (2,)
    np.testing.assert_allclose(got.per_layer, [16 / 3 / 6, 16 / 3 / 8])
    assert got.mean == pytest.approx((16 / 3 / 6 + 16 / 3 / 8) / 2)
    assert got.step == pytest.approx((32 / 3) / 14)


def test_balancedness_of_rebalance_matches_rank_loads():
    rng = np.random.default_rng(4)
    w = rng.lognormal(0, 1, (5, 64)) * 100
    phy2log = eplb.rebalance_experts(w, 80, 8, 2, 8)[0]
    loads = rank_loads(w, phy2log, 8)
    expected = loads.mean(axis=1) / loads.max(axis=1)
    got = eplb.balancedness(w, phy2log, 8)
    np.testing.assert_allclose(got.per_layer, expected, rtol=1e-12)
    assert got.mean == pytest.approx(expected.mean())
    assert got.step == pytest.approx(loads.mean(axis=1).sum() / loads.max(axis=1).sum())


def test_all_zero_layer_is_balanced():
    got = eplb.balancedness(np.zeros((1, 4)), [[0, 1, 2, 3]], 2)
    assert got.per_layer.tolist() == [1.0]
    bound = eplb.lower_bound(np.zeros((1, 4)), 4, 2)
    assert bound.per_layer.tolist() == [0.0] and bound.balancedness.tolist() == [1.0]


def test_lower_bound_by_hand():
    # Two slots per rank, mean rank load 118 / 4 = 29.5, but every replica needs a partner:
    # the hot expert's four replicas of 25 (three are too heavy, five leave it partnering
    # itself) need four partners of at most 4.5, and the other three experts have four slots
    # for that: 10 cannot go below 4.5 in them. So 29.5 is out of reach; the best is 30 (25 + 5
    # three times, 25 + 3, with 10 as two replicas of 5), and the bound finds it (bisection,
    # 1e-5).
    weight = [[100.0, 10.0, 5.0, 3.0], [1.0, 1.0, 1.0, 1.0]]
    got = eplb.lower_bound(weight, 8, 4)
    assert isinstance(got, eplb.LowerBound)
    assert 29.5 < got.per_layer[0] <= 30.0
    np.testing.assert_allclose(got.per_layer, [30.0, 1.0], rtol=1e-4)
    np.testing.assert_allclose(got.balancedness, [29.5 / got.per_layer[0], 1.0])
    # One extra slot: the hot expert keeps 100 / 2 = 50 per replica, above the mean 118 / 5;
    # in layer 1 a single expert (1.0) stays above the mean 4 / 5.
    got = eplb.lower_bound(weight, 5, 5)
    np.testing.assert_allclose(got.per_layer, [50.0, 1.0])
    np.testing.assert_allclose(got.balancedness, [(118 / 5) / 50.0, 0.8])
    assert got.balancedness_mean == pytest.approx(((118 / 5) / 50.0 + 0.8) / 2)


def test_no_policy_beats_the_lower_bound():
    rng = np.random.default_rng(9)
    w = rng.lognormal(0, 1.5, (6, 64)) * 100
    bound = eplb.lower_bound(w, 80, 8)
    for policy in ("deepseek", "balanced"):
        phy2log = eplb.rebalance_experts(w, 80, 8, 2, 8, policy=policy)[0]
        loads = rank_loads(w, phy2log, 8)
        assert np.all(loads.max(axis=1) >= bound.per_layer * (1 - 1e-12))


def test_metrics_accept_torch():
    torch = pytest.importorskip("torch")
    w = torch.tensor([[8.0, 4.0, 2.0, 2.0]])
    got = eplb.balancedness(w, torch.tensor([[0, 1, 0, 2, 3, 1]]), 3)
    np.testing.assert_allclose(got.per_layer, [16 / 3 / 6])
    assert eplb.lower_bound(w, 6, 3).per_layer.shape == (1,)


@pytest.mark.parametrize("call, match", [
    (lambda: eplb.balancedness([[1.0, 2.0]], [[0, 1, 1]], 2), "multiple of ranks"),
    (lambda: eplb.balancedness([[1.0, 2.0]], [[0, 0]], 2), "expert 1 has no slot"),
    (lambda: eplb.balancedness([[1.0, 2.0]], [[0, 2]], 2), "outside"),
    (lambda: eplb.balancedness([[1.0, 2.0]], [[0, 1], [1, 0]], 2), "layers"),
    (lambda: eplb.balancedness([[1.0, -2.0]], [[0, 1]], 2), "-2"),
    (lambda: eplb.balancedness([[1.0, 2.0]], [0, 1], 2), "2-D"),
    (lambda: eplb.balancedness([[1.0, 2.0]], [[0.0, 1.0]], 2), "integer"),
    (lambda: eplb.lower_bound([[1.0, 2.0]], 3, 2), "multiple of ranks"),
    (lambda: eplb.lower_bound([[1.0, 2.0]], 1, 1), "below experts"),
    (lambda: eplb.lower_bound([[1.0, float("nan")]], 2, 2), "nan"),
    (lambda: eplb.lower_bound([1.0, 2.0], 2, 2), "2-D"),
])
def test_metric_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
