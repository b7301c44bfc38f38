"""eplb.integrations: the vLLM policy and helpers against vLLM's contract and tests, the SGLang
functions against SGLang's conventions and files, and the comparison with vLLM's default policy
(restated: DeepSeek's reference, then preserve_intragpu_slots) on drifting loads."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import eplb
import numpy_reference
from eplb.integrations import sglang
from eplb.integrations import vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "python"))
import vllm_compare  # noqa: E402

SGLANG_STATS = os.path.join(ROOT, "data", "deepseek-v3-sglang", "prefill_in1024.json")

# deepseek-ai/EPLB's README example, as vLLM's test_basic_rebalance asserts it.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
README_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                 [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]

DTYPES = ["float16", "bfloat16", "float32", "float64", "int16", "int32", "int64", "uint8"]


def torch_or_skip():
    return pytest.importorskip("torch")


def cuda_or_skip():
    torch = torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def tie_free_load(seed, layers, experts):
    rng = np.random.default_rng(seed)
    return (rng.lognormal(0.0, 1.0, (layers, experts)) * 1000
            + rng.random((layers, experts))).astype(np.float32)


def check_phy2log(phy2log, layers, experts, physical):
    phy2log = np.asarray(phy2log)
    assert phy2log.shape == (layers, physical)
    for row in phy2log:
        assert np.all(np.bincount(row, minlength=experts)[:experts] >= 1)
        assert row.min() >= 0 and row.max() < experts


def preserve_by_hand(new, ranks, old):
    """vLLM's preserve_intragpu_slots in plain loops, one layer and GPU at a time."""
    new, old = np.asarray(new), np.asarray(old)
    out = new.copy()
    per = new.shape[1] // ranks
    for l in range(new.shape[0]):
        for g in range(ranks):
            lo = g * per
            fresh, before = list(new[l, lo:lo + per]), list(old[l, lo:lo + per])
            used, kept = [False] * per, [False] * per
            for s in range(per):
                for i in range(per):
                    if not used[i] and fresh[i] == before[s]:
                        used[i] = kept[s] = True
                        out[l, lo + s] = before[s]
                        break
            rest = [fresh[i] for i in range(per) if not used[i]]
            for s, e in zip([s for s in range(per) if not kept[s]], rest):
                out[l, lo + s] = e
    return out


def test_numpy_inputs_import_neither_torch_nor_the_engines():
    code = ("import sys, numpy as np\n"
            "from eplb.integrations import sglang, vllm\n"
            "w = np.arange(24.0).reshape(2, 12)\n"
            "p = vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8)\n"
            "vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8, p)\n"
            "vllm.compute_logical_maps(p, 12)\n"
            "sglang.rebalance_experts(w, 16, 2, 4, 2)\n"
            "sglang.expert_location_metadata(p, 12, 8)\n"
            "sys.exit(sorted({'torch', 'vllm', 'sglang'} & set(sys.modules)) or 0)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- vLLM: EplbPolicy -----------------------------------------------------------------------

def test_golden_readme_example_deepseek():
    torch = torch_or_skip()
    policy = vllm.make_policy(policy="deepseek")
    phy2log = policy.rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    assert isinstance(phy2log, torch.Tensor) and phy2log.dtype == torch.int64
    assert phy2log.device.type == "cpu"
    assert phy2log.tolist() == README_PHY2LOG
    p, log2phy, logcnt = policy.rebalance_experts_with_maps(torch.tensor(README_WEIGHT),
                                                             16, 4, 2, 8)
    assert p.tolist() == README_PHY2LOG and logcnt.tolist() == README_LOGCNT
    assert int(logcnt.sum()) == 16 * 2


def test_default_is_balanced_without_old_indices():
    torch = torch_or_skip()
    w = tie_free_load(1, 4, 64)
    got = vllm.EplbPolicy.rebalance_experts(torch.from_numpy(w), 80, 8, 2, 8)
    want = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="balanced")[0]
    assert np.array_equal(got.numpy(), want)
    assert got.shape == (4, 80) and got.dtype == torch.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_weight_dtype(dtype):
    torch = torch_or_skip()
    w = torch.tensor(README_WEIGHT).to(getattr(torch, dtype))
    want = vllm.EplbPolicy.rebalance_experts(np.array(README_WEIGHT, dtype=np.float64),
                                             16, 4, 2, 8)
    got = vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8)
    assert got.dtype == torch.int64 and got.device == w.device
    assert np.array_equal(got.numpy(), want)
    maps = vllm.EplbPolicy.rebalance_experts_with_maps(w, 16, 4, 2, 8)
    assert all(t.dtype == torch.int64 for t in maps)


def test_numpy_and_list_inputs_give_numpy():
    for w in (np.array(README_WEIGHT), README_WEIGHT):
        phy2log = vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8)
        assert isinstance(phy2log, np.ndarray) and phy2log.dtype == np.int64
        check_phy2log(phy2log, 2, 12, 16)


