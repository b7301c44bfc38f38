"""eplb.Rebalancer: the runtime binding.

Single-rank checks of the API, multi-rank runs with ranks as threads of this process (inproc
control and transport: the GIL is released while a rank waits) and as forked processes (shm),
and the PyTorch example run small. Every run checks the runtime's invariants at every step:
each local slot holds the weights of its expert, and every rank sees the same placement and
tables. Nothing here depends on timing: a run that needs a completed rebalance steps until the
history shows one (every rank ends a rebalance at the same step, so all stop together).
"""

import multiprocessing
import json
import os
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

import eplb
import eplb.cost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPERTS = 8
PHYSICAL = 12
LAYERS = 3
WEIGHTS = [("w13", ((2, 3), "float32")), ("w2", 10)]


def expert_value(layer, tensor, expert):
    """What slot weights hold for (layer, tensor, expert): every element distinct per triple."""
    if tensor == "w13":
        return np.full((2, 3), 1000 * layer + 10 * expert + 1, dtype=np.float32) + \
            np.arange(6, dtype=np.float32).reshape(2, 3) / 8
    return np.full(10, (7 * layer + 3 * expert + 5) % 251, dtype=np.uint8)


def check_weights(rb):
    for layer in range(rb.layers):
        experts = rb.local_experts(layer)
        for name in rb.tensors:
            view = rb.weights(layer, name)
            for j, e in enumerate(experts):
                np.testing.assert_array_equal(view[j], expert_value(layer, name, int(e)),
                                              err_msg=f"layer {layer} {name} slot {j}")


def skewed_counts(rank, step, layer):
    """A load whose hot experts all sit on rank 0 under the trivial placement."""
    counts = np.full(EXPERTS, 1, dtype=np.int64)
    counts[[0, 1, 2]] = 50 + layer + rank
    return counts


P_SKEW = skewed_counts(0, 0, 0) / skewed_counts(0, 0, 0).sum()


def unique(prefix):
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def config(**extra):
    c = {"experts": EXPERTS, "physical": PHYSICAL, "interval": 4, "window": 4, "lag": 1,
         "timeout_ms": 20000}
    c.update(extra)
    return c


def one_config(**extra):
    """A config for one rank: its 12 slots hold some of the 8 experts twice, which deepseek's
    packing does and balanced and sticky never do."""
    return config(**{"policy": "deepseek", **extra})


# ------------------------------------------------------------------------------ one rank
def make_single(**kw):
    args = dict(control="inproc", transport="inproc", weights=WEIGHTS, layers=LAYERS)
    args.update(kw)
    return eplb.Rebalancer(one_config(), 0, 1, **args)


