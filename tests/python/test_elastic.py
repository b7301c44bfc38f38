"""eplb.Rebalancer's elastic serving: reconfigure(), join() and the backup copies.

Four ranks as threads of this process (inproc control and transport). Seat 3 alone holds
experts 4..7 at the start, so when it leaves, those experts have no replica until the repair
restores them from the backup copies; then a new process (thread) takes seat 3 back. At every
step every rank checks that no table names a slot of a seat outside the group, that every slot
the tables name on this rank holds its expert's weights, and that route() sends the tokens of
an unavailable expert to -1 and the others to a slot that holds them; the members' placements
and tables are the same at every step. Nothing depends on timing: a phase steps until the
history shows its repair completed (every rank ends a rebalance at the same step).
"""

import threading
import uuid

import numpy as np
import pytest

import eplb

EXPERTS = 8
SEATS = 4
PHYSICAL = 16
SPR = PHYSICAL // SEATS
LAYERS = 2
WEIGHTS = [("w13", ((2, 3), "float32")), ("w2", 10)]
# Seats 0..2 hold experts 0..3 (each on every one of them), seat 3 alone holds 4..7.
INITIAL = np.tile(np.array([0, 1, 2, 3, 1, 2, 3, 0, 2, 3, 0, 1, 4, 5, 6, 7]), (LAYERS, 1))
MAX_STEPS = 200


def expert_value(layer, tensor, expert):
    """What a slot (or backup copy) holds for (layer, tensor, expert): distinct per triple."""
    if tensor == "w13":
        return np.full((2, 3), 1000 * layer + 10 * expert + 1, dtype=np.float32) + \
            np.arange(6, dtype=np.float32).reshape(2, 3) / 8
    return np.full(10, (7 * layer + 3 * expert + 5) % 251, dtype=np.uint8)


def fill_backup_in_place(layer, tensor, expert, view):
    view[...] = expert_value(layer, tensor, expert)


def config(**extra):
    # No ordinary rebalance in these runs (interval far away): only the repairs move experts.
    c = {"experts": EXPERTS, "physical": PHYSICAL, "interval": 1000, "window": 4, "lag": 1,
         "timeout_ms": 20000, "backup_copies": 2}
    c.update(extra)
    return c


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def check_step(rb, members, rng, step):
    """The invariants of one step on one rank; returns what every member must agree on."""
    assert rb.members() == members
    tables = []
    for layer in range(LAYERS):
        d = rb.dispatch(layer)
        phy2log = rb.phy2log(layer)
        unavailable = rb.unavailable(layer)
        assert unavailable.dtype == np.int32
        np.testing.assert_array_equal(unavailable, np.flatnonzero(d["replica_count"] == 0))
        views = {name: rb.weights(layer, name) for name in rb.tensors}
        for e in range(EXPERTS):
            for slot in d["log2phy"][e][d["log2phy"][e] >= 0]:
                seat = int(slot) // SPR
                assert seat in members, \
                    f"step {step} layer {layer}: expert {e} routed to slot {slot} of seat {seat}"
                assert phy2log[slot] == e
                if seat != rb.rank:
                    continue
                for name, view in views.items():
                    np.testing.assert_array_equal(
                        view[slot - seat * SPR], expert_value(layer, name, e),
                        err_msg=f"step {step} layer {layer} slot {slot} {name} (expert {e})")
        ids = rng.integers(0, EXPERTS, size=(16, 2), dtype=np.int32)
        slots = rb.route(layer, ids, first_token=16 * step)
        lost = np.isin(ids, unavailable)
        assert (slots[lost] == -1).all()
        np.testing.assert_array_equal(phy2log[slots[~lost]], ids[~lost])
        counts = np.ones(EXPERTS, dtype=np.int64)
        counts[[0, 4, 5]] += 40 + layer  # skewed
        rb.record_counts(layer, counts)
        tables.append(d["log2phy"].tobytes())
    return rb.placement().tobytes(), tuple(tables), rb.any_unavailable()


def serve_until_repaired(rb, members, rng, log, since):
    """Serves steps until the repair triggered at `since` or later has completed."""
    for _ in range(MAX_STEPS):
        log[rb.step] = check_step(rb, members, rng, rb.step)
        rb.step_end()
        h = rb.history()
        if h and h[-1]["repair"] and h[-1]["trigger_step"] >= since:
            assert h[-1]["outcome"] == "completed", h[-1]
            log[rb.step] = check_step(rb, members, rng, rb.step)
            return h[-1]
    raise AssertionError(f"seat {rb.rank}: no repair completed in {MAX_STEPS} steps")


