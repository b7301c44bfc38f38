"""Misuse from Python raises eplb's exceptions, each naming the parameter, its value and what
would be right; never the C++ library's internal check text ("[cond at src/...cc:N]"), never a
bare Python error from deep inside. Covers the runtime called out of order (before connect(),
twice, after shutdown()), every method taking a layer with one outside the model, a joining
seat outside the layout, the placement's parameters, the engines' load helpers and their files.
"""

import json

import numpy as np
import pytest

import eplb
from eplb.integrations import sglang, vllm

CONFIG = {"experts": 4, "physical": 4, "interval": 1000, "window": 4}
LAYERS = 2


def weights(slots=4):
    return {"w13": [np.zeros((slots, 16), np.float32) for _ in range(LAYERS)]}


def make(connect=True):
    rb = eplb.Rebalancer(CONFIG, 0, 1, control="inproc", transport="inproc", weights=weights(),
                         layers=LAYERS)
    if connect:
        rb.connect()
    return rb


def raises_clearly(call, *words, kind=eplb.InvalidArgument):
    """`call()` raises `kind` whose message has every word of `words` and no check text."""
    with pytest.raises(kind) as info:
        call()
    text = str(info.value)
    assert "at src/" not in text and "cond at" not in text and "[expected " not in text, text
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    return text


# --- the runtime's order of calls --------------------------------------------------------------

def test_step_end_before_connect():
    rb = make(connect=False)
    raises_clearly(rb.step_end, "step_end()", "connect() first")
    rb.shutdown()


def test_weights_and_host_bytes_before_connect():
    rb = make(connect=False)
    raises_clearly(lambda: rb.weights(0, "w13", dtype=np.uint8), "weights()", "connect() first")
    raises_clearly(rb.host_bytes, "host_bytes()", "connect() first")
    rb.shutdown()


def test_connect_twice():
    rb = make()
    raises_clearly(rb.connect, "connect()", "already called")
    rb.shutdown()


def test_after_shutdown():
    rb = make()
    rb.shutdown()
    raises_clearly(rb.step_end, "step_end()", "shut down")
    raises_clearly(rb.connect, "connect()", "shut down")
    raises_clearly(lambda: rb.reconfigure(0, 1, [0], control="inproc", transport="inproc",
                                          rendezvous="errors-after-shutdown"),
                   "reconfigure()", "shut down")
    rb.shutdown()  # idempotent


def test_reconfigure_before_connect():
    rb = make(connect=False)
    raises_clearly(lambda: rb.reconfigure(0, 1, [0], control="inproc", transport="inproc",
                                          rendezvous="errors-before-connect"),
                   "reconfigure()", "connect() first")
    rb.shutdown()


# --- layers, tensors and seats outside the model -----------------------------------------------

@pytest.mark.parametrize("layer", [-1, LAYERS, 99])
def test_every_layer_argument_is_checked(layer):
    rb = make()
    ids = np.zeros((2, 2), np.int32)
    calls = {
        "route()": lambda: rb.route(layer, ids),
        "dispatch()": lambda: rb.dispatch(layer),
        "phy2log()": lambda: rb.phy2log(layer),
        "unavailable()": lambda: rb.unavailable(layer),
        "record()": lambda: rb.record(layer, ids),
        "record_counts()": lambda: rb.record_counts(layer, np.zeros(CONFIG["experts"], np.int64)),
        "weights()": lambda: rb.weights(layer, "w13", dtype=np.uint8),
    }
    for name, call in calls.items():
        text = raises_clearly(call, f"layer {layer}", f"[0, {LAYERS})")
        assert name.rstrip("()") in text, text
    rb.shutdown()


def test_route_without_choices():
    rb = make()
    raises_clearly(lambda: rb.route(0, np.zeros((3, 0), np.int32)), "top_k must be at least 1")
    rb.shutdown()


def test_backup_weights_without_backup():
    rb = make()
    raises_clearly(lambda: rb.backup_weights(0, "w13", 0), "backup_weights()",
                   "no backup copy")
    rb.shutdown()


@pytest.mark.parametrize("seat", [-1, 2, 9])
def test_join_seat_outside_the_layout(seat):
    raises_clearly(lambda: eplb.Rebalancer.join(CONFIG, seat, 2, weights=weights(slots=2),
                                                layers=LAYERS),
                   f"seat {seat}", "[0, 2)")


def test_save_stats_format_names_the_parameter(tmp_path):
    rb = make()
    raises_clearly(lambda: rb.save_stats(tmp_path / "s.json", "bogus"), "format", "'bogus'")
    rb.shutdown()


# --- placement parameters and loads ------------------------------------------------------------

