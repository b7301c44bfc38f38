#!/usr/bin/env python3
"""eplb's migration schedules beside vLLM's migration scheduler, on the same moves: link time on
vLLM's contention model, rounds, and the time to schedule, measured in the same run.

    PYTHONPATH=<build>/python python3 bench/python/vllm_migration_compare.py \\
        --vllm <vLLM source tree, or its vllm/distributed/eplb/migration_scheduler.py> \\
        [--ranks 32 --nodes 4 --physical 288 --groups 8] [--chain FILE,FILE,... ...]

vLLM's scheduler is read from the path given (vLLM 0.34 and later; its source distribution has
it): nothing of vLLM is part of eplb.

Moves: DeepSeek's placement (eplb.rebalance_experts, policy "deepseek") computed afresh on each
load file of a chain in turn, and the experts each rank gains between consecutive placements,
layer by layer (MoE layers: the all-zero rows of dense layers are dropped). Default chains, from
SGLang's published DeepSeek-V3 statistics in data/deepseek-v3-sglang/: "prefill" (in512, in1024,
in2048, in4096, in1000out1000) and "mixed" (in500out1500, in1800out100, in2000out100,
in1000out1000).

Schedules:
- vLLM: its schedule_migration_batches (first-fit of coalesced rank-pair flows).
- eplb half duplex: eplb.plan_migration(..., peers_per_round=1, half_duplex=True), vLLM's model:
  a rank talks to one peer per round, both directions together.
- eplb drop-in: eplb.integrations.vllm.schedule_migration_batches, what vLLM runs with
  EPLB_VLLM_SCHEDULER=eplb (half duplex, on one node: sources are not kept on the reader's node).
- eplb duplex: eplb.plan_migration(..., peers_per_round=1), the duplex model: a rank reads from
  one peer while it serves another. Its rounds and link time are of that model, not vLLM's.

Columns, summed over the layers of every transition: transfers (one per expert a rank gains);
rounds (vLLM: batches); link time (the sum over rounds of the largest flow between two ranks, in
experts: a vLLM batch lasts as long as its largest flow; duplex: the largest flow one way);
bound (per layer, the most transfers one rank takes part in under the schedule's own sources:
in plus out, or for duplex the larger of in and out); the link time against vLLM's, and the
layers where it is longer than vLLM's; the CPU time to schedule every layer against vLLM's
schedule_migration_batches_for_layers (best of --repeat runs). Last, the duplex schedule's rounds
beside their lower bound (eplb keeps them at it), summed over every layer.
"""

import argparse
import collections
import importlib.util
import json
import os
import sys
import time

import numpy as np

import eplb
from eplb.integrations import vllm_scheduler

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_DATA = os.path.join(_ROOT, "data", "deepseek-v3-sglang")
CHAINS = {
    "prefill": ["prefill_in512", "prefill_in1024", "prefill_in2048", "prefill_in4096",
                "prefill_in1000out1000"],
    "mixed": ["prefill_in500out1500", "prefill_in1800out100", "prefill_in2000out100",
              "prefill_in1000out1000"],
}