def test_cuda_weight_gives_cpu_maps_and_cuda_helpers():
    # The policy's map is on the CPU whatever the weight's device (vLLM asserts it); the helpers
    # keep their input's device.
    torch = cuda_or_skip()
    w = torch.tensor(README_WEIGHT, dtype=torch.bfloat16, device="cuda")
    phy2log = vllm.make_policy(policy="deepseek").rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.device.type == "cpu" and phy2log.dtype == torch.int64
    assert phy2log.tolist() == README_PHY2LOG
    sticky = vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8, phy2log)
    assert sticky.device.type == "cpu"
    for t in vllm.EplbPolicy.rebalance_experts_with_maps(w, 16, 4, 2, 8, phy2log):
        assert t.device.type == "cpu"
    phy2log, sticky = phy2log.to(w.device), sticky.to(w.device)
    log2phy, count = vllm.compute_logical_maps(phy2log, 12)
    assert log2phy.device == w.device and count.tolist() == README_LOGCNT
    kept = vllm.preserve_intragpu_slots(sticky, 8, phy2log)
    assert kept.device == w.device
    load = vllm.logical_load(torch.ones((3, 2, 16), dtype=torch.int32, device="cuda"),
                             phy2log, 12)
    assert load.device == w.device and load.tolist() == (3 * torch.tensor(README_LOGCNT)).tolist()


def test_vllm_parameter_validation():
    torch = torch_or_skip()
    w = torch.tensor([[10, 20, 30, 40]])
    # num_groups % num_nodes != 0: global balancing, no error (vLLM's test).
    phy2log = vllm.EplbPolicy.rebalance_experts(w, 8, 3, 2, 4)
    assert phy2log.shape == (1, 8)
    _, _, logcnt = vllm.EplbPolicy.rebalance_experts_with_maps(w, 8, 3, 2, 4)
    assert logcnt.shape == (1, 4)
    with pytest.raises(AssertionError, match="physical 7 is not a multiple of ranks 4"):
        vllm.EplbPolicy.rebalance_experts(w, 7, 2, 2, 4)


@pytest.mark.parametrize("args, message", [
    ((7, 2, 2, 4), "not a multiple of ranks 4"),       # num_replicas % num_ranks
    ((6, 2, 2, 3), "ranks 3 is not a multiple of nodes 2"),
    ((2, 1, 1, 2), "physical 2 is below experts 4"),  # fewer slots than experts
    ((8, 3, 1, 4), "groups 3 does not divide experts 4"),
    ((8, 2, 0, 4), "num_nodes 0 must be at least 1"),
])
def test_invalid_arguments_raise_assertion_error_and_invalid_argument(args, message):
    w = np.array([[10, 20, 30, 40]])
    with pytest.raises(AssertionError, match=message) as info:
        vllm.EplbPolicy.rebalance_experts(w, *args)
    assert isinstance(info.value, eplb.InvalidArgument) and isinstance(info.value, ValueError)
    assert isinstance(info.value, vllm.PolicyError)


def test_weight_not_2d_raises_value_error():
    torch = torch_or_skip()
    for w in (torch.tensor([10.0, 20, 30, 40]), torch.ones((2, 2, 4))):
        with pytest.raises(ValueError, match="2-D"):
            vllm.EplbPolicy.rebalance_experts(w, 8, 1, 1, 4)
    with pytest.raises(ValueError, match="negative|NaN|finite"):
        vllm.EplbPolicy.rebalance_experts(torch.tensor([[1.0, float("nan"), 1, 1]]), 4, 1, 1, 2)


def test_old_indices_of_another_shape_raise():
    # Another width is vLLM's elastic EP (test_vllm_call_sites.py); other layers are an error.
    w = np.array(README_WEIGHT)
    for old in (np.zeros((3, 16), dtype=np.int64), np.zeros((1, 12), dtype=np.int64),
                np.zeros(16, dtype=np.int64)):
        with pytest.raises(AssertionError, match=r"old_global_expert_indices has shape .*"
                                                 r"layers = 2"):
            vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8, old)
    with pytest.raises(ValueError, match="integer"):
        vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8, np.zeros((2, 16)) + 0.5)


def test_vllm_additional_cases():
    rng = np.random.default_rng(3)
    for layers, experts, args in [(1, 16, (24, 8, 4, 8)), (2, 6, (10, 3, 1, 2)),
                                  (3, 8, (8, 1, 1, 1)), (1, 4, (4, 2, 2, 4))]:
        w = rng.integers(1, 100, (layers, experts))
        phy2log = vllm.EplbPolicy.rebalance_experts(w, *args)
        check_phy2log(phy2log, layers, experts, args[0])
    # Equal weights: every expert once; a hot expert gets the extra replicas.
    _, _, logcnt = vllm.EplbPolicy.rebalance_experts_with_maps(np.ones((1, 8)), 8, 1, 1, 2)
    assert logcnt.tolist() == [[1] * 8]
    _, _, logcnt = vllm.EplbPolicy.rebalance_experts_with_maps([[1000, 1, 1, 1]], 8, 1, 1, 4)
    assert logcnt[0, 0] > logcnt[0, 1]


def test_sticky_with_old_indices_keeps_a_good_placement():
    torch = torch_or_skip()
    w = torch.from_numpy(tie_free_load(4, 4, 64))
    old = vllm.EplbPolicy.rebalance_experts(w, 80, 8, 2, 8)
    again = vllm.EplbPolicy.rebalance_experts(w, 80, 8, 2, 8, old)
    assert torch.equal(again, old)


