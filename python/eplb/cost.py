"""The cost model: what one rank pays, in time, for one MoE layer of one step.

    rank time  = rank_us + sum over the rank's activated slots of slot_time(n)
    slot_time(n) = slot_us + token_us * min(n, knee) + token_us_above * max(0, n - knee)
    layer time = the expected largest of the ranks' times, each times max(0, 1 + noise * Z)

(no knee: ``knee_tokens`` 0, every token costs ``token_us``). The same type as the C++
library's ``eplb::placement::CostModel`` (docs/dispatch.md), used by ``eplb simulate --cost``
and the ``adaptive_cost`` dispatch.

Ways to get one:

- ``fit_cost_model(slots, tokens, time_us)``: least squares on an engine's measured per-rank,
  per-layer times (activated slots, tokens computed, microseconds), every parameter >= 0;
- ``fit_cost_model_or_tokens(...)``: the same, or where the samples cannot be fitted (too few,
  or tokens per slot that never vary) the ``tokens`` preset, with the reason;
- ``fit_slot_table(tokens, time_us)``: a kernel's time per token count, with a knee where two
  lines fit better than one;
- ``roofline_cost_model(hbm_bytes_per_s=, peak_flops=, expert_bytes=, flops_per_token=)``;
- ``cost_model_preset("h100-v3-decode")`` (``cost_model_presets()`` lists them);
- ``cost_model_from_json(text)``, and ``model.to_json()`` back.

Bad input (a negative or NaN parameter, too few samples, a missing roofline figure) raises
``eplb.InvalidArgument`` naming the value.
"""

from . import _eplb

CostModel = _eplb.CostModel
fit_slot_table = _eplb.fit_slot_table
roofline_cost_model = _eplb.roofline_cost_model
cost_model_preset = _eplb.cost_model_preset
cost_model_presets = _eplb.cost_model_presets
cost_model_from_json = _eplb.cost_model_from_json


def fit_cost_model(slots, tokens, time_us, steps=None):
    """Fits rank_us, slot_us and token_us (>= 0) to samples of (activated slots, tokens,
    microseconds), one per rank and layer and step; at least 8 samples, with tokens per slot
    that vary (else the slots' cost cannot be told from the tokens'). Also the model's
    ``noise``: the relative standard deviation of a rank's time around the model, measured
    within each step when ``steps`` (the step of each sample) is given, so that a step slower
    on every rank at once (the machine busier) does not count as one rank being slower than the
    others. A layer waits for its slowest rank: ``model.layer_time_us(rank_times)`` is the
    expected slowest under that noise."""
    return _eplb.fit_cost_model(slots, tokens, time_us, steps)


def fit_cost_model_or_tokens(slots, tokens, time_us, steps=None):
    """fit_cost_model, or where the samples cannot be fitted (fewer than 8, or tokens per slot
    that never vary) the ``tokens`` preset (1 us per token, its ``source`` saying why): returns
    ``(model, why)``, ``why`` the fit's error, empty when the fit held. For an engine that fits
    while serving and must decide (eplb.should_rebalance) before it has samples enough. Arrays
    of different lengths, or a bad ``steps``, still raise eplb.InvalidArgument."""
    return _eplb.fit_cost_model_or_tokens(slots, tokens, time_us, steps)


__all__ = [
    "CostModel",
    "fit_cost_model",
    "fit_cost_model_or_tokens",
    "fit_slot_table",
    "roofline_cost_model",
    "cost_model_preset",
    "cost_model_presets",
    "cost_model_from_json",
]
