"""The runtime under an engine's own policy and its elastic EP, ranks as threads of this process:
rb.propose() with a torch tensor, a numpy array or a placement file, installed on every rank or
refused on every rank naming the first differing layer and slot; group= any object with eplb's
collectives (a torch ProcessGroup outside the world map, vLLM's StatelessProcessGroup interface,
a small Python class) and the bad ones refused; reconfigure(group=, members=) onto the engine's
own post-failure group, then maps and counters at the members' width."""

import datetime
import json
import os
import threading
import time
import uuid

import numpy as np
import pytest

import eplb
from eplb.integrations import sglang, vllm

torch = pytest.importorskip("torch")
dist = torch.distributed

E, P, LAYERS = 8, 12, 2


def config(**extra):
    c = {"experts": E, "physical": P, "interval": 0, "window": 4, "lag": 1, "mode": "async",
         "timeout_ms": 20000, "stall_warn_ms": 0}
    c.update(extra)
    return c


def value(layer, tensor, expert):
    return np.full(6, 100 * layer + 10 * expert + (tensor == "w2"), dtype=np.float32)


def holds_its_experts(rb):
    return all(np.array_equal(rb.weights(layer, name)[j], value(layer, name, int(e)))
               for layer in range(LAYERS) for name in ("w13", "w2")
               for j, e in enumerate(rb.local_experts(layer)))


def run_ranks(body, n):
    """body(rank) on n threads; re-raises the first error on the main thread."""
    results, errors = {}, []

    def guarded(rank):
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def placement(seed, physical=P):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(LAYERS):
        row = np.concatenate([np.arange(E), rng.integers(0, E, physical - E)])
        rows.append(rng.permutation(row))
    return np.stack(rows)


# ---------------------------------------------------------------------------- propose
def one_rank(**extra):
    rb = eplb.Rebalancer(config(policy="deepseek", **extra), 0, 1, control="inproc",
                         rendezvous=f"pr-{uuid.uuid4().hex}", transport="inproc", layers=LAYERS,
                         weights={"w13": ((6,), "float32"), "w2": ((6,), "float32")})
    rb.connect()
    rb.fill_weights(value)
    return rb


# Loops run until what they wait for happened (a rebalance ends at the same step on every
# rank, however fast the workers run), pausing a little per step so that the runtime's
# background threads get the core on a busy machine; MAX_STEPS only guards against a hang.
MAX_STEPS = 100_000
PAUSE = 0.0002


def serve_until_idle(rb):
    for _ in range(MAX_STEPS):
        rb.step_end()
        assert holds_its_experts(rb)
        if not rb.rebalancing:
            return rb.history()[-1]
        time.sleep(PAUSE)
    raise AssertionError("the rebalance did not end")


def test_propose_tensor_array_and_files(tmp_path):
    with one_rank() as rb:
        for i, kind in enumerate(["numpy", "torch", "eplb-file", "sglang-file"]):
            p = placement(i)
            if kind == "numpy":
                rb.propose(p.astype(np.int32))
            elif kind == "torch":
                rb.propose(torch.from_numpy(p))
            elif kind == "eplb-file":  # what `eplb plan` writes
                path = tmp_path / "plan.json"
                path.write_text(json.dumps({"layers": LAYERS, "experts": E, "physical": P,
                                            "phy2log": p.tolist()}))
                rb.propose(str(path))
            else:  # SGLang's --init-expert-location file
                path = tmp_path / "sglang.json"
                sglang.write_init_expert_location(path, p)
                rb.propose(path)
            rb.step_end()
            assert rb.rebalancing
            record = serve_until_idle(rb)
            assert record["outcome"] == "completed" and record["proposed"], (kind, record)
            np.testing.assert_array_equal(rb.placement(), p)


@pytest.mark.parametrize("bad, message", [
    (np.zeros((LAYERS, P - 1), dtype=np.int64), "2 layers x 11 slots; expected 2 x 12"),
    (np.zeros((3, P), dtype=np.int64), "3 layers, the runtime 2"),
    (np.full((LAYERS, P), 8), r"layer 0 slot 0 holds expert 8, outside \[0, 8\)"),
    (np.full((LAYERS, P), -1), "holds expert -1"),
    (np.tile(np.arange(P) % (E - 1), (LAYERS, 1)), "layer 0 has no slot for expert 7"),
    (np.zeros((LAYERS, P)), "integer"),
    (np.zeros(P, dtype=np.int64), r"\[layers, physical\]"),
    ("/nonexistent/plan.json", "cannot open"),
])
def test_bad_proposals_queue_nothing(bad, message):
    with one_rank() as rb:
        with pytest.raises(eplb.Error, match=message):
            rb.propose(bad)
        for _ in range(3):
            rb.step_end()
        assert rb.history() == [] and holds_its_experts(rb)