def test_old_indices_with_unused_slots():
    # vLLM marks slots not in use with -1: they take the experts no slot holds.
    w = tie_free_load(5, 2, 12)
    old = eplb.rebalance_experts(w, 16, 4, 2, 8, policy="balanced")[0]
    old[0, 3] = -1
    old[1, [0, 5]] = -1
    for policy in (vllm.EplbPolicy, vllm.make_policy(policy="deepseek")):
        phy2log = policy.rebalance_experts(w, 16, 4, 2, 8, old)
        check_phy2log(phy2log, 2, 12, 16)
    # A layer missing more experts than it has unused slots is placed afresh.
    old[1] = 0
    check_phy2log(vllm.EplbPolicy.rebalance_experts(w, 16, 4, 2, 8, old), 2, 12, 16)


def test_make_policy():
    cls = vllm.make_policy(policy="sticky", tolerance=0.05, hierarchical=True, name="Mine")
    assert issubclass(cls, vllm.EplbPolicy) and cls.__name__ == "Mine"
    assert (cls.policy, cls.tolerance, cls.hierarchical) == ("sticky", 0.05, True)
    assert vllm.EplbPolicy.policy is None and vllm.EplbPolicy.tolerance == 0.01
    assert vllm.make_policy().__name__ == "EplbPolicyAuto"
    w = tie_free_load(6, 3, 64)
    previous = np.tile(np.arange(80) % 64, (3, 1))
    got = cls.rebalance_experts(w, 80, 8, 2, 8, previous)
    want = eplb.rebalance_experts(w, 80, 8, 2, 8, policy="sticky", previous=previous,
                                  tolerance=0.05, hierarchical=True)[0]
    assert np.array_equal(got, vllm.preserve_intragpu_slots(want, 8, previous))
    with pytest.raises(ValueError, match="policy 'greedy'"):
        vllm.make_policy(policy="greedy")
    with pytest.raises(ValueError, match="tolerance 1.5"):
        vllm.make_policy(tolerance=1.5)


def test_thorough_reaches_the_engines():
    # Two slots per rank, where thorough counts differ from the default ones.
    w = np.random.default_rng(3).lognormal(0, 1, (2, 256))
    want = eplb.rebalance_experts(w, 512, 8, 1, 256, policy="balanced", thorough=True)[0]
    assert not np.array_equal(want, eplb.rebalance_experts(w, 512, 8, 1, 256,
                                                           policy="balanced")[0])
    cls = vllm.make_policy(policy="balanced", thorough=True)
    assert cls.thorough and not vllm.EplbPolicy.thorough
    assert np.array_equal(cls.rebalance_experts(w, 512, 8, 1, 256), want)
    assert np.array_equal(sglang.rebalance_experts(w, 512, 2, 8, 1, thorough=True)[0], want)
    with pytest.raises(ValueError, match="thorough applies"):
        vllm.make_policy(policy="deepseek", thorough=True)
    with pytest.raises(ValueError, match="thorough applies"):
        sglang.rebalance_experts(w, 512, 2, 8, 1, "deepseek", thorough=True)


def test_legacy_triple():
    torch = torch_or_skip()
    w = torch.from_numpy(tie_free_load(7, 3, 32))
    legacy = vllm.make_policy(policy="balanced", legacy=True)
    phy2log, log2phy, logcnt = legacy.rebalance_experts(w, 48, 4, 2, 8)
    assert torch.equal(phy2log, vllm.make_policy(policy="balanced").rebalance_experts(
        w, 48, 4, 2, 8))
    want_log2phy, want_count = vllm.compute_logical_maps(phy2log, 32)
    assert torch.equal(log2phy, want_log2phy) and torch.equal(logcnt, want_count)
    assert log2phy.shape == (3, 32, int(logcnt.max())) and log2phy.dtype == torch.int64
    # The old classmethod with the placement in force, as some vLLM versions called it.
    p2, _, _ = legacy.rebalance_experts(w, 48, 4, 2, 8, phy2log)
    assert torch.equal(p2, phy2log)


# --- vLLM: maps ----------------------------------------------------------------------------

def test_compute_logical_maps_vllm_example():
    torch = torch_or_skip()
    phy2log = torch.tensor([[0, 1, -1, 2, 3, -1], [3, -1, 2, 1, 0, -1]])
    log2phy, count = vllm.compute_logical_maps(phy2log, 4)
    assert count.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert log2phy.shape == (2, 4, 1) and not (log2phy == -1).any()
    assert log2phy[0, :, 0].tolist() == [0, 1, 3, 4]
    assert log2phy[1, :, 0].tolist() == [4, 3, 2, 0]
    assert log2phy.dtype == phy2log.dtype == count.dtype


def test_compute_logical_maps_order_width_dtype_and_1d():
    phy2log = np.array([[2, 0, 2, 1, 2, 0], [0, 1, 2, 0, 1, 2]], dtype=np.int32)
    log2phy, count = vllm.compute_logical_maps(phy2log, 3)
    assert log2phy.dtype == count.dtype == np.int32
    # The width is the largest count over all layers (3), replicas in ascending slot order.
    assert log2phy.tolist() == [[[1, 5, -1], [3, -1, -1], [0, 2, 4]],
                                [[0, 3, -1], [1, 4, -1], [2, 5, -1]]]
    assert count.tolist() == [[2, 1, 3], [2, 2, 2]]
    one, one_count = vllm.compute_logical_maps(phy2log[1], 3)
    assert one.tolist() == [[0, 3], [1, 4], [2, 5]] and one_count.tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="outside"):
        vllm.compute_logical_maps([[0, 3]], 3)