def test_single_rank_api(tmp_path):
    with make_single() as rb:
        assert rb.rank == 0 and rb.world_size == 1 and rb.layers == LAYERS
        assert rb.slots_per_rank == PHYSICAL
        assert rb.tensors == ["w13", "w2"]
        assert rb.config["policy"] == "deepseek" and rb.config["ranks"] == 1
        assert rb.config["thorough"] is False
        held = rb.connect()
        assert held == (LAYERS + 1) * PHYSICAL * (24 + 10)
        assert rb.bytes_held == held
        # The arena, the load window, the placement and the tables: more than the arena alone.
        assert rb.host_bytes() > held

        w = rb.weights(0, "w13")
        assert w.dtype == np.float32 and w.shape == (PHYSICAL, 2, 3)
        assert rb.weights(0, 1).shape == (PHYSICAL, 10) and rb.weights(0, 1).dtype == np.uint8
        assert rb.weights(0, "w13", dtype=np.uint8).shape == (PHYSICAL, 24)
        assert rb.weights(0, "w13", dtype="float32", shape=6).shape == (PHYSICAL, 6)
        assert not w.flags.owndata and w.flags.writeable
        # A view of the arena: writes through one view show in another.
        w[1, 0, 0] = 42.5
        assert rb.weights(0, "w13")[1, 0, 0] == 42.5

        np.testing.assert_array_equal(rb.phy2log(0), np.arange(PHYSICAL) % EXPERTS)
        np.testing.assert_array_equal(rb.local_experts(2), np.arange(PHYSICAL) % EXPERTS)
        assert rb.placement().shape == (LAYERS, PHYSICAL)
        rb.fill_weights(expert_value)
        check_weights(rb)

        d = rb.dispatch(0)
        assert set(d) == {"log2phy", "replica_count", "static_slot", "cumulative_share"}
        assert d["log2phy"].shape[0] == EXPERTS and d["static_slot"].shape == (1, EXPERTS)
        np.testing.assert_array_equal(d["replica_count"], [2, 2, 2, 2, 1, 1, 1, 1])

        ids = np.array([[0, 5], [3, 7], [0, 0]], dtype=np.int32)
        rb.record(0, ids)
        rb.record(1, ids.astype(np.int64))
        rb.record(2, ids.astype(np.uint8).T)  # any integer dtype and layout
        rb.record_counts(0, np.ones(EXPERTS, dtype=np.int32))
        slots = rb.route(0, ids, first_token=0)
        assert slots.shape == ids.shape and slots.dtype == np.int32
        phy2log = rb.phy2log(0)
        np.testing.assert_array_equal(phy2log[slots], ids)

        for _ in range(3):
            rb.step_end()
        assert rb.step == 3
        stats = rb.stats()
        assert stats["step"] == 3 and stats["history"] == [] and not stats["rebalancing"]
        rb.save_stats(tmp_path / "load.json")
        rb.save_stats(str(tmp_path / "sglang.json"), "sglang")
        assert (tmp_path / "load.json").stat().st_size > 0
        assert "logical_count" in (tmp_path / "sglang.json").read_text()
    rb.shutdown()  # idempotent
    # Views outlive shutdown (they keep the arena alive).
    assert w.shape == (PHYSICAL, 2, 3)


def test_impossible_layout_is_refused_at_construction():
    # One rank of 12 slots cannot hold 8 experts without two replicas of one on the rank, which
    # balanced and sticky never place: refused when the Rebalancer is made, not at its first
    # rebalance. deepseek's packing allows it.
    for policy in ("sticky", "balanced"):
        with pytest.raises(eplb.InvalidArgument, match="two replicas of one expert"):
            eplb.Rebalancer(config(policy=policy), 0, 1, control="inproc", transport="inproc",
                            weights=WEIGHTS, layers=LAYERS)
    eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc",
                    weights=WEIGHTS, layers=LAYERS).shutdown()