@pytest.mark.parametrize("tolerance", ["x", None, True])
def test_tolerance_that_is_no_number(tolerance):
    raises_clearly(lambda: eplb.rebalance_experts(np.ones((2, 4)), 4, 1, 1, 2, policy="sticky",
                                                  previous=np.tile(np.arange(4), (2, 1)),
                                                  tolerance=tolerance),
                   "tolerance", repr(tolerance))
    raises_clearly(lambda: vllm.make_policy("sticky", tolerance=tolerance), "tolerance")
    raises_clearly(lambda: sglang.Algorithm("sticky", tolerance=tolerance), "tolerance")


def test_bool_loads_refused_from_numpy_lists_and_torch():
    raises_clearly(lambda: eplb.rebalance_experts(np.ones((2, 4), dtype=bool), 4, 1, 1, 2),
                   "weight", "bool")
    raises_clearly(lambda: eplb.rebalance_experts([[True, False, True, True]], 4, 1, 1, 2),
                   "weight", "bool")
    torch = pytest.importorskip("torch")
    raises_clearly(lambda: eplb.rebalance_experts(torch.ones((2, 4), dtype=torch.bool), 4, 1, 1,
                                                  2), "weight", "bool")


# --- the engines' helpers ----------------------------------------------------------------------

def test_vllm_logical_load_refuses_nan_and_negative_counts():
    phy2log = np.array([[0, 1, 2, 3]])
    window = np.ones((3, 1, 4))
    window[1, 0, 2] = np.nan
    raises_clearly(lambda: vllm.logical_load(window, phy2log, 4), "expert_load_window[1, 0, 2]",
                   "nan", "finite and non-negative")
    counts = np.ones((3, 1, 4), np.int64)
    counts[2, 0, 1] = -5
    raises_clearly(lambda: vllm.logical_load(counts, phy2log, 4), "expert_load_window[2, 0, 1]",
                   "-5")
    raises_clearly(lambda: vllm.save_load_window("unused.json", counts, phy2log, 4),
                   "expert_load_window[2, 0, 1]")
    ok = vllm.logical_load(np.ones((3, 1, 4), np.int64), phy2log, 4)
    np.testing.assert_array_equal(ok, np.full((1, 4), 3))


def test_file_helpers_raise_io_errors_naming_the_file(tmp_path):
    missing = tmp_path / "nowhere" / "load.json"
    text = raises_clearly(lambda: sglang.read_expert_distribution(missing), str(missing), "read",
                          kind=eplb.IoError)
    assert "No such file" in text
    raises_clearly(lambda: sglang.write_expert_distribution(missing, np.ones((1, 4))),
                   str(missing), "write", kind=eplb.IoError)
    raises_clearly(lambda: sglang.write_init_expert_location(missing, np.zeros((1, 4), np.int64)),
                   str(missing), "write", kind=eplb.IoError)
    raises_clearly(lambda: vllm.save_load_window(missing, np.ones((2, 1, 4), np.int64),
                                                 np.array([[0, 1, 2, 3]]), 4),
                   str(missing), "write", kind=eplb.IoError)
    # A folder where a file is expected.
    folder = tmp_path / "folder.json"
    folder.mkdir()
    raises_clearly(lambda: sglang.read_expert_distribution(folder), str(folder), "read",
                   kind=eplb.IoError)
    # A file that works, for contrast.
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"logical_count": [[1, 2, 3, 4]]}))
    assert sglang.read_expert_distribution(good).shape == (1, 1, 4)


def test_cost_fit_of_huge_times_names_the_sample():
    import eplb.cost
    slots = [1, 2, 3, 4, 1, 2, 3, 4]
    tokens = [10, 5, 30, 8, 40, 9, 12, 50]
    times = [1e308] * 8
    raises_clearly(lambda: eplb.cost.fit_cost_model(slots, tokens, times), "sample 0", "1e+308",
                   "us")
    raises_clearly(lambda: eplb.cost.fit_slot_table([1, 2, 4, 8], [1e308] * 4), "row 0")
    fitted = eplb.cost.fit_cost_model(slots, tokens, [3 + 2 * s + 0.5 * t
                                                      for s, t in zip(slots, tokens)])
    assert abs(fitted.token_us - 0.5) < 1e-6


def test_a_step_sum_past_a_double_is_named_as_such():
    steps = np.full((3, 1, 4), 1e308)
    raises_clearly(lambda: sglang.Algorithm("balanced").rebalance_experts(steps, 4, 2, 1, 1),
                   "tokens_per_expert", "sum over the steps", "each step is finite")
    phy2log = np.array([[0, 1, 2, 3]])
    raises_clearly(lambda: vllm.logical_load(np.full((3, 1, 4), 1e308), phy2log, 4),
                   "expert_load_window", "layer 0 expert 0 sum over the steps")
    counts = np.full((3, 1, 4), 2**62, np.int64)
    raises_clearly(lambda: vllm.logical_load(counts, phy2log, 4), "int64")