def test_preserve_intragpu_slots_properties():
    rng = np.random.default_rng(8)
    for trial in range(60):
        ranks, per = int(rng.integers(1, 6)), int(rng.integers(1, 7))
        physical, layers = ranks * per, int(rng.integers(1, 4))
        experts = int(rng.integers(1, physical + 1))
        new = rng.integers(0, experts, (layers, physical))
        old = np.where(rng.random((layers, physical)) < 0.6, new[:, rng.permutation(physical)],
                       rng.integers(0, experts, (layers, physical)))
        post = vllm.preserve_intragpu_slots(new, ranks, old)
        assert np.array_equal(post, preserve_by_hand(new, ranks, old)), f"trial {trial}"
        for l in range(layers):
            for g in range(ranks):
                seg = slice(g * per, (g + 1) * per)
                # Same multiset of experts on every GPU: nothing changes GPU.
                assert sorted(post[l, seg]) == sorted(new[l, seg]), f"trial {trial}"
                old_list, new_list = list(old[l, seg]), list(new[l, seg])
                for e in set(old_list) & set(new_list):
                    assert post[l, seg][old_list.index(e)] == e, f"trial {trial}"


def test_preserve_intragpu_slots_types_and_cases():
    torch = torch_or_skip()
    new = torch.tensor([[0, 1, 2, 3], [2, 2, 0, 1]], dtype=torch.int32)
    old = torch.tensor([[1, 0, 3, 2], [0, 2, 1, 2]], dtype=torch.int32)
    post = vllm.preserve_intragpu_slots(new, 2, old)
    assert post.dtype == torch.int32 and post.tolist() == [[1, 0, 3, 2], [2, 2, 1, 0]]
    # Duplicates match one to one; experts of another GPU stay where the new map puts them.
    assert vllm.preserve_intragpu_slots(np.array([[5, 5, 1, 2]]), 1,
                                        np.array([[1, 5, 7, 5]])).tolist() == [[1, 5, 2, 5]]
    # num_ranks not dividing the slots: unchanged, as vLLM's.
    assert vllm.preserve_intragpu_slots(new.numpy(), 3, old.numpy()).tolist() == new.tolist()
    with pytest.raises(ValueError, match="one shape"):
        vllm.preserve_intragpu_slots(new[:, :2], 2, old)


# --- vLLM: load window ---------------------------------------------------------------------

def logical_by_hand(window, phy2log, experts):
    window = np.asarray(window)
    window = window[None] if window.ndim == 2 else window
    out = np.zeros((window.shape[0], phy2log.shape[0], experts), dtype=np.int64)
    for s in range(window.shape[0]):
        for l in range(phy2log.shape[0]):
            for p in range(phy2log.shape[1]):
                if phy2log[l, p] >= 0:
                    out[s, l, phy2log[l, p]] += window[s, l, p]
    return out


def test_logical_load():
    rng = np.random.default_rng(9)
    phy2log = eplb.rebalance_experts(tie_free_load(9, 3, 12), 16, 4, 2, 8)[0]
    phy2log[1, 4] = -1  # a slot not in use
    window = rng.integers(0, 50, (5, 3, 18)).astype(np.int32)  # wider than the map
    got = vllm.logical_load(window, phy2log, 12)
    assert got.dtype == np.int64 and got.shape == (3, 12)
    assert np.array_equal(got, logical_by_hand(window[:, :, :16], phy2log, 12).sum(axis=0))
    one = vllm.logical_load(window[0, :, :16], phy2log, 12)
    assert np.array_equal(one, logical_by_hand(window[0, :, :16], phy2log, 12)[0])
    torch = pytest.importorskip("torch")
    t = vllm.logical_load(torch.from_numpy(window), torch.from_numpy(phy2log), 12)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64
    assert np.array_equal(t.numpy(), got)
    with pytest.raises(ValueError, match="does not match"):
        vllm.logical_load(window[:, :2], phy2log, 12)


def eplb_cli():
    """The eplb binary of the build tree (or $EPLB_CLI), None when it is not built."""
    path = os.environ.get("EPLB_CLI", os.path.join(ROOT, "build", "src", "cli", "eplb"))
    return path if os.access(path, os.X_OK) else None


def test_save_load_window(tmp_path):
    rng = np.random.default_rng(10)
    phy2log = eplb.rebalance_experts(tie_free_load(10, 2, 12), 16, 4, 2, 8)[0]
    window = rng.integers(0, 40, (4, 2, 16))
    path = tmp_path / "window.json"
    assert vllm.save_load_window(path, window, phy2log, 12, window_step=1) == 4
    doc = json.loads(path.read_text())
    assert list(doc) == ["load_history"] and len(doc["load_history"]) == 4
    steps = logical_by_hand(window, phy2log, 12)
    # window_step 1: the ring buffer's oldest step (index 1) first.
    for i, entry in enumerate(doc["load_history"]):
        assert list(entry) == ["logical_expert_load"]
        assert entry["logical_expert_load"] == steps[(i + 1) % 4].tolist()
    vllm.save_load_window(tmp_path / "pass.json", window[0], phy2log, 12)
    assert len(json.loads((tmp_path / "pass.json").read_text())["load_history"]) == 1
    cli = eplb_cli()
    if cli is not None:  # `eplb plan --load` reads it (the steps summed)
        out = subprocess.run([cli, "plan", "--load", str(path), "--ranks", "8", "--nodes", "2",
                              "--groups", "4", "--physical", "16", "--json"],
                             check=True, capture_output=True, text=True).stdout
        plan = json.loads(out)
        assert plan["layers"] == 2 and plan["experts"] == 12


