"""eplb on a PyTorch engine's terms: its torch.distributed group as eplb's control plane, its map
tensors written in place, its per-pass counters read once per step (bad input refused at the
call), and examples/torch_engine.py, the engine built the way vLLM's is, in short runs: every
output equal to the single-process reference, and a killed rank ending every survivor."""

import datetime
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import eplb
from eplb.integrations import sglang

torch = pytest.importorskip("torch")
dist = torch.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "torch_engine.py")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo world and a group dedicated to eplb, as an engine makes them."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def make(group, **config):
    """One rank: 2 layers, 4 experts in 6 slots (deepseek: two replicas may share the rank), its
    weights the engine's tensors."""
    base = {"experts": 4, "physical": 6, "interval": 3, "window": 3, "mode": "sync",
            "policy": "deepseek", "min_gain": 0.0}
    base.update(config)
    weights = [torch.zeros(6, 4) for _ in range(2)]
    rb = eplb.Rebalancer(base, group=group, transport="inproc", weights={"w": weights})
    rb.connect()
    return rb


def test_group_is_the_control_plane(group):
    rb = make(group)
    assert rb.rank == 0 and rb.world_size == 1
    log2phy = torch.full((2, 4, 3), -7, dtype=torch.int64)
    logcnt = torch.zeros((2, 4), dtype=torch.int32)
    phy2log = np.full((2, 6), -7, dtype=np.int64)
    rb.bind_maps(logical_to_physical_map=log2phy, logical_replica_count=logcnt,
                 physical_to_logical_map=phy2log)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 1]] * 2  # written at bind time, in place
    assert logcnt.tolist() == [[2, 2, 1, 1]] * 2
    assert log2phy[0].tolist() == [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]]
    counts = torch.zeros((2, 4), dtype=torch.int32)  # per expert, as SGLang counts
    for step in range(7):
        counts.zero_()
        counts[:, 3] = 50  # expert 3 takes every token: it gets both redundant slots
        rb.record_pass(counts)
        rb.step_end()
    history = rb.history()
    assert history and history[0]["outcome"] == "completed", history
    assert int(logcnt[0, 3]) == 3 and phy2log.tolist()[0].count(3) == 3
    assert sorted(log2phy[0, 3].tolist()) == sorted(np.flatnonzero(phy2log[0] == 3).tolist())
    assert torch.equal(torch.from_numpy(phy2log), torch.stack([torch.from_numpy(
        rb.phy2log(l).astype(np.int64)) for l in range(2)]))
    rb.shutdown()


def test_group_of_another_size_or_rank_is_refused(group):
    weights = {"w": [torch.zeros(6, 4) for _ in range(2)]}
    config = {"experts": 4, "physical": 6, "policy": "deepseek"}
    with pytest.raises(eplb.InvalidArgument, match="the group has 1 ranks but world_size is 2"):
        eplb.Rebalancer(config, 0, 2, group=group, weights=weights)
    with pytest.raises(eplb.InvalidArgument, match="world_size|rank"):
        eplb.Rebalancer(config, 1, 1, group=group, weights=weights)
    with pytest.raises(eplb.InvalidArgument, match="leave rendezvous out"):
        eplb.Rebalancer(config, group=group, rendezvous="/tmp/x", weights=weights)
    with pytest.raises(eplb.InvalidArgument, match="rank and world_size are needed"):
        eplb.Rebalancer(config, weights=weights)


@pytest.mark.parametrize("maps, message", [
    (dict(physical_to_logical_map=torch.zeros((2, 5), dtype=torch.int64)),
     r"int64 \[2, 5\], expected \[2, 6\]"),
    (dict(logical_to_physical_map=torch.zeros((2, 4, 2), dtype=torch.int64)),
     "R must be at least 3"),
    (dict(logical_replica_count=torch.zeros((2, 4))), "dtype torch.float32"),
    (dict(logical_replica_count=torch.zeros((2, 4), dtype=torch.int64, device="meta")),
     "is on meta"),
    (dict(logical_replica_counts=torch.zeros((2, 4), dtype=torch.int64)), "unknown map"),
    (dict(logical_replica_count=[[1, 2, 3, 4]] * 2), "torch tensor or a numpy array"),
])
def test_bad_maps_bind_nothing(group, maps, message):
    rb = make(group)
    bound = np.full((2, 6), -7, dtype=np.int64)
    rb.bind_maps(physical_to_logical_map=bound)
    bound[:] = -7
    with pytest.raises(eplb.InvalidArgument, match=message):
        rb.bind_maps(**maps)
    rb.step_end()  # the binding before still stands: nothing installs, nothing is written
    assert (bound == -7).all()
    rb.shutdown()