def test_failed_rebalance_raises():
    # Two ranks; rank 1 stops calling step_end before the first rebalance ends: rank 0's
    # agreement times out, the rebalance is abandoned, and on_error="raise" raises it from
    # step_end; serving goes on with every layer as it was.
    c = config(mode="sync", interval=3, window=3, on_error="raise", timeout_ms=300)
    rendezvous = unique("rt-raise")
    raised, done = [], threading.Event()

    def rank_body(rank):
        with eplb.Rebalancer(c, rank, 2, control="inproc", transport="inproc",
                             rendezvous=rendezvous, weights=WEIGHTS, layers=LAYERS) as rb:
            rb.connect()
            rb.fill_weights(expert_value)
            for step in range(1, 5):
                if rank == 1 and step == 3:
                    done.wait(10)  # gone quiet: never contributes to the rebalance
                    return
                for layer in range(LAYERS):
                    rb.record_counts(layer, skewed_counts(rank, step, layer))
                try:
                    rb.step_end()
                except eplb.Error as e:
                    raised.append((step, e, rb.history()))
                    check_weights(rb)
                    rb.step_end()  # serving goes on
                    done.set()
                    return
            done.set()

    threads = [threading.Thread(target=rank_body, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(raised) == 1, raised
    step, error, history = raised[0]
    assert step == 3
    assert isinstance(error, (eplb.Timeout, eplb.IoError)), repr(error)
    assert [h["outcome"] for h in history] == ["failed"]


def test_initial_placement_forms(tmp_path):
    phy2log = np.tile(np.array([7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3]), (LAYERS, 1))
    with make_single(initial=phy2log, layers=None) as rb:
        np.testing.assert_array_equal(rb.placement(), phy2log)
        assert rb.layers == LAYERS
    path = tmp_path / "placement.json"
    path.write_text('{"physical_to_logical_map": %s}' % phy2log.tolist())
    with make_single(initial=path) as rb:
        np.testing.assert_array_equal(rb.placement(), phy2log)
    with make_single(initial="trivial") as rb:
        np.testing.assert_array_equal(rb.phy2log(1), np.arange(PHYSICAL) % EXPERTS)


@pytest.mark.parametrize("changes, message", [
    ({"physical": 13, "ranks": 2}, "differs from world_size"),
    ({"unknown": 1}, "unknown config key 'unknown'"),
    ({"policy": "best"}, "best"),
    ({"mode": "later"}, "choose async or sync"),
    ({"install": "move"}, "choose swap or copy"),
    ({"interval": -1}, r"interval -1 is outside \[0, "),
    ({"lag": "2"}, "must be an integer"),
    ({"thorough": 1}, r"config\['thorough'\] must be True or False"),
    ({"thorough": True}, "thorough applies to the balanced and sticky policies, not deepseek"),
    ({"physical": 6}, "physical"),
    ({"min_gain": -1.0}, "min_gain is -1"),
    ({"min_gain": float("nan")}, "min_gain is nan"),
    ({"min_gain": float("inf")}, "min_gain is inf"),
    ({"min_balancedness_gain": 2.0}, r"min_balancedness_gain 2 must be in \[-1, 1\]"),
    ({"cost": "h100"}, r"config\['cost'\] must be an eplb.cost.CostModel"),
])
def test_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        eplb.Rebalancer(one_config(**changes), 0, 1, control="inproc", transport="inproc",
                        weights=WEIGHTS, layers=LAYERS)


def test_argument_errors():
    ok = dict(control="inproc", transport="inproc", weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match="not a multiple of ranks 5"):
        eplb.Rebalancer(config(), 0, 5, rendezvous="x", **ok)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        eplb.Rebalancer(config(), 2, 1, **ok)
    with pytest.raises(ValueError, match="rendezvous is required"):
        eplb.Rebalancer(config(), 0, 2, **ok)
    with pytest.raises(ValueError, match="layers is required"):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc", weights=WEIGHTS)
    with pytest.raises(ValueError, match="expert_bytes 0"):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc",
                        weights={"w": 0}, layers=1)
    with pytest.raises(ValueError, match="must be given as expert_bytes"):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc",
                        weights={"w": "big"}, layers=1)
    with pytest.raises(ValueError, match="unknown|inproc"):
        eplb.Rebalancer(one_config(), 0, 1, control="carrier-pigeon", transport="inproc",
                        weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match="teleport|inproc"):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="teleport",
                        weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match="expert 9"):
        eplb.Rebalancer(one_config(), 0, 1, initial=np.full((LAYERS, PHYSICAL), 9), **ok)


def test_agreement_api():
    assert eplb.NO_AGREEMENT == 2 ** 63 - 1
    with make_single() as rb:
        rb.connect()
        rb.step_end()
        assert rb.config["agreement"] == "internal"
        with pytest.raises(ValueError, match="internal"):
            rb.agreement_result(1, 0)
    with pytest.raises(ValueError, match="sync"):
        eplb.Rebalancer(one_config(mode="sync", agreement="external"), 0, 1, control="inproc",
                        transport="inproc", weights=WEIGHTS, layers=LAYERS)
    with eplb.Rebalancer(one_config(agreement="external"), 0, 1, control="inproc",
                         transport="inproc", weights=WEIGHTS, layers=LAYERS) as rb:
        rb.connect()
        rb.step_end()
        assert rb.agreement_contribution() == eplb.NO_AGREEMENT  # no rebalance running
        rb.agreement_result(1, eplb.NO_AGREEMENT)
        with pytest.raises(ValueError, match="step"):
            rb.agreement_result(5, 0)