# --- vLLM: registry ------------------------------------------------------------------------

def fake_vllm(monkeypatch):
    """vllm.distributed.eplb.policy with an abstract class and a registry, as vLLM's."""
    import abc
    import types

    class AbstractEplbPolicy(abc.ABC):
        @classmethod
        @abc.abstractmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            raise NotImplementedError

    class DefaultEplbPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(cls, *args):
            return None

    names = ["vllm", "vllm.distributed", "vllm.distributed.eplb", "vllm.distributed.eplb.policy"]
    modules = [types.ModuleType(n) for n in names]
    for parent, child, n in zip(modules, modules[1:], names[1:]):
        setattr(parent, n.rsplit(".", 1)[1], child)
    modules[-1].AbstractEplbPolicy = AbstractEplbPolicy
    modules[-1].EPLB_POLICIES = {"default": DefaultEplbPolicy}
    for n, m in zip(names, modules):
        monkeypatch.setitem(sys.modules, n, m)
    return modules[-1]


def test_register(monkeypatch):
    registry = fake_vllm(monkeypatch)
    cls = vllm.register()
    assert registry.EPLB_POLICIES["eplb"] is cls
    assert issubclass(cls, registry.AbstractEplbPolicy) and issubclass(cls, vllm.EplbPolicy)
    assert cls.rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8).shape == (2, 16)
    vanilla = registry.EPLB_POLICIES["default"]
    monkeypatch.delenv("EPLB_VLLM_POLICY", raising=False)
    assert vllm.plugin() is None and registry.EPLB_POLICIES["default"] is vanilla  # opt-in
    monkeypatch.setenv("EPLB_VLLM_POLICY", "auto")
    vllm.plugin()
    assert issubclass(registry.EPLB_POLICIES["default"], vllm.EplbPolicy)
    mine = vllm.make_policy(policy="deepseek")
    assert issubclass(vllm.register("deepseek", mine), mine)
    assert registry.EPLB_POLICIES["deepseek"].rebalance_experts(
        np.array(README_WEIGHT), 16, 4, 2, 8).tolist() == README_PHY2LOG


def test_register_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ImportError, match="needs vLLM"):
        vllm.register()


# --- vLLM: sticky under drift, and the comparison with vLLM's default policy -------------------

def test_sticky_moves_few_slots_under_drift():
    # 8 layers x 64 experts -> 72 slots on 8 ranks. Each window's load is the last one's times
    # lognormal(0, 0.2); on average 12% of the slots move, a single rebalance of so few layers
    # up to 18% (seeds 10-19), against about 99% for a fresh balanced placement.
    loads = vllm_compare.drifting_loads(tie_free_load(11, 8, 64), 7, 0.2, seed=11)
    old = vllm.EplbPolicy.rebalance_experts(loads[0], 72, 8, 2, 8)
    moved = []
    for t, w in enumerate(loads[1:], 1):
        new = vllm.EplbPolicy.rebalance_experts(w, 72, 8, 2, 8, old)
        check_phy2log(new, 8, 64, 72)
        fresh = eplb.rebalance_experts(w, 72, 8, 2, 8, policy="balanced")[0]
        moved.append(np.mean(new != old))
        ours, best = (eplb.balancedness(w, p, 8).mean for p in (new, fresh))
        assert moved[-1] <= 0.2, f"rebalance {t}: {moved[-1]:.3f} of the slots moved"
        assert ours >= best - 0.011, f"rebalance {t}: {ours:.4f} against balanced {best:.4f}"
        assert np.mean(fresh != old) > 0.9
        old = new
    assert np.mean(moved) <= 0.15, moved


def print_comparison(title, result):
    print(f"\n{title}")
    for name, r in result.items():
        print(f"  {name:22s} moved {100 * np.mean(r['moved']):5.1f}% of the slots per "
              f"rebalance, balancedness {np.mean(r['balancedness']):.4f} (next window "
              f"{np.mean(r['next']):.4f})")


def assert_eplb_better(result):
    ours, theirs = result["eplb EplbPolicy"], result["vLLM default"]
    assert np.mean(ours["moved"]) < np.mean(theirs["moved"])
    assert max(ours["moved"]) < min(theirs["moved"])
    for b_ours, b_theirs in zip(ours["balancedness"], theirs["balancedness"]):
        assert b_ours >= b_theirs - 0.011
    assert np.mean(ours["next"]) >= np.mean(theirs["next"]) - 0.011


def test_vllm_default_restated_matches_the_reference_on_the_readme():
    phy2log = vllm_compare.vllm_default(np.array(README_WEIGHT), 16, 4, 2, 8, None)
    assert phy2log.tolist() == README_PHY2LOG
    old = np.roll(np.array(README_PHY2LOG), 1, axis=1)
    assert np.array_equal(vllm_compare.vllm_default(np.array(README_WEIGHT), 16, 4, 2, 8, old),
                          preserve_by_hand(README_PHY2LOG, 8, old))


def test_against_vllm_default_scaled_down_deepseek_shape():
    # DeepSeek-V3's proportions scaled down: 64 experts -> 72 slots on 8 ranks, 2 nodes, 8 groups.
    result = vllm_compare.compare(tie_free_load(12, 12, 64), 72, 8, 2, 8, rebalances=6,
                                  sigma=0.2, seed=12)
    print_comparison("12 layers x 64 experts -> 72 slots, 8 ranks, 2 nodes, 8 groups", result)
    assert_eplb_better(result)


