"""eplb's vLLM EPLB communicator (eplb.integrations.vllm_communicator), driven through vLLM's
interface without vLLM: forked ranks on a gloo group, a stand-in for vLLM's EplbCommunicator ABC,
and a driver that calls the communicator the way vLLM's rebalance_execute.move_to_buffer does.
Checked: the weights after every rearrangement equal the single-process reference; a rank killed
during execute() makes every survivor raise naming it; tensors that differ across ranks, and
other bad input found on one rank, raise on every rank, naming the value."""

import abc
import datetime
import multiprocessing
import os
import signal
import sys
import traceback

import numpy as np
import pytest

import eplb

torch = pytest.importorskip("torch")
dist = torch.distributed
from eplb.integrations import vllm_communicator as vc  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forked ranks and shm: Linux")

LAYERS = 3
EXPERTS = 10
SLOTS = 3  # per rank
SHAPES = {"w13": ((2, 8), torch.float32), "w2": ((8, 4), torch.bfloat16),
          "scale": ((3,), torch.uint8)}


class StandInEplbCommunicator(abc.ABC):
    """vLLM's EplbCommunicator ABC as far as its callers use it (vllm/distributed/eplb/
    eplb_communicator.py): the three abstract methods and the defaults of the rest."""

    @abc.abstractmethod
    def add_send(self, tensors, dst_rank, expert_id): ...

    @abc.abstractmethod
    def add_recv(self, tensors, src_rank, expert_id): ...

    @abc.abstractmethod
    def execute(self): ...

    def set_transfer_context(self, old_indices, layer_idx, recv_rows=None):
        pass

    @property
    def needs_recv_rows(self):
        return False

    @property
    def owned_expert_buffer(self):
        return None


def content(layer, expert, name):
    """The weights of `expert` in `layer`: distinct for every (layer, expert, tensor, element)."""
    shape, dtype = SHAPES[name]
    n = int(np.prod(shape))
    base = (layer * 131 + expert * 17 + list(SHAPES).index(name) * 5)
    values = (torch.arange(n, dtype=torch.int64) * 3 + base) % 251
    return values.to(dtype).reshape(shape)


def placements(world, count, seed):
    """`count` + 1 phy2log maps [LAYERS, world * SLOTS]: every expert somewhere, the others
    replicas, shuffled."""
    rng = np.random.default_rng(seed)
    physical = world * SLOTS
    out = []
    for _ in range(count + 1):
        maps = []
        for _ in range(LAYERS):
            slots = list(range(EXPERTS)) + rng.integers(0, EXPERTS, physical - EXPERTS).tolist()
            maps.append(rng.permutation(slots))
        out.append(np.array(maps, dtype=np.int64))
    return out


def weights_for(phy2log, rank):
    """{name: [layer tensors [SLOTS, ...]]} of `rank` under `phy2log` (the reference)."""
    mine = phy2log[:, rank * SLOTS:(rank + 1) * SLOTS]
    return [[torch.stack([content(l, int(e), name) for e in mine[l]]) for name in SHAPES]
            for l in range(LAYERS)]