def test_call_errors():
    with make_single() as rb:
        with pytest.raises(ValueError, match="connect"):
            rb.weights(0, 0)
        rb.connect()
        with pytest.raises(ValueError, match="integer expert ids"):
            rb.record(0, np.zeros(3, dtype=np.float32))
        with pytest.raises(ValueError, match="expert id 8 at position 1"):
            rb.record(0, np.array([1, 8], dtype=np.int32))
        with pytest.raises(ValueError, match="layer 3 is outside"):
            rb.record(3, np.array([1], dtype=np.int32))
        with pytest.raises(ValueError, match="expected one per expert"):
            rb.record_counts(0, np.ones(3, dtype=np.int64))
        with pytest.raises(ValueError, match="no tensor 'w4'"):
            rb.weights(0, "w4")
        with pytest.raises(ValueError, match="needs 28"):
            rb.weights(0, "w13", shape=(7,))
        with pytest.raises(ValueError, match="2-D"):
            rb.route(0, np.array([1, 2], dtype=np.int32))
        with pytest.raises(ValueError, match="no step recorded"):
            rb.save_stats(os.devnull)


def test_torch_paths():
    torch = pytest.importorskip("torch")
    with make_single(weights={"w13": ((2, 3), torch.bfloat16), "w2": ((5,), "float32")}) as rb:
        rb.connect()
        t = rb.weights(0, "w13")
        assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
        assert t.shape == (PHYSICAL, 2, 3)
        w2 = rb.weights(0, "w2", as_torch=True)
        assert w2.dtype == torch.float32 and w2.shape == (PHYSICAL, 5)
        # Zero copy: the tensor and a numpy view share the arena.
        w2[3, 4] = 2.25
        assert rb.weights(0, "w2")[3, 4] == 2.25
        assert rb.weights(0, "w2", dtype=torch.int32).shape == (PHYSICAL, 5)
        ids = torch.tensor([[0, 1], [4, 7]])
        rb.record(0, ids)
        rb.record(1, ids.to(torch.int32))
        rb.record_counts(2, torch.ones(EXPERTS, dtype=torch.int64))
        slots = rb.route(0, ids)
        assert slots.dtype == torch.int64
        assert torch.equal(torch.from_numpy(rb.phy2log(0)).long()[slots], ids)
        tables = rb.dispatch(0, as_torch=True)
        assert isinstance(tables["log2phy"], torch.Tensor)
        rb.step_end()


def test_split_and_adaptive_dispatch():
    torch = pytest.importorskip("torch")
    ids = np.array([[0, 5], [3, 7], [0, 0], [0, 1]], dtype=np.int32)
    with eplb.Rebalancer(one_config(dispatch="split"), 0, 1, control="inproc",
                         transport="inproc", weights=WEIGHTS, layers=LAYERS) as rb:
        rb.connect()
        slots = rb.route(0, ids)
        np.testing.assert_array_equal(rb.phy2log(0)[slots], ids)
        # Expert 0's four tokens alternate over its two replicas.
        zero = slots[ids == 0]
        assert len(set(zero.tolist())) == 2
    with eplb.Rebalancer(one_config(dispatch="adaptive"), 0, 1, control="inproc",
                         transport="inproc", weights=WEIGHTS, layers=LAYERS) as rb:
        rb.connect()
        assert rb.config["dispatch"] == "adaptive"
        counts = np.bincount(ids.ravel(), minlength=EXPERTS)
        slots = rb.route(0, ids, global_counts=counts, prefix=np.zeros(EXPERTS, np.int64))
        np.testing.assert_array_equal(rb.phy2log(0)[slots], ids)
        slots_t = rb.route(0, torch.from_numpy(ids), global_counts=torch.from_numpy(counts),
                           prefix=torch.zeros(EXPERTS, dtype=torch.int64))
        assert torch.equal(slots_t, torch.from_numpy(slots).long())
        with pytest.raises(eplb.InvalidArgument, match="global_counts"):
            rb.route(0, ids)
        with pytest.raises(eplb.InvalidArgument, match="1-D array of 8 entries"):
            rb.route(0, ids, global_counts=counts[:3], prefix=np.zeros(EXPERTS, np.int64))
        with pytest.raises(eplb.InvalidArgument, match="cost= is for dispatch"):
            rb.route(0, ids, global_counts=counts, prefix=np.zeros(EXPERTS, np.int64),
                     cost=eplb.cost.cost_model_preset("h100-v3-decode"))