def test_against_vllm_default_on_sglang_statistics():
    load = vllm_compare.read_load(SGLANG_STATS)
    assert load.shape == (58, 256)
    result = vllm_compare.compare(load, 288, 8, 4, 32, rebalances=4, sigma=0.2, seed=0)
    print_comparison("DeepSeek-V3 prefill_in1024 (58 x 256 -> 288, 32 ranks, 4 nodes, 8 groups)",
                     result)
    assert_eplb_better(result)
    assert max(result["eplb EplbPolicy"]["moved"]) <= 0.15


# --- SGLang --------------------------------------------------------------------------------

def check_triple(out, layers, experts, physical):
    phy2log, log2phy, count = (np.asarray(a) for a in out)
    assert phy2log.shape == (layers, physical) and count.shape == (layers, experts)
    assert log2phy.shape == (layers, experts, int(count.max()))
    for l in range(layers):
        assert np.array_equal(np.bincount(phy2log[l], minlength=experts), count[l])
        for e in range(experts):
            slots = log2phy[l, e, :count[l, e]]
            assert np.all(phy2log[l, slots] == e) and np.all(log2phy[l, e, count[l, e]:] == -1)


def test_sglang_shapes_and_types():
    w = tie_free_load(13, 3, 64)
    out = sglang.rebalance_experts(w, 80, 10, 8, 2)
    assert all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in out)
    check_triple(out, 3, 64, 80)
    assert np.array_equal(out[0], eplb.rebalance_experts(w, 80, 8, 2, 8, policy="balanced")[0])
    # Replicas in slot order for eplb's policies.
    log2phy, count = out[1], out[2]
    for l in range(3):
        for e in range(64):
            assert list(log2phy[l, e, :count[l, e]]) == sorted(log2phy[l, e, :count[l, e]])
    torch = pytest.importorskip("torch")
    t = sglang.rebalance_experts(torch.from_numpy(w).to(torch.int32), 80, 10, 8, 2)
    assert all(isinstance(a, torch.Tensor) and a.dtype == torch.int64 for a in t)
    assert all(a.device.type == "cpu" for a in t)


def test_sglang_cuda_outputs():
    torch = cuda_or_skip()
    w = torch.tensor(README_WEIGHT, device="cuda", dtype=torch.int32)[None]
    out = sglang.rebalance_experts(w, 16, 2, 4, 2, "deepseek_hierarchical")
    # On the CPU, as SGLang's own algorithms return them (init_by_eplb moves them).
    assert all(a.device.type == "cpu" for a in out) and out[0].tolist() == README_PHY2LOG
    meta = sglang.expert_location_metadata(out[0].to(w.device), 12, 8)
    assert meta["physical_to_logical_map"].device == w.device
    assert meta["physical_to_logical_map_cpu"].device.type == "cpu"


def test_sglang_steps_are_summed():
    rng = np.random.default_rng(14)
    steps = rng.integers(0, 100, (5, 3, 32)).astype(np.float64)
    for policy in ("balanced", "deepseek", "deepseek_hierarchical"):
        a = sglang.rebalance_experts(steps, 48, 6, 4, 2, policy)
        b = sglang.rebalance_experts(steps.sum(axis=0), 48, 6, 4, 2, policy)
        for x, y in zip(a, b):
            assert np.array_equal(x, y)


def test_sglang_deepseek_names_are_the_reference():
    # deepseek_hierarchical: the README example; deepseek: the reference's global policy.
    out = sglang.rebalance_experts(np.array(README_WEIGHT), 16, 2, 4, 2, "deepseek_hierarchical")
    assert out[0].tolist() == README_PHY2LOG and out[2].tolist() == README_LOGCNT
    w = tie_free_load(15, 4, 64)
    ref = numpy_reference.rebalance_experts(w, 80, 1, 1, 8)
    out = sglang.rebalance_experts(w, 80, 10, 8, 2, "deepseek")
    assert np.array_equal(out[0], ref[0]) and np.array_equal(out[2], ref[2])
    assert np.array_equal(np.sort(out[1], axis=-1), np.sort(ref[1], axis=-1))
    ref = numpy_reference.rebalance_experts(w, 80, 8, 2, 8)
    out = sglang.rebalance_experts(w, 80, 10, 8, 2, "deepseek_hierarchical")
    assert np.array_equal(out[0], ref[0])