def move_layer(comm, layer, old, new, rank, world, weights, buffers):
    """One layer moved as vLLM's move_to_buffer + move_from_buffer do: rows that keep their
    expert stay; experts this rank held move within it; the others are received into the
    buffer's row of their first new slot (vLLM's add_recv), once per expert; sends are
    announced to the destinations vLLM would pick (its balanced split over the holders)."""
    base = rank * SLOTS
    old_local, new_local = old[base:base + SLOTS], new[base:base + SLOTS]
    held = {int(e): r for r, e in enumerate(old_local) if e >= 0}
    comm.set_transfer_context(old, layer)
    # Sends: this rank announces the experts it holds that other ranks gain.
    for expert in sorted(held):
        for dst in range(world):
            gains = expert in new[dst * SLOTS:(dst + 1) * SLOTS] and \
                expert not in old[dst * SLOTS:(dst + 1) * SLOTS]
            if dst != rank and gains:
                comm.add_send([w[held[expert]] for w in weights], dst, expert)
    local, received = {}, {}
    for row, expert in enumerate(new_local.tolist()):
        if expert in held:
            local[row] = held[expert]
        elif expert not in received:
            holders = sorted({p // SLOTS for p in np.flatnonzero(old == expert)})
            comm.add_recv([b[row] for b in buffers], holders[0], expert)
            received[expert] = row
    comm.execute()
    staged = {row: [w[src].clone() for w in weights] for row, src in local.items()}
    for row, expert in enumerate(new_local.tolist()):
        if row in staged:
            for w, v in zip(weights, staged[row]):
                w[row].copy_(v)
        else:
            for w, b in zip(weights, buffers):
                w[row].copy_(b[received[expert]])


# ------------------------------------------------------------------ forked ranks
def _rank(rank, world, store, queue, done, body, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        group = dist.new_group(list(range(world)), backend="gloo")
        queue.put((rank, "ok", body(rank, world, group, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    queue.close()
    queue.join_thread()
    done.wait(timeout=240)  # alive until every answer is in: only a killed rank is gone
    os._exit(0)  # no torch teardown: a dead peer's group must not hang the exit


def run_ranks(tmp_path, world, body, *args, expect=None, kill=()):
    """{rank: (status, value)} of `body(rank, world, group, *args)` on `world` forked ranks;
    `expect`: how many answers to wait for (a rank that kills itself gives none); `kill`: ranks
    to kill once the answers are in (a stopped rank)."""
    context = multiprocessing.get_context("fork")
    queue, done = context.Queue(), context.Event()
    store = tmp_path / f"store-{os.getpid()}"
    procs = [context.Process(target=_rank, args=(r, world, str(store), queue, done, body, args))
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world if expect is None else expect):
            rank, status, value = queue.get(timeout=240)
            out[rank] = (status, value)
    finally:
        done.set()
        for r in kill:
            procs[r].kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def communicator(group, weights, **options):
    cls = vc.communicator_class(StandInEplbCommunicator)
    comm = vc.make_communicator(group, weights, cls=cls, **options)
    assert isinstance(comm, StandInEplbCommunicator)
    return comm


def as_numpy(weights):
    """[layers][tensors] of numpy copies (bfloat16 as its bits): what a rank sends back."""
    return [[(w.view(torch.int16) if w.dtype == torch.bfloat16 else w).numpy().copy()
             for w in ws] for ws in weights]


def rearrange_body(rank, world, group, maps, transport):
    weights = weights_for(maps[0], rank)
    buffers = [torch.empty_like(w) for w in weights[0]]
    comm = communicator(group, weights, transport=transport, timeout=60)
    assert comm.backend == (transport or "shm")
    results = []
    for before, after in zip(maps, maps[1:]):
        for layer in range(LAYERS):
            move_layer(comm, layer, before[layer], after[layer], rank, world, weights[layer],
                       buffers)
        results.append(as_numpy(weights))
    comm.close()
    return results


def check_reference(out, maps, world):
    for rank in range(world):
        status, results = out[rank]
        assert status == "ok", results
        for i, result in enumerate(results):
            expect = weights_for(maps[i + 1], rank)
            for layer, (got, want) in enumerate(zip(result, as_numpy(expect))):
                for t, (a, b) in enumerate(zip(got, want)):
                    assert a.dtype == b.dtype and np.array_equal(a, b), (rank, i, layer, t)


@pytest.mark.parametrize("transport", [None, "hybrid", "ucx"])
def test_rearrangements_equal_the_reference(tmp_path, transport):
    if transport and transport not in eplb.transport_backends():
        pytest.skip(f"no {transport} transport in this build")
    world = 4
    maps = placements(world, 3, seed=53)
    out = run_ranks(tmp_path, world, rearrange_body, maps, transport)
    check_reference(out, maps, world)


def test_unused_slots_and_a_rank_that_receives_nothing(tmp_path):
    # vLLM marks a slot it does not use -1 (elastic EP's new ranks): never a source, whatever
    # its bytes. Rank 0 keeps its slots and receives nothing, but takes part in every round.
    world = 4
    rng = np.random.default_rng(17)
    before = placements(world, 0, seed=17)[0]
    after = before.copy()
    for layer in range(LAYERS):
        counts = np.bincount(before[layer], minlength=EXPERTS)
        spare = [p for p in range(SLOTS, world * SLOTS) if counts[before[layer][p]] > 1]
        before[layer][spare[0]] = -1
        missing = sorted(set(range(EXPERTS)) - set(before[layer][:SLOTS].tolist()))
        rest = missing + rng.integers(0, EXPERTS, (world - 1) * SLOTS - len(missing)).tolist()
        after[layer][SLOTS:] = rng.permutation(rest)

    def body(rank, world, group):
        # The unused slot holds another expert's bytes: reading it would show.
        weights = weights_for(np.where(before < 0, 3, before), rank)
        buffers = [torch.empty_like(w) for w in weights[0]]
        comm = communicator(group, weights, timeout=60)
        for layer in range(LAYERS):
            move_layer(comm, layer, before[layer], after[layer], rank, world, weights[layer],
                       buffers)
        return as_numpy(weights), comm.last

    out = run_ranks(tmp_path, world, body)
    for rank in range(world):
        status, value = out[rank]
        assert status == "ok", value
        got, last = value
        expect = as_numpy(weights_for(after, rank))
        for layer in range(LAYERS):
            for a, b in zip(got[layer], expect[layer]):
                assert np.array_equal(a, b), (rank, layer)
        assert last["rounds"] >= 1
        assert (last["reads"] == 0) == (rank == 0), (rank, last)


# ------------------------------------------------------------------ a killed peer
def killed_body(rank, world, group, maps, where):
    weights = weights_for(maps[0], rank)
    buffers = [torch.empty_like(w) for w in weights[0]]
    comm = communicator(group, weights, timeout=60)
    victim = world - 1
    current = {"layer": None}

    def hook(owner, name, before):
        original = getattr(owner, name)

        def wrapped(*a, **k):
            if current["layer"] == 1:
                before(*a)
            return original(*a, **k)
        setattr(owner, name, wrapped)

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    def until_victim_is_gone(*_):
        pid = comm._group._peers[victim][1]
        for _ in range(1000):
            if not os.path.exists(f"/proc/{pid}") or \
                    open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
            __import__("time").sleep(0.01)

    def after_first_round(epoch, phase):
        if phase == 3:  # round 1 done
            die()

    # The victim dies in execute() of layer 1: before it publishes its receives, after every
    # rank has checked them (its peers then read from a dead process), or after round 1.
    if rank == victim:
        if where == "publish":
            hook(comm._board, "publish", die)
        elif where == "reads":
            hook(comm, "_agree", die)
        else:
            hook(comm._board, "progress", after_first_round)
    elif where == "reads":
        hook(comm, "_agree", until_victim_is_gone)
    try:
        for layer in range(LAYERS):
            current["layer"] = layer
            move_layer(comm, layer, maps[0][layer], maps[1][layer], rank, world,
                       weights[layer], buffers)
    except (eplb.IoError, eplb.Timeout) as e:
        try:
            comm.set_transfer_context(maps[0][0], 0)
            after = "usable"
        except eplb.IoError as later:
            after = str(later)
        return type(e).__name__, str(e), after
    return "no error", None, None


def demands(old, new, world):
    """Per rank, the experts it receives moving old -> new (what move_layer asks for)."""
    return [sorted(set(new[r * SLOTS:(r + 1) * SLOTS].tolist()) -
                   set(old[r * SLOTS:(r + 1) * SLOTS].tolist())) for r in range(world)]


@pytest.mark.parametrize("where", ["publish", "reads", "rounds"])
def test_killed_peer_fails_every_survivor_naming_it(tmp_path, where):
    world = 4
    victim = world - 1
    # Moves in which a survivor reads from the victim in the first round of layer 1: with the
    # victim dead after the plan, that survivor's read itself fails.
    for seed in range(100):
        maps = placements(world, 1, seed=seed)
        reads, _ = vc.plan_reads(maps[0][1], demands(maps[0][1], maps[1][1], world))
        first = (reads["round"] == 0) & (reads["src_rank"] == victim)
        if first.any():
            readers = set(reads["dst_rank"][first].tolist())
            break
    out = run_ranks(tmp_path, world, killed_body, maps, where, expect=world - 1)
    assert sorted(out) == list(range(world - 1)), out
    for rank, (status, value) in out.items():
        assert status == "ok", value
        kind, message, after = value
        assert kind == "IoError", (rank, kind, message)
        assert f"rank {victim}" in message, (rank, message)
        assert "layer 1" in message, (rank, message)
        if where == "reads" and rank in readers:
            assert f"rank {rank} could not read from rank {victim}" in message, message
        assert "unusable" in after, after


def stopped_body(rank, world, group, maps):
    weights = weights_for(maps[0], rank)
    buffers = [torch.empty_like(w) for w in weights[0]]
    comm = communicator(group, weights, timeout=3)
    if rank == world - 1:
        original = comm._board.publish

        def publish(epoch, *a):
            if epoch == 2:  # layer 1: the victim stops before it publishes its receives
                os.kill(os.getpid(), signal.SIGSTOP)
            return original(epoch, *a)
        comm._board.publish = publish
    try:
        for layer in range(LAYERS):
            move_layer(comm, layer, maps[0][layer], maps[1][layer], rank, world,
                       weights[layer], buffers)
    except (eplb.IoError, eplb.Timeout) as e:
        return type(e).__name__, str(e)
    return "no error", None


def test_stopped_peer_times_out_every_survivor_naming_it(tmp_path):
    world = 4
    maps = placements(world, 1, seed=2)
    out = run_ranks(tmp_path, world, stopped_body, maps, expect=world - 1, kill=[world - 1])
    assert sorted(out) == list(range(world - 1)), out
    for rank, (status, value) in out.items():
        assert status == "ok", value
        kind, message = value
        assert kind == "Timeout", (rank, message)
        assert "rank 3" in message and "layer 1" in message, (rank, message)
    # Whoever timed out first saw where rank 3 was; the others gave up after it.
    assert any("(it is still in an earlier execute())" in v[1] and "stopped" in v[1]
               for _, v in out.values()), out


# ------------------------------------------------------------------ bad input
def mismatch_body(rank, world, group, change):
    maps = placements(world, 0, seed=3)
    weights = weights_for(maps[0], rank)
    if rank == 2:
        change(weights)
    try:
        communicator(group, weights, timeout=60)
    except eplb.Error as e:
        return type(e).__name__, str(e)
    return "no error", None


@pytest.mark.parametrize("change, message", [
    (lambda w: w[1].__setitem__(0, w[1][0].to(torch.float16)),
     r"expert tensor 0 of layer 1 is float16 \(3, 2, 8\) on rank 2, float32 \(3, 2, 8\) on rank 0"),
    (lambda w: w[0].__setitem__(2, torch.zeros(3, 4, dtype=torch.uint8)),
     r"expert tensor 2 of layer 0 is uint8 \(3, 4\) on rank 2, uint8 \(3, 3\) on rank 0"),
    (lambda w: w.pop(),
     "rank 2 registers 2 layers of expert tensors, rank 0 3"),
    (lambda w: w[0].__setitem__(1, w[0][1].transpose(1, 2)),
     r"rank 2: expert tensor 1 of layer 0 is not contiguous"),
    (lambda w: w[0].__setitem__(0, torch.zeros(3, 2, 8, device="meta")),
     "rank 2: expert tensor 0 of layer 0 is on meta: eplb's vLLM communicator moves CPU "
     "tensors only"),
], ids=["dtype", "shape", "layers", "strides", "device"])
def test_tensors_that_differ_across_ranks_fail_every_rank(tmp_path, change, message):
    world = 4
    out = run_ranks(tmp_path, world, mismatch_body, change)
    expect = "NotSupported" if "meta" in message else "InvalidArgument"
    for rank in range(world):
        status, value = out[rank]
        assert status == "ok", value
        assert value[0] == expect, (rank, value)
        assert __import__("re").search(message, value[1]), (rank, value[1])


def bad_recv_body(rank, world, group, bad):
    maps = placements(world, 1, seed=5)
    weights = weights_for(maps[0], rank)
    buffers = [torch.empty_like(w) for w in weights[0]]
    comm = communicator(group, weights, timeout=60)
    comm.set_transfer_context(maps[0][0], 0)
    if rank == 1:
        if bad == "dtype":
            comm.add_recv([buffers[0][0].to(torch.float64), buffers[1][0], buffers[2][0]], 0,
                          int(maps[0][0][0]))
        elif bad == "no source":
            comm.set_transfer_context(np.where(maps[0][0] == 4, 5, maps[0][0]), 0)
            comm.add_recv([b[0] for b in buffers], 0, 4)
        elif bad == "layer":
            comm.set_transfer_context(maps[0][1], 1)
    try:
        comm.execute()
    except eplb.Error as e:
        # The group stays in step after bad input: the next layer moves.
        try:
            move_layer(comm, 2, maps[0][2], maps[1][2], rank, world, weights[2], buffers)
            after = "moved"
        except eplb.Error as later:
            after = f"{type(later).__name__}: {later}"
        return type(e).__name__, str(e), after
    return "no error", None, None


@pytest.mark.parametrize("bad, message, after", [
    ("dtype", r"layer 0: rank 1: add_recv\(expert \d+\) of layer 0, tensor 0 is float64 \(2, 8\) "
     r"\(128 bytes\); an expert of the registered tensor is float32 \(2, 8\) \(64 bytes\)",
     "moved"),
    ("no source", "rank 1's old placement", "moved"),
    ("layer", r"different layers at execute\(\) \(rank 0: 0, rank 1: 1", "IoError"),
])
def test_bad_input_on_one_rank_fails_every_rank(tmp_path, bad, message, after):
    world = 4
    out = run_ranks(tmp_path, world, bad_recv_body, bad)
    for rank in range(world):
        status, value = out[rank]
        assert status == "ok", value
        assert value[0] == "InvalidArgument", (rank, value)
        assert __import__("re").search(message, value[1]), (rank, value[1])
        assert value[2].startswith(after), (rank, value[2])


def no_source_body(rank, world, group):
    maps = placements(world, 0, seed=9)
    old = np.where(maps[0][0] == 4, 5, maps[0][0])  # expert 4 has no slot any more
    weights = weights_for(maps[0], rank)
    buffers = [torch.empty_like(w) for w in weights[0]]
    comm = communicator(group, weights, timeout=60)
    comm.set_transfer_context(old, 0)
    if rank == 2:
        comm.add_recv([b[0] for b in buffers], 0, 4)
    try:
        comm.execute()
    except eplb.Error as e:
        return type(e).__name__, str(e)
    return "no error", None


def test_a_transfer_with_no_source_fails_every_rank(tmp_path):
    out = run_ranks(tmp_path, 4, no_source_body)
    for rank in range(4):
        status, value = out[rank]
        assert status == "ok", value
        assert value == ("InvalidArgument",
                         "eplb communicator, layer 0: rank 2 receives expert 4, which no slot "
                         "of the old placement holds (a transfer with no source)"), value


# ------------------------------------------------------------------ configuration
def test_options_are_checked(monkeypatch):
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_COMMUNICATOR='nccl': expected "
                                                   "'eplb'"):
        vc.install_from_env({"EPLB_VLLM_COMMUNICATOR": "nccl"})
    assert vc.install_from_env({}) is None
    assert vc.install_from_env({"EPLB_VLLM_COMMUNICATOR": "off"}) is None
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_TRANSPORT 'tcp' is not one of"):
        vc.install_from_env({"EPLB_VLLM_COMMUNICATOR": "eplb", "EPLB_VLLM_TRANSPORT": "tcp"})
    with pytest.raises(eplb.InvalidArgument, match="EPLB_VLLM_TIMEOUT '-1' must be a positive"):
        vc.install_from_env({"EPLB_VLLM_COMMUNICATOR": "eplb", "EPLB_VLLM_TIMEOUT": "-1"})
    if "vllm" not in sys.modules:
        with pytest.raises(ImportError, match="needs vLLM"):
            vc.install_from_env({"EPLB_VLLM_COMMUNICATOR": "eplb"})
    with pytest.raises(eplb.NotSupported, match="stateless groups of elastic EP"):
        vc.make_communicator(object(), [[torch.zeros(2, 2)]])


def test_a_stand_in_factory_routes_the_eplb_backend(monkeypatch):
    """install() on a stand-in of vLLM's factory module: "eplb" (or any name, replace_all)
    gets eplb's communicator, other names vLLM's own."""
    import types
    calls = []
    module = types.ModuleType("vllm.distributed.eplb.eplb_communicator")
    module.EplbCommunicator = StandInEplbCommunicator
    module.create_eplb_communicator = lambda *a: calls.append(a[1]) or "vllm's"
    for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    sys.modules["vllm.distributed.eplb"].eplb_communicator = module
    made = []
    monkeypatch.setattr(vc, "make_communicator",
                        lambda coordinator, weights, cls: made.append(cls) or "eplb's")
    cls = vc.install()
    assert issubclass(cls, StandInEplbCommunicator) and issubclass(cls, vc.TransportCommunicator)
    assert module.create_eplb_communicator(None, "torch_gloo", [], None) == "vllm's"
    assert module.create_eplb_communicator(None, "eplb", [], None) == "eplb's"
    vc.install(replace_all=True)  # again: wraps vLLM's original, not the first wrapper
    assert module.create_eplb_communicator(None, "torch_gloo", [], None) == "eplb's"
    assert calls == ["torch_gloo"] and made == [cls, cls]