def engine_tensors():
    """The engine's own weights of one rank: per tensor, one array per layer; w2's slots 16
    bytes apart (a padded stride)."""
    return {"w13": [np.zeros((SPR, 2, 3), dtype=np.float32) for _ in range(LAYERS)],
            "w2": [np.zeros((SPR, 16), dtype=np.uint8)[:, :10] for _ in range(LAYERS)]}


@pytest.mark.parametrize("engine", [False, True], ids=["arena", "engine-weights"])
def test_shrink_then_take_the_seat_back(engine):
    rendezvous = [unique("el-all"), unique("el-shrink"), unique("el-grow")]
    logs = [{} for _ in range(SEATS + 1)]  # the last: seat 3's second process
    results = {}
    errors = []
    grow = threading.Event()  # the members reached the step at which seat 3 comes back
    inproc = dict(control="inproc", transport="inproc")

    def member(seat):
        rng = np.random.default_rng(seat)
        weights = engine_tensors() if engine else WEIGHTS
        rb = eplb.Rebalancer(config(), seat, SEATS, rendezvous=rendezvous[0], weights=weights,
                             initial=INITIAL, **inproc)
        with rb:
            rb.connect()
            rb.fill_weights(expert_value)
            rb.fill_backup(fill_backup_in_place)
            assert rb.backup_bytes() == len(rb.backup_experts()) * LAYERS * (24 + 10) > 0
            for _ in range(3):
                logs[seat][rb.step] = check_step(rb, list(range(SEATS)), rng, rb.step)
                rb.step_end()
            if seat == 3:
                return  # leaves: shuts down at the step the others reconfigure without it
            old_view = rb.weights(0, "w13")
            old_bytes = old_view.copy()
            # A planned shrink: the three others move onto a group of their own.
            shrink_step = rb.step
            rb.reconfigure(seat, 3, [0, 1, 2], rendezvous=rendezvous[1], **inproc)
            assert rb.step == shrink_step and rb.members() == [0, 1, 2]
            # A view from before still shows the old memory (kept alive), unchanged.
            np.testing.assert_array_equal(old_view, old_bytes)
            if engine:  # the engine's tensors are registered with the new transport in place
                assert rb.weights(0, "w13") is weights["w13"][0]
            shrunk = {"unavailable": [rb.unavailable(layer).tolist() for layer in range(LAYERS)],
                      "any": rb.any_unavailable()}
            shrink = serve_until_repaired(rb, [0, 1, 2], rng, logs[seat], shrink_step)
            assert not rb.any_unavailable()
            # Seat 3's process comes back: every member and the newcomer at the same step.
            grow.set()
            grow_step = rb.step
            rb.reconfigure(seat, SEATS, list(range(SEATS)), rendezvous=rendezvous[2], **inproc)
            rb.fill_backup(fill_backup_in_place)  # the joiner's share is filled after it joins
            regrow = serve_until_repaired(rb, list(range(SEATS)), rng, logs[seat], grow_step)
            results[seat] = dict(shrunk=shrunk, shrink=shrink, grow=regrow, step=rb.step,
                                 routed_to_3=routed_to(rb, 3),
                                 unavailable=[rb.unavailable(layer).size
                                              for layer in range(LAYERS)])

    def joiner():
        rng = np.random.default_rng(SEATS)
        if engine:
            rb = eplb.Rebalancer.join(config(), 3, SEATS, weights=engine_tensors())
        else:
            rb = eplb.Rebalancer.join(config(), 3, SEATS, weights=WEIGHTS, layers=LAYERS)
        with rb:
            assert rb.rank == 3 and rb.world_size == SEATS
            grow.wait(60)
            rb.reconfigure(3, SEATS, list(range(SEATS)), rendezvous=rendezvous[2], **inproc)
            assert rb.members() == list(range(SEATS))
            # Its slots are lost until the repair installs them: nothing is routed to them.
            assert routed_to(rb, 3) == 0
            rb.fill_backup(fill_backup_in_place)
            grow_step = rb.step
            regrow = serve_until_repaired(rb, list(range(SEATS)), rng, logs[SEATS], grow_step)
            results["joined"] = dict(grow=regrow, step=rb.step, routed_to_3=routed_to(rb, 3),
                                     unavailable=[rb.unavailable(layer).size
                                                  for layer in range(LAYERS)])

    def guarded(body, *args):
        try:
            body(*args)
        except BaseException as e:  # reported below, on the main thread
            errors.append(e)
            grow.set()

    threads = [threading.Thread(target=guarded, args=(member, g)) for g in range(SEATS)]
    threads.append(threading.Thread(target=guarded, args=(joiner,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]

    survivors = [results[g] for g in range(3)]
    for r in survivors:
        # Seat 3 alone held 4..7: unavailable once it left, restored by the repair.
        assert r["shrunk"] == {"unavailable": [[4, 5, 6, 7]] * LAYERS, "any": True}
        assert r["unavailable"] == [0] * LAYERS
    # Each of them restored from a backup copy at least once per layer.
    assert sum(r["shrink"]["bytes_restored"] for r in survivors) >= \
        LAYERS * 4 * (24 + 10), [r["shrink"] for r in survivors]
    # Every member (the newcomer too) ends the grow repair at the same step, routes to seat 3
    # again and has nothing unavailable.
    ends = survivors + [results["joined"]]
    assert len({(r["grow"]["trigger_step"], r["grow"]["end_step"], r["step"]) for r in ends}) == 1
    for r in ends:
        assert r["routed_to_3"] > 0 and r["unavailable"] == [0] * LAYERS
    # The members agree at every step they served together.
    for seat in range(1, SEATS + 1):
        for step, state in logs[seat].items():
            if step in logs[0]:
                assert state == logs[0][step], (seat, step)
    assert set(logs[SEATS]) <= set(logs[0])


def routed_to(rb, seat):
    """How many table entries, over all layers, name a slot of `seat` (padding -1 names none)."""
    return sum(int((rb.dispatch(layer)["log2phy"] // SPR == seat).sum())
               for layer in range(LAYERS))


# ------------------------------------------------------------------------------ one rank
def single_config(**extra):
    c = {"experts": EXPERTS, "physical": EXPERTS, "interval": 1000, "window": 4, "lag": 1,
         "timeout_ms": 20000, "backup_copies": 1}
    c.update(extra)
    return c


@pytest.mark.parametrize("backend", ["inproc", "shm"])
def test_single_rank_reconfigure_and_backup(backend):
    # shm unmaps a transport's memory when it goes: an old view reads it only if kept alive.
    if backend not in eplb.transport_backends() or backend not in eplb.control_backends():
        pytest.skip(f"no {backend} backends in this build")
    with eplb.Rebalancer(single_config(), 0, 1, control=backend, transport=backend,
                         weights=WEIGHTS, layers=LAYERS) as rb:
        assert rb.config["backup_copies"] == 1
        rb.connect()
        rb.fill_weights(expert_value)
        assert rb.members() == [0]
        np.testing.assert_array_equal(rb.backup_experts(), np.arange(EXPERTS))
        assert rb.backup_experts().dtype == np.int32
        assert rb.backup_bytes() == LAYERS * EXPERTS * (24 + 10)
        assert rb.host_bytes() > rb.bytes_held + rb.backup_bytes() - 1
        # Fill by returning the weights (as fill_weights' callback does) or in place.
        calls = []

        def fill(layer, tensor, expert, view):
            calls.append((layer, tensor, expert))
            assert view.flags.writeable
            assert view.shape == ((2, 3) if tensor == "w13" else (10,))
            return expert_value(layer, tensor, expert)
        rb.fill_backup(fill)
        assert sorted(calls) == sorted((layer, t, e) for layer in range(LAYERS)
                                       for t in ("w13", "w2") for e in range(EXPERTS))
        backup = rb.backup_weights(1, "w13", 5)
        assert backup.dtype == np.float32 and backup.shape == (2, 3)
        np.testing.assert_array_equal(backup, expert_value(1, "w13", 5))
        np.testing.assert_array_equal(rb.backup_weights(0, 1, 7), expert_value(0, "w2", 7))
        assert rb.backup_weights(0, "w13", 2, dtype=np.uint8).shape == (24,)

        before = rb.weights(1, "w2")
        before_bytes = before.copy()
        rb.step_end()
        rb.reconfigure(0, 1, [0], control=backend, transport=backend)  # a group of one
        assert rb.members() == [0] and rb.step == 1 and not rb.any_unavailable()
        # The arena and the backup moved into the new transport; old views stay readable.
        np.testing.assert_array_equal(before, before_bytes)
        for layer in range(LAYERS):
            for name in rb.tensors:
                view = rb.weights(layer, name)
                for j, e in enumerate(rb.local_experts(layer)):
                    np.testing.assert_array_equal(view[j], expert_value(layer, name, int(e)))
        np.testing.assert_array_equal(rb.backup_weights(1, "w13", 5), expert_value(1, "w13", 5))
        assert backup.shape == (2, 3) and float(backup[0, 0]) == 1051.0  # still readable
        rb.step_end()
        assert all(set(h) >= {"bytes_restored", "repair"} for h in rb.history())


def test_fill_backup_errors_propagate():
    with eplb.Rebalancer(single_config(), 0, 1, control="inproc", transport="inproc",
                         weights=WEIGHTS, layers=LAYERS) as rb:
        rb.connect()

        def broken(layer, tensor, expert, view):
            raise KeyError(f"no checkpoint for expert {expert}")
        with pytest.raises(KeyError, match="no checkpoint for expert 0"):
            rb.fill_backup(broken)
        with pytest.raises(ValueError, match="keeps no copy of expert 9"):
            rb.backup_weights(0, "w13", 9)
        with pytest.raises(ValueError, match="layer 2 is outside"):
            rb.backup_weights(2, "w13", 0)
        with pytest.raises(ValueError, match="no tensor 'w9'"):
            rb.backup_weights(0, "w9", 0)
    with eplb.Rebalancer(single_config(backup_copies=0), 0, 1, control="inproc",
                         transport="inproc", weights=WEIGHTS, layers=LAYERS) as rb:
        rb.connect()
        assert rb.backup_experts().size == 0 and rb.backup_bytes() == 0
        rb.fill_backup(lambda *args: pytest.fail("called without backups"))
        with pytest.raises(ValueError, match="keeps no backup copy"):
            rb.backup_weights(0, 0, 0)


@pytest.mark.parametrize("rank, world_size, seats, message", [
    (0, 1, [4], r"membership: member 0 has seat 4, outside \[0, 4\)"),
    (0, 2, [1, 1], "seat 1 is listed twice"),
    (0, 2, [3, 1], "this rank holds seat 1 but seats puts it .* in seat 3"),
    (0, 3, [1, 2], "seats lists 2 seats but world_size is 3"),
    (0, 5, [1, 0, 2, 3, 0], "5 seats but the layout has 4 ranks"),
    (2, 2, [1, 0], r"rank 2 is outside \[0, 1\]"),
])
def test_reconfigure_membership_errors(rank, world_size, seats, message):
    # Refused before joining anything: nobody else needs to be there.
    with eplb.Rebalancer.join(config(), 1, SEATS, weights=WEIGHTS, layers=LAYERS) as rb:
        with pytest.raises(ValueError, match=message):
            rb.reconfigure(rank, world_size, seats, control="inproc", transport="inproc",
                           rendezvous=unique("el-bad"))


def test_joining_errors():
    with pytest.raises(ValueError, match=r"joining seat 4 is outside \[0, 4\)"):
        eplb.Rebalancer.join(config(), 4, SEATS, weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match="join: give world_size"):
        eplb.Rebalancer.join(config(), 1, weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match=r"backup copies 5 is outside \[0, 4"):
        eplb.Rebalancer.join(config(backup_copies=5), 1, SEATS, weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match=r"config\['backup_copies'\] must be an integer"):
        eplb.Rebalancer.join(config(backup_copies="2"), 1, SEATS, weights=WEIGHTS, layers=LAYERS)
    with pytest.raises(ValueError, match="layers is required"):
        eplb.Rebalancer.join(config(), 1, SEATS, weights=WEIGHTS)

    rb = eplb.Rebalancer.join(dict(config(), ranks=SEATS), 2, weights=WEIGHTS, layers=LAYERS)
    with rb:
        assert rb.rank == 2 and rb.world_size == SEATS and rb.slots_per_rank == SPR
        for call in (rb.step_end, lambda: rb.weights(0, "w13"), rb.host_bytes,
                     lambda: rb.backup_weights(0, 0, 2), lambda: rb.fill_backup(print)):
            with pytest.raises(ValueError, match="built to join seat 2 and is no member yet: "
                                                 "call reconfigure"):
                call()
        with pytest.raises(ValueError, match="enters through reconfigure"):
            rb.connect()
        # A group of joiners alone has no weights to serve: refused by the library, after
        # joining; the object is still a joiner, and shuts down cleanly.
        with pytest.raises(ValueError, match="every member is joining"):
            rb.reconfigure(0, 1, [2], control="inproc", transport="inproc")
        with pytest.raises(ValueError, match="no member yet"):
            rb.step_end()
        assert rb.history() == []