def test_sglang_policies_and_names():
    w = tie_free_load(16, 3, 64)
    balanced = sglang.rebalance_experts(w, 80, 10, 8, 2)
    assert np.array_equal(sglang.rebalance_experts(w, 80, 10, 8, 2, "auto")[0], balanced[0])
    previous = np.tile(np.arange(80) % 64, (3, 1))
    sticky = sglang.rebalance_experts(w, 80, 10, 8, 2, "sticky", previous=previous)
    auto = sglang.rebalance_experts(w, 80, 10, 8, 2, "auto", previous=previous)
    assert np.array_equal(sticky[0], auto[0])
    assert np.mean(sticky[0] != previous) < np.mean(balanced[0] != previous)
    # num_groups None: no groups.
    check_triple(sglang.rebalance_experts(w, 80, 10, None, 1, "deepseek_hierarchical"),
                 3, 64, 80)
    with pytest.raises(ValueError, match="num_groups 1 to be a multiple of num_nodes 2"):
        sglang.rebalance_experts(w, 80, 10, None, 2, "deepseek_hierarchical")

    class Algorithm:  # an EplbAlgorithm member, by its name
        name = "deepseek"
    assert np.array_equal(sglang.rebalance_experts(w, 80, 10, 8, 2, Algorithm)[0],
                          sglang.rebalance_experts(w, 80, 10, 8, 2, "deepseek")[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_local_physical_experts=7), "80 is not a multiple of num_local_physical_experts 7"),
    (dict(policy="sticky"), "sticky needs previous"),
    (dict(policy="deepseek_vec"), "'deepseek_vec' is not one of"),
    (dict(num_groups=3, policy="deepseek_hierarchical"), "num_groups 3 to be a multiple"),
    (dict(num_physical_experts=60, num_local_physical_experts=6), "below experts 64"),
])
def test_sglang_errors(kwargs, message):
    args = dict(tokens_per_expert=tie_free_load(17, 2, 64), num_physical_experts=80,
                num_local_physical_experts=10, num_groups=8, num_nodes=2)
    args.update(kwargs)
    with pytest.raises(eplb.InvalidArgument, match=message):
        sglang.rebalance_experts(**args)
    with pytest.raises(eplb.InvalidArgument, match=r"\[steps, layers, experts\]"):
        sglang.rebalance_experts(np.ones(64), 80, 10, 8, 2)


def test_adapters_refuse_counts_a_double_would_round():
    torch = torch_or_skip()
    counts = torch.ones((1, 2, 64), dtype=torch.int64)
    counts[0, 1, 5] = 2**53 + 1
    with pytest.raises(eplb.InvalidArgument,
                       match=r"tokens_per_expert\[0, 1, 5\] is 9007199254740993, above 2\^53"):
        sglang.rebalance_experts(counts, 80, 10, 8, 2)
    with pytest.raises(eplb.InvalidArgument, match=r"weight\[1, 5\] is 9007199254740993"):
        vllm.EplbPolicy.rebalance_experts(counts[0], 80, 8, 2, 8)


def metadata_by_hand(phy2log, experts):
    """SGLang's _compute_logical_to_all_physical_map, then padded to P as its _init_raw does."""
    layers, physical = len(phy2log), len(phy2log[0])
    maps = []
    for row in phy2log:
        lists = [[] for _ in range(experts)]
        for p, e in enumerate(row):
            lists[e].append(p)
        maps.append(lists)
    out = np.full((layers, experts, physical), -1, dtype=np.int64)
    for l in range(layers):
        for e in range(experts):
            out[l, e, :len(maps[l][e])] = maps[l][e]
    return out, (out != -1).sum(axis=-1)


def test_sglang_expert_location_metadata():
    phy2log = sglang.rebalance_experts(tie_free_load(18, 3, 64), 80, 10, 8, 2)[0]
    meta = sglang.expert_location_metadata(phy2log, 64, 8)
    # ExpertLocationMetadata's fields, in its declaration order.
    assert list(meta) == ["physical_to_logical_map", "physical_to_logical_map_cpu",
                          "logical_to_all_physical_map", "logical_to_all_physical_map_cpu",
                          "logical_to_all_physical_map_num_valid", "ep_size",
                          "logical_to_rank_dispatch_physical_map"]
    l2a, valid = metadata_by_hand(phy2log.tolist(), 64)
    assert np.array_equal(meta["physical_to_logical_map"], phy2log)
    assert np.array_equal(meta["logical_to_all_physical_map"], l2a)
    assert meta["logical_to_all_physical_map"].shape == (3, 64, 80)
    assert np.array_equal(meta["logical_to_all_physical_map_num_valid"], valid)
    assert meta["ep_size"] == 8 and meta["logical_to_rank_dispatch_physical_map"].shape == (3, 64)
    arrays = [v for v in meta.values() if not isinstance(v, int)]
    assert all(v.dtype == np.int64 for v in arrays)
    torch = pytest.importorskip("torch")
    t = sglang.expert_location_metadata(torch.from_numpy(phy2log), 64, 8)
    tensors = [v for v in t.values() if not isinstance(v, int)]
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.int64 for v in tensors)
    with pytest.raises(ValueError, match="multiple of ep_size 3"):
        sglang.expert_location_metadata(phy2log, 64, 3)
    with pytest.raises(ValueError, match="expert 63 has no slot"):
        sglang.expert_location_metadata(np.zeros((1, 80), dtype=np.int64) + (np.arange(80) % 63),
                                        64, 8)