def test_adaptive_cost_dispatch():
    from eplb import cost
    ids = np.array([[0, 5], [3, 7], [0, 0], [0, 1]], dtype=np.int32)
    counts = np.bincount(ids.ravel(), minlength=EXPERTS)
    with eplb.Rebalancer(one_config(dispatch="adaptive_cost"), 0, 1, control="inproc",
                         transport="inproc", weights=WEIGHTS, layers=LAYERS) as rb:
        rb.connect()
        assert rb.config["dispatch"] == "adaptive_cost"
        model = cost.cost_model_preset("h100-v3-decode")
        slots = rb.route(0, ids, global_counts=counts, prefix=np.zeros(EXPERTS, np.int64),
                         cost=model)
        np.testing.assert_array_equal(rb.phy2log(0)[slots], ids)
        with pytest.raises(eplb.InvalidArgument, match="needs cost="):
            rb.route(0, ids, global_counts=counts, prefix=np.zeros(EXPERTS, np.int64))
        with pytest.raises(eplb.InvalidArgument, match="global_counts"):
            rb.route(0, ids, cost=model)


# --------------------------------------------------------------- several ranks: threads
def run_rank(rank, world, rendezvous, cfg, steps_min, steps_max, log, control, transport,
             agree=None, weights=WEIGHTS):
    """One rank's serving loop: record a skewed load, check weights and routes every step, log
    the placement and tables, and stop once a rebalance completed (at least steps_min steps).
    With `agree` (external agreement), agree(rank, value) is the engine's min-reduction."""
    with eplb.Rebalancer(cfg, rank, world, control=control, transport=transport,
                         rendezvous=rendezvous, weights=weights, layers=LAYERS) as rb:
        rb.connect()
        rb.fill_weights(expert_value)
        rng = np.random.default_rng(rank)
        for step in range(steps_max):
            for layer in range(LAYERS):
                ids = rng.choice(EXPERTS, size=(16, 2), p=P_SKEW)
                rb.record(layer, ids)
                slots = rb.route(layer, ids, first_token=16 * step)
                np.testing.assert_array_equal(rb.phy2log(layer)[slots], ids)
            check_weights(rb)
            log.append((rb.step, rb.placement().tobytes(),
                        tuple(rb.dispatch(layer)["log2phy"].tobytes() for layer in range(LAYERS))))
            rb.step_end()
            if agree is not None:
                rb.agreement_result(rb.step, agree(rank, rb.agreement_contribution()))
            done = any(h["outcome"] == "completed" for h in rb.history())
            if step + 1 >= steps_min and done:
                break
        # The state the last step_end left (it may have installed the last layer).
        log.append((rb.step, rb.placement().tobytes(),
                    tuple(rb.dispatch(layer)["log2phy"].tobytes() for layer in range(LAYERS))))
        check_weights(rb)
        return rb.history()


def min_reduction(world):
    """An engine's all-reduce (min) among rank threads, for the external agreement."""
    values = [None] * world
    barrier = threading.Barrier(world)

    def agree(rank, value):
        values[rank] = value
        barrier.wait()
        result = min(values)
        barrier.wait()  # nobody overwrites values before everyone has read them
        return result
    return agree


