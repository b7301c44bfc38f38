"""A Rebalancer's metrics in prometheus_client, which vLLM and SGLang serve /metrics from.

    from eplb.integrations.prometheus import register
    collector = register(rb)                 # into prometheus_client.REGISTRY
    ...
    prometheus_client.REGISTRY.unregister(collector)   # before rb goes away

Each scrape collects the Rebalancer's metrics afresh (in C++, prometheus-cpp's families; the
in-flight figures brought up to date first), with the labels they carry: rank, and the
config's metric_labels. Metric names and meanings: docs/runtime.md, "Metrics".

prometheus_client is imported when this module is (Debian: python3-prometheus-client). An
engine serving /metrics from another process than the one running the Rebalancer (vLLM's API
server with PROMETHEUS_MULTIPROC_DIR) does not see collectors of the worker: serve the worker's
registry on a port of its own (``prometheus_client.start_http_server(port,
registry=...)``) or write ``rb.metrics_text()`` where the node exporter's textfile collector
reads.
"""

try:
    from prometheus_client.core import REGISTRY
    from prometheus_client.metrics_core import Metric
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError("eplb.integrations.prometheus needs prometheus_client (apt-get install "
                      "python3-prometheus-client, or pip install prometheus-client)") from e

__all__ = ["RebalancerCollector", "register"]


class RebalancerCollector:
    """A prometheus_client collector of one Rebalancer (or several: pass a list), each scrape
    reading its metrics afresh. Thread-safe: the metrics are atomic on the C++ side."""

    def __init__(self, rebalancers):
        self._rebalancers = list(rebalancers) if isinstance(rebalancers, (list, tuple)) \
            else [rebalancers]

    def collect(self):
        merged = {}
        order = []
        for rb in self._rebalancers:
            for family in rb.metric_families():
                name, kind = family["name"], family["type"]
                # prometheus_client names a counter family without its _total suffix and
                # writes the samples with it.
                base = name[:-len("_total")] if kind == "counter" and name.endswith("_total") \
                    else name
                metric = merged.get(base)
                if metric is None:
                    metric = Metric(base, family["help"], "unknown" if kind == "untyped"
                                    else kind)
                    merged[base] = metric
                    order.append(base)
                for sample, labels, value in family["samples"]:
                    metric.add_sample(sample, dict(labels), float(value))
        for base in order:
            yield merged[base]

    def describe(self):
        # No description up front: the families are only known by collecting (and registering
        # must not collect a Rebalancer that is not connected yet).
        return []


def register(rebalancers, registry=REGISTRY):
    """Registers a RebalancerCollector of `rebalancers` (one or a list) in `registry`
    (prometheus_client's default one unless given) and returns it, for unregister()."""
    collector = RebalancerCollector(rebalancers)
    registry.register(collector)
    return collector