def load_vllm(path):
    """vLLM's migration_scheduler module, from the file or a vLLM source tree."""
    if os.path.isdir(path):
        path = os.path.join(path, "vllm", "distributed", "eplb", "migration_scheduler.py")
    if not os.path.isfile(path):
        sys.exit(f"no vLLM migration scheduler at {path} (vLLM 0.34 and later has "
                 f"vllm/distributed/eplb/migration_scheduler.py)")
    spec = importlib.util.spec_from_file_location("vllm_migration_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_load(path):
    with open(path) as f:
        load = np.asarray(json.load(f)["logical_count"], dtype=np.float64)
    return load[load.sum(axis=1) > 0]


def batches_figures(batches):
    """(transfers, rounds, link time, bound, flows per round ok) of vLLM-style batches."""
    transfers = link = 0
    degree = collections.Counter()
    ok = True
    for batch in batches:
        busy = set()
        for f in batch:
            ok &= f.src_rank not in busy and f.dst_rank not in busy
            busy |= {f.src_rank, f.dst_rank}
            transfers += len(f.expert_ids)
            degree[f.src_rank] += len(f.expert_ids)
            degree[f.dst_rank] += len(f.expert_ids)
        link += max(len(f.expert_ids) for f in batch)
    return transfers, len(batches), link, max(degree.values(), default=0), ok


def plan_figures(layer, half_duplex):
    """The same figures from one layer of eplb.plan_migration, checked apart from the plan's
    own: in half duplex a rank has one flow per round (a peer it reads from or serves)."""
    r = layer["reads"]
    ok = True
    if half_duplex:
        for k in np.unique(r["round"]):
            m = r["round"] == k
            flows = set(zip(r["src_rank"][m].tolist(), r["dst_rank"][m].tolist()))
            ends = [g for f in flows for g in f]
            ok &= len(ends) == len(set(ends))
    return (len(r["round"]), layer["rounds"], layer["link_time"],
            layer["link_time_lower_bound"], ok)


def best_time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", required=True,
                        help="vLLM's source tree, or its migration_scheduler.py")
    parser.add_argument("--chain", action="append", default=[],
                        help="comma-separated load files, placed in turn (repeatable; default: "
                             "the prefill and mixed chains of data/deepseek-v3-sglang)")
    parser.add_argument("--physical", type=int, default=288)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    vllm = load_vllm(args.vllm)
    chains = {f"chain {i}": c.split(",") for i, c in enumerate(args.chain)} or {
        name: [os.path.join(_DATA, f + ".json") for f in files] for name, files in CHAINS.items()}
    local = args.physical // args.ranks
    names = ["vLLM", "eplb half duplex", "eplb drop-in", "eplb duplex"]
    print(f"{args.physical} slots on {args.ranks} ranks, {args.nodes} nodes, {args.groups} "
          f"groups; deepseek placed afresh on each load file\n")
    print("| chain | schedule | transfers | rounds | link time | bound | vs vLLM | "
          "layers longer than vLLM | time to schedule vs vLLM |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    grand = {n: np.zeros(4, dtype=np.int64) for n in names}
    duplex_rounds = np.zeros(3, dtype=np.int64)  # rounds, their lower bound, layers at it
    total_layers = 0
    valid = True
    for chain, files in chains.items():
        loads = [read_load(f) for f in files]
        sums = {n: np.zeros(4, dtype=np.int64) for n in names}
        longer = collections.Counter()
        seconds = collections.Counter()
        layers = 0
        for a, b in zip(loads, loads[1:]):
            old = np.asarray(eplb.rebalance_experts(a, args.physical, args.groups, args.nodes,
                                                    args.ranks)[0])
            new = np.asarray(eplb.rebalance_experts(b, args.physical, args.groups, args.nodes,
                                                    args.ranks)[0])
            runs = {
                "vLLM": lambda: vllm.schedule_migration_batches_for_layers(local, old, new),
                "eplb half duplex": lambda: eplb.plan_migration(
                    old, new, args.ranks, args.nodes, 1, 1, half_duplex=True),
                "eplb drop-in": lambda: vllm_scheduler.schedule_migration_batches_for_layers(
                    local, old, new),
                "eplb duplex": lambda: eplb.plan_migration(old, new, args.ranks, args.nodes, 1, 1),
            }
            out = {n: fn() for n, fn in runs.items()}
            for n, fn in runs.items():
                seconds[n] += best_time(fn, args.repeat)
            for li in range(old.shape[0]):
                figures = {
                    "vLLM": batches_figures(out["vLLM"][li]),
                    "eplb half duplex": plan_figures(out["eplb half duplex"]["layers"][li], True),
                    "eplb drop-in": batches_figures(out["eplb drop-in"][li]),
                    "eplb duplex": plan_figures(out["eplb duplex"]["layers"][li], False),
                }
                for n, (transfers, rounds, link, bound, ok) in figures.items():
                    if not ok or transfers != figures["vLLM"][0]:
                        valid = False
                        print(f"{chain}: layer {li}: {n} moves {transfers} experts (vLLM "
                              f"{figures['vLLM'][0]}) or has a rank with two flows in a round")
                    sums[n] += (transfers, rounds, link, bound)
                    longer[n] += n != "eplb duplex" and link > figures["vLLM"][2]
                duplex = out["eplb duplex"]["layers"][li]
                duplex_rounds += (duplex["rounds"], duplex["rounds_lower_bound"],
                                  duplex["rounds"] == duplex["rounds_lower_bound"])
                layers += 1
        total_layers += layers
        for n in names:
            transfers, rounds, link, bound = sums[n].tolist()
            vs = link / max(sums["vLLM"][2], 1)
            t = seconds[n] / max(seconds["vLLM"], 1e-9)
            worse = "" if n in ("vLLM", "eplb duplex") else f"{longer[n]} of {layers}"
            print(f"| {chain} | {n} | {transfers} | {rounds} | {link} | {bound} | {vs:.3f}x | "
                  f"{worse} | {t:.2f}x |")
            grand[n] += sums[n]
    print()
    v = grand["vLLM"][2]
    for n in names[1:3]:
        link, bound = grand[n][2], grand[n][3]
        print(f"{n}: link time {link / v:.3f}x vLLM's, {link / max(bound, 1):.3f}x its per-rank "
              f"bound (vLLM: {v / max(grand['vLLM'][3], 1):.3f}x its own)")
    rounds, rounds_bound, at_bound = duplex_rounds.tolist()
    print(f"eplb duplex: {rounds} rounds, lower bound {rounds_bound} (no schedule of "
          f"these reads has fewer), at it on {at_bound} of {total_layers} layers")
    if not valid:
        sys.exit("a schedule broke the contract (see above)")


if __name__ == "__main__":
    main()