def test_record_pass_bad_input_counts_nothing(group, tmp_path):
    rb = make(group, interval=100)
    with pytest.raises(eplb.InvalidArgument, match=r"shape \[2, 5\]"):
        rb.record_pass(torch.zeros((2, 5), dtype=torch.int32))
    with pytest.raises(eplb.InvalidArgument, match="is on meta"):
        rb.record_pass(torch.zeros((2, 6), dtype=torch.int32, device="meta"))
    with pytest.raises(eplb.InvalidArgument, match=r"counts\[1\]\[2\] is -1"):
        rb.record_pass(torch.tensor([[0] * 6, [0, 0, -1, 0, 0, 0]], dtype=torch.int32))
    rb.record_pass(torch.ones((2, 6), dtype=torch.int64))
    with pytest.raises(eplb.InvalidArgument, match="already called at step 0"):
        rb.record_pass(torch.ones((2, 4), dtype=torch.int64))
    rb.step_end()
    rb.record_pass(torch.ones((2, 4), dtype=torch.int32)[:, :4])  # per expert, a view
    rb.step_end()
    path = str(tmp_path / "window.json")
    rb.save_stats(path, "sglang")
    window = sglang.read_expert_distribution(path)
    assert window.sum() == 2 * 6 + 2 * 4  # nothing of the refused calls
    rb.shutdown()


def run_example(*args, timeout=240):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_engine_example_serves_and_rebalances():
    out = run_example("--ranks", "2", "--steps", "24", "--interval", "8", "--window", "8",
                      "--layers", "3", "--tokens-per-rank", "24", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)  # --json: the whole of standard output is one document
    assert (d["control"], d["weights"], d["maps"]) == ("torch", "engine", "engine")
    assert d["rebalances"] >= 1 and d["mismatches"] == 0 and d["outputs_checked"] > 0
    assert "eplb runtime rank 0: connected" in out.stderr  # the logs go to standard error


def test_engine_example_engines_own_policy():
    """--propose: a vLLM policy class over the engine's own load window decides, eplb moves
    and installs (Rebalancer.propose through eplb.integrations.vllm.propose)."""
    out = run_example("--ranks", "2", "--steps", "30", "--interval", "8", "--window", "8",
                      "--layers", "2", "--tokens-per-rank", "16", "--propose", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["policy"] == "engine" and d["mismatches"] == 0
    # Every rebalance installed the engine's placement (how many ended by step 30 is a matter
    # of time; the first was proposed at step 8 whatever the time).
    assert d["proposals"] >= 1 and d["proposed"] == d["rebalances"], d


def test_engine_example_elastic_keeps_serving_on_the_engines_group():
    """--elastic (the short version of the acceptance run): rank 1 is killed at step 8; the
    survivors build new groups of their own, eplb reconfigures onto theirs, repairs from its
    backup copies, and every step is served with every output checked; a new process takes
    the seat back at step 18."""
    out = run_example("--ranks", "3", "--steps", "30", "--interval", "8", "--window", "8",
                      "--layers", "2", "--experts", "16", "--top-k", "4",
                      "--tokens-per-rank", "16", "--kill-rank", "1", "--at-step", "8",
                      "--elastic", "--rejoin-at-step", "18", "--json", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    e = d["elastic"]
    assert d["steps"] == 30 and d["mismatches"] == 0 and d["outputs_checked"] > 0, d
    assert len(e["lost"]) == 1 and e["lost"][0].startswith("rank 1 ") and e["rejoins"] == 1
    assert e["reconfigures"] == 2, e  # how far each repair got by the end is a matter of time


def test_engine_example_refuses_bad_elastic_arguments():
    for args, words in [(["--elastic"], "--elastic needs --kill-rank"),
                        (["--kill-rank", "1", "--at-step", "4", "--rejoin-at-step", "9"],
                         "--rejoin-at-step needs --elastic"),
                        (["--kill-rank", "1", "--at-step", "4", "--elastic", "--redundant", "0"],
                         "cannot hold 64 experts"),
                        (["--propose", "--mode", "off"], "--propose needs eplb")]:
        out = run_example(*args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr[-500:])
        assert out.stdout == ""


def test_engine_example_killed_rank_ends_every_survivor():
    out = run_example("--ranks", "3", "--steps", "400", "--interval", "8", "--window", "8",
                      "--layers", "2", "--experts", "32", "--redundant", "4",
                      "--tokens-per-rank", "16", "--kill-rank", "1",
                      "--at-step", "10", "--timeout-ms", "5000")
    assert out.returncode != 0
    # Both survivors (ranks 0 and 2) name rank 1, and nothing else.
    assert out.stderr.count("rank 1 is gone") == 2, out.stderr[-2000:]
    assert out.stderr.count("is gone") == 2 and out.stderr.count("are gone") == 0
    assert "rank 1 died" in out.stderr
