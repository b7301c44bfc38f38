"""What a Rebalancer reports: its history, state, recorded window and metrics. A part of
``eplb.Rebalancer`` (runtime.py), kept apart to keep that file readable; the methods read the
C++ runtime's copies, so any thread may call them."""

import os


class _Reports:
    """history(), stats(), save_stats() and the metrics of ``eplb.Rebalancer``."""

    def history(self):
        """One dict per rebalance so far: index, trigger_step, end_step, outcome ("completed",
        "skipped", "failed", "cancelled"), error, placement_ms, balancedness_before/after,
        layers_moved, layers_installed, slots_moved, bytes_intra_node, bytes_inter_node,
        bytes_local_copy, rounds, bytes_installed, bytes_restored (bytes this rank restored
        from a backup copy), repair (True for the rebalance a reconfigure() started),
        proposed (True for one that installs a placement given to propose()), steps,
        seconds, stall_total_ms, stall_max_ms (the forward thread's time in step_end less
        the time it waited for a core), stall_preempted_ms (that wait), bytes_read and
        read_ms (this rank's remote reads and their time: its pull bandwidth), and config
        "min_gain"'s check: gain_checked, below_min_gain (skipped for it), priced,
        moe_us_before / moe_us_after (the modeled MoE time per step with the placement in
        force and the new one), gain_us (over the next interval) and price_us."""
        return self._rt.history()

    def stats(self):
        """State and history: rank, step, rebalancing, installed_layers, control_broken,
        bytes_held, and "history" (see history())."""
        state = self._rt.state()
        state["history"] = self._rt.history()
        return state

    def save_stats(self, path, format="eplb"):
        """Writes the recorded window ([steps][layers][experts]) as eplb's load JSON ("eplb"),
        SGLang's logical_count ("sglang"), vLLM's load_history ("vllm") or a CSV matrix of the
        window's sum ("csv"); it can seed a later run's placement (``eplb plan --load``)."""
        self._rt.save_stats(os.fspath(path), str(format))

    def metrics(self):
        """The metrics now, as a dict by metric name (docs/runtime.md, "Metrics"), without the
        labels every sample of this Rebalancer has (rank and config["metric_labels"]):

        - a metric with one series: its value, e.g. ``m["eplb_steps_total"]``;
        - one with one more label: a dict by that label's value, e.g.
          ``m["eplb_rebalances_total"]["completed"]``, ``m["eplb_balancedness"]["recorded"]``;
        - a histogram: ``{"count", "sum", "buckets": {upper bound: cumulative count}}``.

        ``metrics_text()`` is the same as a Prometheus text exposition, and
        ``eplb.integrations.prometheus`` serves it through prometheus_client."""
        own = {"rank"} | set(self._config.get("metric_labels", {}))
        out = {}
        for family in self._rt.metric_families():
            name, kind = family["name"], family["type"]
            if kind == "histogram":
                hist = {"count": 0.0, "sum": 0.0, "buckets": {}}
                for sample, labels, value in family["samples"]:
                    if sample.endswith("_bucket"):
                        le = labels["le"]
                        hist["buckets"][float("inf") if le == "+Inf" else float(le)] = value
                    elif sample.endswith("_count"):
                        hist["count"] = value
                    elif sample.endswith("_sum"):
                        hist["sum"] = value
                out[name] = hist
                continue
            series = {}
            for sample, labels, value in family["samples"]:
                rest = tuple(v for k, v in sorted(labels.items()) if k not in own)
                series[rest[0] if len(rest) == 1 else rest] = value
            out[name] = series[()] if list(series) == [()] else series
        return out

    def metrics_text(self):
        """The metrics now in the Prometheus text exposition format (what /metrics serves)."""
        return self._rt.metrics_text()

    def metric_families(self):
        """The metrics now as families: [{"name", "help", "type", "samples": [(sample name,
        labels dict, value)]}], the samples as the text exposition names them."""
        return self._rt.metric_families()