def run_threads(world, cfg, steps_min=12, steps_max=400, weights=None):
    """Every rank as a thread of this process; `weights`: each rank's (default WEIGHTS)."""
    rendezvous = unique("rt-threads")
    logs = [[] for _ in range(world)]
    results, errors = [None] * world, []
    agree = min_reduction(world) if cfg.get("agreement") == "external" else None

    def body(rank):
        try:
            results[rank] = run_rank(rank, world, rendezvous, cfg, steps_min, steps_max,
                                     logs[rank], "inproc", "inproc", agree,
                                     weights=WEIGHTS if weights is None else weights[rank])
        except BaseException as e:  # reported below, on the main thread
            errors.append((rank, e))

    threads = [threading.Thread(target=body, args=(g,)) for g in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return results, logs


@pytest.mark.parametrize("mode, lag, agreement", [
    ("async", 1, "internal"), ("async", 2, "internal"), ("sync", 1, "internal"),
    ("async", 1, "external"), ("async", 3, "external")])
def test_threads_rebalance(mode, lag, agreement):
    results, logs = run_threads(2, config(mode=mode, lag=lag, agreement=agreement))
    # Same placement and tables on every rank at every step.
    assert len(logs[0]) == len(logs[1])
    for a, b in zip(*logs):
        assert a == b
    histories = [[(h["trigger_step"], h["end_step"], h["outcome"], h["slots_moved"])
                  for h in r] for r in results]
    assert histories[0] == histories[1]
    completed = [h for h in results[0] if h["outcome"] == "completed"]
    assert completed and completed[0]["slots_moved"] > 0
    assert completed[0]["bytes_intra_node"] > 0
    # The placement changed during the run.
    assert logs[0][0][1] != logs[0][-1][1]


def test_threads_four_ranks():
    results, logs = run_threads(4, config(physical=16, peers_per_round=2, dispatch="hash"))
    for log in logs[1:]:
        assert log == logs[0]
    assert any(h["outcome"] == "completed" for h in results[0])


# ------------------------------------------------------------- several ranks: processes
def engine_tensors(world, torch_tensors=False, shareable=False):
    """The engine's own weights, as an engine allocates them at model load: per tensor name, one
    tensor per layer of [slots_per_rank, ...]; w2's slots 16 bytes apart (a padded stride).
    shareable: from eplb.empty(), which shm serves by mapping instead of cross-memory attach."""
    slots = PHYSICAL // world
    if shareable:
        return {"w13": [eplb.empty((slots, 2, 3), np.float32) for _ in range(LAYERS)],
                "w2": [eplb.empty((slots, 16), np.uint8)[:, :10] for _ in range(LAYERS)]}
    if torch_tensors:
        import torch
        return {"w13": [torch.zeros((slots, 2, 3), dtype=torch.float32) for _ in range(LAYERS)],
                "w2": [torch.zeros((slots, 16), dtype=torch.uint8)[:, :10]
                       for _ in range(LAYERS)]}
    return {"w13": [np.zeros((slots, 2, 3), dtype=np.float32) for _ in range(LAYERS)],
            "w2": [np.zeros((slots, 16), dtype=np.uint8)[:, :10] for _ in range(LAYERS)]}


def process_rank(rank, world, rendezvous, queue, engine=None):
    try:
        log = []
        weights = engine_tensors(world, shareable=engine == "shareable") if engine else WEIGHTS
        history = run_rank(rank, world, rendezvous, config(), 12, 400, log, "shm", "shm",
                           weights=weights)
        queue.put((rank, None, log, [(h["end_step"], h["outcome"]) for h in history]))
    except BaseException as e:
        queue.put((rank, repr(e), None, None))


@pytest.mark.skipif(sys.platform != "linux", reason="shm backends and fork are Linux-only here")
@pytest.mark.parametrize("engine", [None, "heap", "shareable"],
                         ids=["arena", "engine-weights", "engine-weights-shareable"])
def test_processes_shm(engine):
    # With the engine's own weights (numpy arrays), peers read them by cross-memory attach.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    rendezvous = unique("rt-procs")
    procs = [context.Process(target=process_rank, args=(g, 2, rendezvous, queue, engine))
             for g in range(2)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    out.sort(key=lambda r: r[0])
    assert [r[1] for r in out] == [None, None], out
    assert out[0][2] == out[1][2]
    assert out[0][3] == out[1][3] and ("completed" in [o for _, o in out[0][3]])


# ------------------------------------------------------------- the engine's own weights
def test_engine_tensors_threads_keep_their_addresses():
    torch = pytest.importorskip("torch")
    world = 2
    tensors = [engine_tensors(world, torch_tensors=True) for _ in range(world)]
    pointers = [{k: [t.data_ptr() for t in v] for k, v in ts.items()} for ts in tensors]
    results, _ = run_threads(world, config(), weights=tensors)
    assert any(h["outcome"] == "completed" for h in results[0])
    # Installs write exactly the slots whose expert changes: over both ranks, slots moved x
    # the bytes of one expert (w13 2 x 3 float32 + w2 10 bytes).
    for i, h in enumerate(results[0]):
        if h["outcome"] == "completed":
            written = sum(r[i]["bytes_installed"] for r in results)
            assert written == h["slots_moved"] * (2 * 3 * 4 + 10) > 0, (i, written, h)
    for rank in range(world):
        for name, per in tensors[rank].items():
            assert [t.data_ptr() for t in per] == pointers[rank][name]
    with eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc",
                         weights=engine_tensors(1, torch_tensors=True)) as rb:
        held = rb.connect()
        assert rb.layers == LAYERS  # from the lists
        assert rb.weights(0, "w2") is rb._engine[1][0]
        assert held == PHYSICAL * (2 * 3 * 4 + 10)  # the staging layer alone


@pytest.mark.parametrize("change, message", [
    (lambda w: w["w13"].pop(), "tensor 'w13' has 2 layers of tensors, expected 3"),
    (lambda w: w["w13"].__setitem__(1, np.zeros((5, 2, 3), np.float32)),
     r"tensor 'w13' of layer 1 has shape \(5, 2, 3\): its first dimension must be this rank's 12"),
    (lambda w: w["w13"].__setitem__(2, np.zeros((12, 3, 2), np.float32).transpose(0, 2, 1)),
     "must be contiguous"),
    (lambda w: w["w13"].__setitem__(0, np.zeros((12, 2, 3), np.float64)),
     "tensor 'w13' of layer 1 is .* every layer must be alike"),
    (lambda w: w.__setitem__("w2", 10), "give every tensor as the engine's own"),
    (lambda w: w["w2"].__setitem__(0, np.empty((12, 10), dtype=object)),
     "tensor 'w2' of layer 0 holds Python objects"),
    (lambda w: w["w13"].__setitem__(2, w["w13"][1]),
     "layer 1 tensor 'w13' and layer 2 tensor 'w13' overlap in memory"),
])
def test_engine_tensor_errors(change, message):
    weights = engine_tensors(1)
    change(weights)
    with pytest.raises(ValueError, match=message):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc", weights=weights,
                        layers=LAYERS)