def test_proposal_while_installing_is_refused():
    with one_rank() as rb:
        rb.propose(placement(1))
        rb.step_end()
        assert rb.rebalancing
        with pytest.raises(eplb.InvalidArgument, match="rebalance 0 .* is still installing"):
            rb.propose(placement(2))
        assert serve_until_idle(rb)["outcome"] == "completed"
        np.testing.assert_array_equal(rb.placement(), placement(1))


def test_mismatch_refused_on_every_rank_naming_layer_and_slot():
    rendezvous = f"pm-{uuid.uuid4().hex}"

    def rank(r):
        with eplb.Rebalancer(config(on_error="raise"), r, 2, control="inproc",
                             rendezvous=rendezvous, transport="inproc", layers=LAYERS,
                             weights={"w13": ((6,), "float32"), "w2": ((6,), "float32")}) as rb:
            rb.connect()
            rb.fill_weights(value)
            before = rb.placement()
            p = placement(3)
            if r == 1:  # another expert in layer 1 slot 4, from a later slot
                k = next(i for i in range(5, P) if p[1, i] != p[1, 4])
                p[1, [4, k]] = p[1, [k, 4]]
            rb.propose(p)
            raised = None
            for _ in range(MAX_STEPS):
                try:
                    rb.step_end()
                except eplb.InvalidArgument as e:
                    raised = (rb.step, str(e))
                if not rb.rebalancing:
                    break
                time.sleep(PAUSE)
            np.testing.assert_array_equal(rb.placement(), before)
            assert holds_its_experts(rb)
            return raised, rb.history()
    results = run_ranks(rank, 2)
    for r in (0, 1):
        raised, history = results[r]
        assert raised is not None and "layer 1 slot 4 holds expert" in raised[1], raised
        assert history[0]["outcome"] == "failed" and history[0]["proposed"]
    assert results[0][0][0] == results[1][0][0]  # the same step on both ranks


def test_vllm_policy_proposes_and_eplb_installs():
    """vLLM's rearrangement with eplb underneath: vLLM's default policy's outputs (eplb's
    deepseek policy gives them), proposed from the engine's global load."""
    with one_rank() as rb:
        load = np.arange(LAYERS * E, dtype=np.float64).reshape(LAYERS, E) % 5 + 1
        proposed = vllm.propose(rb, torch.from_numpy(load), vllm.make_policy("deepseek"))
        assert isinstance(proposed, torch.Tensor)
        want = vllm.make_policy("deepseek").rebalance_experts(load, P, 1, 1, 1, rb.placement())
        np.testing.assert_array_equal(proposed.numpy(), want)
        rb.step_end()
        assert serve_until_idle(rb)["proposed"]
        np.testing.assert_array_equal(rb.placement(), want)
        with pytest.raises(eplb.InvalidArgument, match="has no rebalance_experts"):
            vllm.propose(rb, load, policy=object())


# ---------------------------------------------------------------------------- group objects
class Shared:
    """What the ranks (threads) of one small group share."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def exchange(self, rank, item, seconds):
        self.slots[rank] = item
        self.barrier.wait(max(seconds, 0.001))  # every item is in
        out = list(self.slots)
        self.barrier.wait(max(seconds, 0.001))  # every rank has read them
        return out


class SmallGroup:
    """A small Python class with eplb's collectives (docs/embedding.md, "Collectives")."""

    def __init__(self, shared, rank):
        self.shared, self.rank, self.size = shared, rank, shared.size

    def barrier(self, seconds):
        self.shared.exchange(self.rank, None, seconds)

    def all_reduce(self, values, op, seconds):
        parts = self.shared.exchange(self.rank, list(values), seconds)
        reduce = {"min": min, "max": max, "sum": sum}[op]
        return [reduce(p[i] for p in parts) for i in range(len(values))]

    def broadcast(self, data, root, seconds):
        return self.shared.exchange(self.rank, bytes(data), seconds)[root]

    def all_gather(self, data, seconds):
        return self.shared.exchange(self.rank, bytes(data), seconds)


