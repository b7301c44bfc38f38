"""A Rebalancer's metrics from Python: rb.metrics(), rb.metrics_text() read by prometheus_client's
own parser, and eplb.integrations.prometheus serving them through prometheus_client."""

import os
import threading
import uuid

import numpy as np
import pytest

import eplb

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

EXPERTS, PHYSICAL, LAYERS = 8, 12, 3
WEIGHTS = [("w", 16)]


def serve_two_ranks(steps=24, until_completed=False, **extra):
    """Two rank threads serving a skewed load with rebalances every 4 steps; returns both
    Rebalancers, shut down (their metrics stay readable). With until_completed, serving goes on
    past `steps` (by whole intervals, the same on both ranks) until both have completed a
    rebalance: how fast the worker runs is the machine's business, not the test's."""
    cfg = {"experts": EXPERTS, "physical": PHYSICAL, "interval": 4, "window": 4, "lag": 1,
           "timeout_ms": 20000, "policy": "balanced", "balancedness_period": 4}
    cfg.update(extra)
    rendezvous = f"prom-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    out, errors = [None, None], []
    done, barrier = [False, False], threading.Barrier(2, timeout=60)

    def body(rank):
        try:
            rb = eplb.Rebalancer(cfg, rank, 2, control="inproc", transport="inproc",
                                 rendezvous=rendezvous, weights=WEIGHTS, layers=LAYERS)
            rb.connect()
            counts = np.ones(EXPERTS, dtype=np.int64)
            counts[:3] = 60
            step = 0
            while True:
                for layer in range(LAYERS):
                    rb.record_counts(layer, counts)
                rb.step_end()
                step += 1
                if step < steps or step % 4 != 0:
                    continue
                if not until_completed or step >= 4000:
                    break
                done[rank] = any(h["outcome"] == "completed" for h in rb.history())
                barrier.wait()  # both decided ...
                both = all(done)
                barrier.wait()  # ... and read before either decides again
                if both:
                    break
            rb.shutdown()
            out[rank] = rb
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_metrics_dict_text_and_collector():
    rbs = serve_two_ranks(until_completed=True, metric_labels={"model": "tiny-moe"})
    for rank, rb in enumerate(rbs):
        m = rb.metrics()
        completed = sum(1 for h in rb.history() if h["outcome"] == "completed")
        assert completed >= 1
        assert m["eplb_rebalances_total"]["completed"] == completed
        assert m["eplb_steps_total"] == rb.step >= 24
        assert m["eplb_rebalance_in_flight"] == 0
        assert m["eplb_rebalance_phase"]["idle"] == 1
        assert set(m["eplb_bytes_moved_total"]) == {"intra_node", "inter_node", "local_copy"}
        for source in ("recorded", "predicted_before", "predicted_after"):
            assert 0 < m["eplb_balancedness"][source] <= 1, source
        stall = m["eplb_forward_stall_seconds"]
        assert stall["count"] > 0 and stall["buckets"][float("inf")] == stall["count"]
        assert m["eplb_bytes_held"] == rb.bytes_held > 0

        # The text exposition, as Prometheus (and prometheus_client's parser) reads it.
        fams = {f.name: f for f in text_string_to_metric_families(rb.metrics_text())}
        assert fams["eplb_rebalances"].type == "counter"
        samples = [s for s in fams["eplb_rebalances"].samples
                   if s.labels.get("outcome") == "completed"]
        assert samples[0].value == completed
        assert samples[0].labels["rank"] == str(rank) and samples[0].labels["model"] == "tiny-moe"

    # Both ranks through prometheus_client, as vLLM and SGLang serve /metrics.
    from eplb.integrations.prometheus import register
    registry = prometheus_client.CollectorRegistry()
    register(rbs, registry=registry)
    text = prometheus_client.generate_latest(registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ranks = {s.labels["rank"] for s in fams["eplb_steps"].samples}
    assert ranks == {"0", "1"}
    assert registry.get_sample_value("eplb_steps_total",
                                     {"rank": "1", "model": "tiny-moe"}) == rbs[1].step
    hist = [s for s in fams["eplb_forward_stall_seconds"].samples if s.name.endswith("_count")]
    assert len(hist) == 2
    moved = sum(s.value for s in fams["eplb_bytes_moved"].samples)
    assert moved > 0


def test_metric_settings_are_checked():
    base = {"experts": EXPERTS, "physical": EXPERTS}
    for bad, message in [({"stall_warn_ms": -1}, "stall_warn"),
                         ({"balancedness_period": -5}, "balancedness_period"),
                         ({"metric_labels": {"rank": "x"}}, "rank"),
                         ({"metric_labels": ["model"]}, "metric_labels"),
                         ({"metric_labels": {"model": 3}}, "metric_labels")]:
        with pytest.raises(eplb.InvalidArgument, match=message):
            eplb.Rebalancer({**base, **bad}, 0, 1, control="inproc", transport="inproc",
                            rendezvous=f"bad-{uuid.uuid4().hex[:8]}", weights=WEIGHTS,
                            layers=LAYERS)


def test_save_stats_in_every_format(tmp_path):
    (rb, _) = serve_two_ranks(steps=5)
    for fmt in ("eplb", "sglang", "vllm", "csv"):
        path = tmp_path / f"load.{fmt}"
        rb.save_stats(path, fmt)
        assert path.stat().st_size > 0
    with pytest.raises(eplb.InvalidArgument, match="trace"):
        rb.save_stats(tmp_path / "x", "trace")