@pytest.mark.parametrize("backend", [None, "none", "deepep"])
def test_sglang_metadata_per_rank_with_an_all_to_all_backend(backend):
    """SGLang's init_by_mapping(moe_ep_rank=r) with an all-to-all backend narrows each expert's
    replicas to the one nearest rank r (on it, else on its node when that narrows the choice);
    without one every rank keeps them all. 4 ranks of 2 slots on 2 nodes."""
    phy2log = np.array([[0, 1, 0, 2, 3, 1, 3, 0]])  # e0: 0 2 7, e1: 1 5, e2: 3, e3: 4 6
    narrowing = backend not in (None, "none")
    want = {  # rank -> each expert's replicas
        0: [[0], [1], [3], [4, 6]] if narrowing else None,  # e3: none near rank 0
        1: [[2], [1], [3], [4, 6]] if narrowing else None,
        2: [[7], [5], [3], [4]] if narrowing else None,
        3: [[7], [5], [3], [6]] if narrowing else None,
    }
    everyone = [[0, 2, 7], [1, 5], [3], [4, 6]]
    for rank in range(4):
        meta = sglang.expert_location_metadata(phy2log, 4, 4, ep_rank=rank, num_nodes=2,
                                               a2a_backend=backend)
        lists = [[int(s) for s in row if s != -1]
                 for row in meta["logical_to_all_physical_map"][0]]
        assert lists == (want[rank] or everyone), (rank, lists)
        assert meta["logical_to_all_physical_map_num_valid"][0].tolist() == \
            [len(x) for x in lists]
        for e, slot in enumerate(meta["logical_to_rank_dispatch_physical_map"][0].tolist()):
            assert slot in lists[e], (rank, e, slot)  # a replica of its own list
    # An algorithm's log2phy (init_by_eplb) is never narrowed.
    log2phy = np.array([[[0, 2, 7], [1, 5, -1], [3, -1, -1], [4, 6, -1]]])
    meta = sglang.expert_location_metadata(phy2log, 4, 4, ep_rank=1, num_nodes=2,
                                           logical_to_physical_map=log2phy, a2a_backend=backend)
    assert meta["logical_to_all_physical_map_num_valid"][0].tolist() == [3, 2, 1, 2]


def test_sglang_files_round_trip(tmp_path):
    phy2log = sglang.rebalance_experts(tie_free_load(19, 3, 64), 80, 10, 8, 2)[0]
    path = tmp_path / "location.json"
    sglang.write_init_expert_location(path, phy2log)
    doc = json.loads(path.read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes the keys as **kwargs
    assert doc["physical_to_logical_map"] == phy2log.tolist()
    with pytest.raises(ValueError, match=".json or .pt"):
        sglang.write_init_expert_location(tmp_path / "location.txt", phy2log)

    counts = np.random.default_rng(19).integers(0, 9, (4, 3, 64))
    sglang.write_expert_distribution(tmp_path / "steps.json", counts)
    got = sglang.read_expert_distribution(tmp_path / "steps.json")
    assert got.dtype == np.float64 and np.array_equal(got, counts)
    sglang.write_expert_distribution(tmp_path / "one.json", counts[0])
    assert np.array(json.loads((tmp_path / "one.json").read_text())["logical_count"]).ndim == 2
    assert sglang.read_expert_distribution(tmp_path / "one.json").shape == (1, 3, 64)
    (tmp_path / "other.json").write_text('{"load": [[1, 2]]}')
    with pytest.raises(ValueError, match="no key \"logical_count\""):
        sglang.read_expert_distribution(tmp_path / "other.json")

    cli = eplb_cli()
    if cli is not None:  # eplb reads the placement back (--previous) and the statistics
        out = subprocess.run([cli, "plan", "--load", str(tmp_path / "steps.json"), "--ranks",
                              "8", "--nodes", "2", "--groups", "8", "--physical", "80",
                              "--previous", str(path), "--json"],
                             check=True, capture_output=True, text=True).stdout
        assert json.loads(out)["layers"] == 3

    torch = pytest.importorskip("torch")
    sglang.write_init_expert_location(tmp_path / "location.pt", torch.from_numpy(phy2log))
    data = torch.load(tmp_path / "location.pt", weights_only=True)
    assert list(data) == ["physical_to_logical_map"]
    assert torch.equal(data["physical_to_logical_map"], torch.from_numpy(phy2log))
    # The recorder's stat dump: torch.save of rank, logical_count [steps, L, E] int32, rate.
    dump = {"rank": 0, "logical_count": torch.from_numpy(counts).to(torch.int32),
            "average_utilization_rate_over_window": None}
    torch.save(dump, tmp_path / "expert_distribution_recorder_1.pt")
    got = sglang.read_expert_distribution(tmp_path / "expert_distribution_recorder_1.pt")
    assert got.dtype == np.float64 and got.shape == (4, 3, 64) and np.array_equal(got, counts)
    torch.save({"records": [], "last_physical_to_logical_map": torch.from_numpy(phy2log)},
               tmp_path / "per_pass.pt")
    with pytest.raises(ValueError, match="mode stat"):
        sglang.read_expert_distribution(tmp_path / "per_pass.pt")


def test_sglang_real_statistics():
    counts = sglang.read_expert_distribution(SGLANG_STATS)
    assert counts.shape == (1, 61, 256)
    dense = counts[0].sum(axis=1) == 0
    assert dense.tolist() == [True] * 3 + [False] * 58
    phy2log, log2phy, count = sglang.rebalance_experts(counts, 288, 9, 8, 4)
    check_triple((phy2log, log2phy, count), 61, 256, 288)
    assert count.min() >= 1
    trivial = np.arange(288) % 256
    assert all(np.array_equal(phy2log[l], trivial) for l in range(3))
    ours = eplb.balancedness(counts[0], phy2log, 32)
    reference = eplb.balancedness(counts[0],
                                  sglang.rebalance_experts(counts, 288, 9, 8, 4,
                                                           "deepseek_hierarchical")[0], 32)
    assert ours.mean > reference.mean
    assert abs(reference.mean - 0.869) < 0.0015  # the data's README figure, MoE layers only
    meta = sglang.expert_location_metadata(phy2log, 256, 32)
    assert meta["logical_to_all_physical_map"].shape == (61, 256, 288)
    assert np.array_equal(meta["logical_to_all_physical_map_num_valid"], count)
