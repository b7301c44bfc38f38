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