def test_empty_is_zeroed_shareable_memory_of_any_dtype():
    a = eplb.empty((3, 4), np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32 and not a.any()
    a[:] = 7
    assert eplb.empty(5, "int64").shape == (5,)
    torch = pytest.importorskip("torch")
    t = eplb.empty((2, 8), torch.bfloat16)
    assert t.shape == (2, 8) and t.dtype == torch.bfloat16 and not t.any()
    t += 1
    with pytest.raises(ValueError, match="shape -1 is outside"):
        eplb.empty((2, -1))


def test_engine_tensor_read_only_and_device_errors():
    weights = engine_tensors(1)
    weights["w2"][1].flags.writeable = False
    with pytest.raises(ValueError, match="tensor 'w2' of layer 1 is a read-only array"):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc", weights=weights)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    weights = engine_tensors(1, torch_tensors=True)
    weights["w13"][0] = weights["w13"][0].cuda()
    with pytest.raises(ValueError, match="is on cuda"):
        eplb.Rebalancer(one_config(), 0, 1, control="inproc", transport="inproc", weights=weights)


# ------------------------------------------------------------------------- the example
@pytest.mark.parametrize("extra", [[], ["--own-weights"]], ids=["arena", "own-weights"])
def test_torch_moe_example(tmp_path, extra):
    pytest.importorskip("torch")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(
        eplb.__file__)), env.get("PYTHONPATH", "")] if p)
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "torch_moe.py"), "--ranks", "2",
         "--layers", "2", "--experts", "8", "--redundant", "4", "--hidden", "16", "--ffn", "32",
         "--tokens", "32", "--steps", "40", "--interval", "8", "--window", "8",
         "--agreement", "external",
         "--workdir", str(tmp_path)] + extra,
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "outputs match the reference" in run.stdout, run.stdout + run.stderr
    if extra:
        assert "weights the model's own parameters" in run.stdout, run.stdout