class StatelessGroup:
    """vLLM's StatelessProcessGroup's interface (rank, world_size, all_gather_obj,
    broadcast_obj, barrier, and its tensor all_reduce and broadcast), over threads."""

    def __init__(self, shared, rank):
        self.shared, self.rank, self.world_size = shared, rank, shared.size

    def all_gather_obj(self, obj):
        return self.shared.exchange(self.rank, obj, 30)

    def broadcast_obj(self, obj, src):
        return self.shared.exchange(self.rank, obj, 30)[src]

    def barrier(self, timeout=30.0):
        self.shared.exchange(self.rank, None, timeout)

    def all_reduce(self, tensor, op=None):
        raise AssertionError("eplb uses all_gather_obj (this one takes a tensor)")

    def broadcast(self, tensor, src):
        raise AssertionError("eplb uses broadcast_obj (this one takes a tensor)")


def gloo_group(folder, epoch, rank, size):
    """A gloo ProcessGroup on a store of the engine's: not in torch's world map."""
    store = dist.FileStore(os.path.join(folder, f"store-{epoch}"), size)
    return dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=30))


@pytest.mark.parametrize("kind", ["process-group", "small-class", "stateless"])
def test_group_objects_carry_the_control_plane(kind, tmp_path):
    shared = Shared(2)

    def rank(r):
        group = {"process-group": lambda: gloo_group(str(tmp_path), 0, r, 2),
                 "small-class": lambda: SmallGroup(shared, r),
                 "stateless": lambda: StatelessGroup(shared, r)}[kind]()
        with eplb.Rebalancer(config(), group=group, transport="inproc", layers=LAYERS,
                             weights={"w13": ((6,), "float32"), "w2": ((6,), "float32")}) as rb:
            assert rb.rank == r and rb.world_size == 2
            rb.connect()
            rb.fill_weights(value)
            rb.propose(placement(5))
            rb.step_end()
            serve_until_idle(rb)
            return rb.history()
    results = run_ranks(rank, 2)
    assert all(h and h[0]["outcome"] == "completed" for h in results.values()), results


class Lacking:
    rank, size = 0, 1

    def barrier(self, seconds):
        pass

    def all_reduce(self, values, op, seconds):
        return values


def test_bad_group_objects_are_refused():
    weights = {"w13": ((6,), "float32")}
    with pytest.raises(eplb.InvalidArgument, match=r"Lacking without broadcast\(\), "
                                                   r"all_gather\(\)"):
        eplb.Rebalancer(config(), group=Lacking(), layers=LAYERS, weights=weights)
    with pytest.raises(eplb.InvalidArgument, match=r"without barrier\(\), all_reduce\(\), "
                                                   r"broadcast\(\), all_gather\(\), rank, size"):
        eplb.Rebalancer(config(), group=object(), layers=LAYERS, weights=weights)
    small = SmallGroup(Shared(2), 1)
    with pytest.raises(eplb.InvalidArgument, match="the group has 2 ranks but world_size is 3"):
        eplb.Rebalancer(config(), 1, 3, group=small, layers=LAYERS, weights=weights)
    with pytest.raises(eplb.InvalidArgument, match="rank 1 of the group but rank is 0"):
        eplb.Rebalancer(config(), 0, 2, group=small, layers=LAYERS, weights=weights)
    small.rank = 5
    with pytest.raises(eplb.InvalidArgument, match="reports rank 5 of size 2"):
        eplb.Rebalancer(config(), group=small, layers=LAYERS, weights=weights)
    with pytest.raises(eplb.InvalidArgument, match="leave rendezvous out"):
        eplb.Rebalancer(config(), group=SmallGroup(Shared(1), 0), rendezvous="x", layers=LAYERS,
                        weights=weights)


def test_reconfigure_refuses_a_group_contradicting_members():
    with eplb.Rebalancer.join(config(), 1, 3, weights={"w13": ((6,), "float32")},
                              layers=LAYERS) as rb:
        with pytest.raises(eplb.InvalidArgument, match=r"the group has 2 ranks but members "
                                                       r"lists 3 seats \[0, 1, 2\]"):
            rb.reconfigure(group=SmallGroup(Shared(2), 1), members=[0, 1, 2])
        with pytest.raises(eplb.InvalidArgument, match="rank 0 of the group, but members puts "
                                                       "seat 0 there and this Rebalancer holds "
                                                       "seat 1"):
            rb.reconfigure(group=SmallGroup(Shared(2), 0), members=[0, 1])
        with pytest.raises(eplb.InvalidArgument, match="give members or seats"):
            rb.reconfigure(group=SmallGroup(Shared(2), 1), members=[0, 1], seats=[0, 1])
        with pytest.raises(eplb.InvalidArgument, match=r"Lacking without broadcast\(\), "
                                                       r"all_gather\(\)"):
            rb.reconfigure(group=Lacking(), members=[1])


