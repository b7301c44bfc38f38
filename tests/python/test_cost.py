"""eplb.cost: the cost model from Python: presets, fits, JSON, and errors naming the value."""

import json

import numpy as np
import pytest

import eplb
from eplb import cost


def test_preset_roofline_figures():
    m = cost.cost_model_preset("h100-v3-decode")
    assert m.slot_us == pytest.approx(3 * 7168 * 2048 / 3.35e12 * 1e6)
    assert m.knee_tokens == pytest.approx(295.4, abs=0.1)
    assert m.slot_time_us(1) == pytest.approx(m.slot_time_us(200))
    assert "h100-v3-decode" in cost.cost_model_presets()


def test_fit_recovers_parameters():
    rng = np.random.default_rng(3)
    slots = rng.integers(20, 34, 300).astype(float)
    tokens = rng.integers(100, 400, 300).astype(float)
    times = 40 + 50 * slots + 12 * tokens + rng.normal(0, 1, 300)
    m = cost.fit_cost_model(slots, tokens, times)
    assert m.slot_us == pytest.approx(50, abs=1)
    assert m.token_us == pytest.approx(12, abs=0.1)


def test_json_round_trip():
    m = cost.CostModel(slot_us=48.0, token_us=14.0, source="mine")
    back = cost.cost_model_from_json(m.to_json())
    assert (back.slot_us, back.token_us, back.source) == (48.0, 14.0, "mine")
    assert json.loads(m.to_json())["slot_us"] == 48.0


def test_errors_name_the_value():
    with pytest.raises(eplb.InvalidArgument, match="slot_us is -1"):
        cost.CostModel(slot_us=-1.0)
    with pytest.raises(eplb.InvalidArgument, match="3 samples"):
        cost.fit_cost_model([1, 2, 3], [4, 5, 6], [7, 8, 9])
    with pytest.raises(eplb.InvalidArgument, match="peak_flops is 0"):
        cost.roofline_cost_model(hbm_bytes_per_s=3e12, expert_bytes=1e6, flops_per_token=2e6)
    with pytest.raises(ValueError, match="not a preset"):
        cost.cost_model_preset("a100")


def test_a_fit_with_too_few_samples_says_so_and_falls_back_to_tokens():
    m, why = cost.fit_cost_model_or_tokens([1, 2, 3], [4, 5, 6], [7, 8, 9])
    assert "3 samples" in why
    assert (m.rank_us, m.slot_us, m.token_us) == (0, 0, 1)
    assert "3 samples" in m.source
    rng = np.random.default_rng(4)
    slots = rng.integers(20, 34, 50).astype(float)
    tokens = rng.integers(100, 400, 50).astype(float)
    m, why = cost.fit_cost_model_or_tokens(slots, tokens, 50 * slots + 12 * tokens)
    assert why == "" and m.slot_us == pytest.approx(50, abs=1e-6)
    with pytest.raises(eplb.InvalidArgument, match="have 2, 3 and 3 entries"):
        cost.fit_cost_model_or_tokens([1, 2], [4, 5, 6], [7, 8, 9])

def test_fit_measures_the_noise_within_steps():
    rng = np.random.default_rng(5)
    steps = np.repeat(np.arange(40), 8)
    slots = rng.integers(20, 34, steps.size).astype(float)
    tokens = rng.integers(100, 400, steps.size).astype(float)
    common = 1 + rng.normal(0, 0.15, 40)[steps]  # the whole step slower or faster
    times = (50 * slots + 12 * tokens) * common * (1 + rng.normal(0, 0.08, steps.size))
    m = cost.fit_cost_model(slots, tokens, times, steps=steps)
    assert m.noise == pytest.approx(0.08, abs=0.015)
    assert cost.fit_cost_model(slots, tokens, times).noise > 0.12
    # A layer waits for the slowest of its ranks: eight alike pay ~1.42 deviations more.
    assert m.layer_time_us([100.0] * 8) == pytest.approx(100 * (1 + m.noise * 1.4236), rel=2e-3)
    back = cost.cost_model_from_json(m.to_json())
    assert back.noise == m.noise and back.heldout_error is None
    with pytest.raises(eplb.InvalidArgument, match="noise is 2"):
        cost.CostModel(slot_us=1.0, noise=2.0)
    with pytest.raises(eplb.InvalidArgument, match=r"steps\[1\] is -3"):
        cost.fit_cost_model(slots[:10], tokens[:10], times[:10], steps=[0, -3] + [0] * 8)


def _two_ranks(phy2log):
    return np.array([phy2log], dtype=np.int64)


def test_should_rebalance_weighs_the_gain_against_the_price():
    # 2 ranks of 2 slots, experts 0-2. In force: expert 0 twice on rank 0; proposed: expert 0
    # on both ranks. 40 tokens of expert 0, 10 of expert 1 per step.
    load = np.array([[40.0, 10.0, 0.0]])
    current, proposed = _two_ranks([0, 0, 1, 2]), _two_ranks([0, 1, 0, 2])
    model = cost.CostModel(rank_us=5.0, slot_us=10.0, token_us=1.0)
    d = eplb.should_rebalance(load, current, proposed, 2, interval=100, pull_bytes_per_s=1e9,
                              min_gain=1.0, cost=model, bytes_to_move=1e6)
    # In force: 5 + 2 * (10 + 20) = 65 on rank 0; proposed: 55 (see the C++ test).
    assert d["current_us"] == pytest.approx(65) and d["proposed_us"] == pytest.approx(55)
    assert d["gain_us"] == pytest.approx(1000) and d["price_us"] == pytest.approx(1000)
    assert d["rebalance"] and d["priced"]
    d = eplb.should_rebalance(load, current, proposed, 2, interval=100, pull_bytes_per_s=1e9,
                              min_gain=1.0, cost=model, bytes_to_move=1e6, stall_s=1e-3)
    assert not d["rebalance"] and "below min_gain 1 x the price" in d["reason"]
    # The moves planned from the bytes of one expert; a window of 10 steps' sums.
    d = eplb.should_rebalance(load * 10, current, proposed, 2, interval=100,
                              pull_bytes_per_s=None, cost=model, window_steps=10,
                              expert_bytes=1000)
    assert d["bytes"] > 0 and not d["priced"] and d["rebalance"]
    assert d["current_us"] == pytest.approx(65)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(eplb.InvalidArgument, match="min_gain is"):
            eplb.should_rebalance(load, current, proposed, 2, interval=10, pull_bytes_per_s=1e9,
                                  min_gain=bad, bytes_to_move=0)
    with pytest.raises(eplb.InvalidArgument, match="bytes_to_move, or expert_bytes"):
        eplb.should_rebalance(load, current, proposed, 2, interval=10, pull_bytes_per_s=1e9)
    with pytest.raises(eplb.InvalidArgument, match="same layers"):
        eplb.should_rebalance(np.zeros((2, 3)), current, proposed, 2, interval=10,
                              pull_bytes_per_s=1e9, bytes_to_move=0)