def test_torch_moe_example_json(tmp_path):
    """--json: exactly one JSON document on standard output, the logs on standard error."""
    pytest.importorskip("torch")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(
        eplb.__file__)), env.get("PYTHONPATH", "")] if p)
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "torch_moe.py"), "--ranks", "2",
         "--layers", "2", "--experts", "8", "--redundant", "4", "--hidden", "16", "--ffn", "32",
         "--tokens", "16", "--steps", "20", "--interval", "8", "--window", "8", "--json",
         "--workdir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout)  # the whole of standard output
    assert summary["ranks"] == 2 and summary["steps"] == 20, summary
    assert "eplb runtime rank 0: connected" in run.stderr  # the runtime's log lines went there


@pytest.mark.parametrize("changes, message", [
    ({"interval": 2**70}, r"config\['interval'\] is 1180591620717411303424, outside the 64-bit"),
    ({"window": -2**64}, r"config\['window'\] is -18446744073709551616, outside the 64-bit"),
    ({"lag": 2**31}, r"lag 2147483648 is outside \[1, 1024\]"),
    ({"timeout_ms": 2**62}, r"timeout 4611686018427387904 ms is outside"),
    ({"tolerance": 10**400}, r"config\['tolerance'\] .* too large for a floating-point number"),
])
def test_config_bounds(changes, message):
    with pytest.raises(ValueError, match=message):
        eplb.Rebalancer(one_config(**changes), 0, 1, control="inproc", transport="inproc",
                        weights=WEIGHTS, layers=LAYERS)


def test_argument_bounds():
    ok = dict(control="inproc", transport="inproc")
    with pytest.raises(ValueError, match=r"layers 1180591620717411303424 is outside \[1, 65536\]"):
        eplb.Rebalancer(one_config(), 0, 1, weights=WEIGHTS, layers=2**70, **ok)
    with pytest.raises(ValueError, match=r"world_size 1180591620717411303424 is outside"):
        eplb.Rebalancer(one_config(), 0, 2**70, rendezvous="x", weights=WEIGHTS, layers=1, **ok)
    with pytest.raises(ValueError, match="expert_bytes 1180591620717411303424 is outside"):
        eplb.Rebalancer(one_config(), 0, 1, weights={"w": 2**70}, layers=1, **ok)
    with pytest.raises(ValueError, match="more than a 64-bit count"):
        eplb.Rebalancer(one_config(), 0, 1, weights={"w": ((2**40, 2**40), "float32")},
                        layers=1, **ok)
    # Bytes that fit an int64 but not the arena's arithmetic.
    with pytest.raises(ValueError, match="does not fit a 64-bit count"):
        eplb.Rebalancer(one_config(), 0, 1, weights={"w": 2**60}, layers=LAYERS, **ok)


def test_min_gain_config_and_cost_model():
    # A rebalance only when it pays: min_gain and its model in the config, the model replaced
    # while serving, and every rebalance's check in the history. Sync mode: every trigger's
    # check is made inside its step_end, however slow the machine (a sanitizer's build).
    model = eplb.cost.CostModel(slot_us=10.0, token_us=1.0)
    with eplb.Rebalancer(one_config(min_gain=0.5, cost=model, interval=2, window=2, mode="sync"),
                         0, 1,
                         control="inproc",
                         transport="inproc", weights=WEIGHTS, layers=LAYERS) as rb:
        assert rb.config["min_gain"] == 0.5 and rb.config["cost"].slot_us == 10.0
        rb.connect()
        rb.set_cost_model(eplb.cost.CostModel(slot_us=20.0, token_us=1.0, noise=0.05))
        with pytest.raises(eplb.InvalidArgument, match="slot_us is -1"):
            m = eplb.cost.CostModel(slot_us=1.0)
            m.slot_us = -1.0
            rb.set_cost_model(m)
        ids = np.zeros((16, 2), dtype=np.int64)  # every token to expert 0: worth spreading
        for _ in range(12):
            for layer in range(LAYERS):
                rb.record(layer, ids)
            rb.step_end()
        checked = [h for h in rb.history() if h["gain_checked"]]
        assert checked, rb.history()
        for h in checked:
            assert h["moe_us_before"] > 0 and "gain_us" in h and "price_us" in h