def test_reconfigure_onto_the_engines_group_then_maps_of_the_members_width(tmp_path):
    """Three seats on gloo groups the engine builds itself; seat 1 leaves. Seats 0 and 2 build
    a new group, hand it to eplb with their seats, and re-slice their maps and counters to
    their 8 slots, renumbered (vLLM's elastic EP: seat 2's slots become 4..7); eplb repairs
    from its backup copies, writes the new views at every install and never the old ones, and
    installs a proposal at the members' width."""
    spr = P // 3
    members = [0, 2]
    compact = {s * spr + j: g * spr + j for g, s in enumerate(members) for j in range(spr)}

    def rank(seat):
        group = gloo_group(str(tmp_path), 0, seat, 3)
        phy2log = np.full((LAYERS, P), -7, dtype=np.int64)
        log2phy = np.full((LAYERS, E, P - E + 1), -7, dtype=np.int64)
        count = np.zeros((LAYERS, E), dtype=np.int32)
        with eplb.Rebalancer(config(backup_copies=2), group=group, transport="inproc",
                             layers=LAYERS,
                             weights={"w13": ((6,), "float32"), "w2": ((6,), "float32")}) as rb:
            rb.connect()
            rb.fill_weights(value)
            rb.fill_backup(lambda layer, tensor, expert, view: value(layer, tensor, expert))
            rb.bind_maps(physical_to_logical_map=phy2log, logical_to_physical_map=log2phy,
                         logical_replica_count=count)
            for _ in range(2):
                rb.step_end()
            if seat == 1:
                return None
            rb.reconfigure(group=gloo_group(str(tmp_path), 1, members.index(seat), 2),
                           members=members, transport="inproc")
            assert rb.members() == members and rb.any_unavailable()
            old = (phy2log.copy(), log2phy.copy())
            narrow = np.full((LAYERS, 2 * spr), -7, dtype=np.int64)
            narrow_log2phy = np.full((LAYERS, E, P - E + 1), -7, dtype=np.int64)
            narrow_count = np.zeros((LAYERS, E), dtype=np.int32)
            rb.bind_maps(physical_to_logical_map=narrow, logical_to_physical_map=narrow_log2phy,
                         logical_replica_count=narrow_count)
            with pytest.raises(eplb.InvalidArgument, match=r"\[2, 12\] .* or \[2, 8\]"):
                rb.bind_maps(physical_to_logical_map=np.zeros((LAYERS, 7), dtype=np.int64))
            counts = np.ones((LAYERS, 2 * spr), dtype=np.int32)  # the members' slots' counts
            proposed = None
            for _ in range(MAX_STEPS):
                rb.record_pass(counts, per="slot")
                seat_slots = [s for s in range(P) if s in compact]
                np.testing.assert_array_equal(narrow, rb.placement()[:, seat_slots])
                assert np.array_equal(phy2log, old[0]) and np.array_equal(log2phy, old[1])
                for layer in range(LAYERS):
                    tables = rb.dispatch(layer)
                    for e in range(E):
                        n = tables["replica_count"][e]
                        assert narrow_log2phy[layer, e, :n].tolist() == \
                            [compact[int(s)] for s in tables["log2phy"][e, :n]]
                        assert (narrow_log2phy[layer, e, n:] == -1).all()
                        assert narrow_count[layer, e] == n
                history = rb.history()
                if proposed is None and history and history[-1]["repair"] and not rb.rebalancing:
                    proposed = placement(7, physical=2 * spr)
                    rb.propose(proposed)
                elif proposed is not None and not rb.rebalancing and history[-1]["proposed"]:
                    break
                rb.step_end()
                time.sleep(PAUSE)
            assert not rb.any_unavailable() and holds_its_experts(rb)
            assert history[-1]["outcome"] == "completed", history[-1]
            np.testing.assert_array_equal(narrow, proposed)
            return [(h["trigger_step"], h["end_step"], h["outcome"]) for h in rb.history()]
    results = run_ranks(rank, 3)
    assert results[0] == results[2]
