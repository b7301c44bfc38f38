#!/usr/bin/env python3
"""vLLM's default EPLB policy against eplb's EplbPolicy on drifting loads: the slots each
rebalance moves and the balancedness it reaches, at DeepSeek-V3's prefill layout.

    PYTHONPATH=<build>/python python3 bench/python/vllm_compare.py [--rebalances 8]
        [--sigma 0.2] [--seed 0] [--physical 288 --ranks 32 --nodes 4 --groups 8] [FILE ...]

Loads: SGLang's published DeepSeek-V3 statistics (data/deepseek-v3-sglang/*.json by default),
MoE layers only (the all-zero rows of dense layers are dropped: vLLM's window holds MoE layers).
Each run starts from the file's load and drifts it: every window's load is the last one times
lognormal(0, sigma) per layer and expert. Every policy places on the first load, then rebalances
on each later one against the placement it has in force.

Policies:
- vLLM default: vLLM's DefaultEplbPolicy restated from its published algorithm: DeepSeek's
  reference (tests/python/numpy_reference.py) on the window's load, then
  preserve_intragpu_slots against the placement in force.
- eplb EplbPolicy: eplb.integrations.vllm.EplbPolicy (balanced first, then sticky with the
  default tolerance 0.01).
- eplb balanced (fresh): eplb's balanced policy from scratch every time, for reference.

Figures per rebalance, averaged over the rebalances: the slots whose expert changes (what vLLM
moves weights into), the balancedness (mean over layers of mean / max rank load) on the load
the placement was computed from, and on the next window's load (the load it then serves).
"""

import argparse
import glob
import json
import os
import sys

import numpy as np

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(_ROOT, "tests", "python"))
import numpy_reference  # noqa: E402

import eplb  # noqa: E402
from eplb.integrations.vllm import EplbPolicy, preserve_intragpu_slots  # noqa: E402


def vllm_default(weight, physical, groups, nodes, ranks, old):
    """vLLM's DefaultEplbPolicy.rebalance_experts, restated."""
    phy2log = numpy_reference.rebalance_experts(weight, physical, groups, nodes, ranks)[0]
    return phy2log if old is None else preserve_intragpu_slots(phy2log, ranks, old)


def eplb_policy(weight, physical, groups, nodes, ranks, old):
    return EplbPolicy.rebalance_experts(weight, physical, groups, nodes, ranks, old)


def fresh_balanced(weight, physical, groups, nodes, ranks, old):
    return eplb.rebalance_experts(weight, physical, groups, nodes, ranks, policy="balanced")[0]


POLICIES = {
    "vLLM default": vllm_default,
    "eplb EplbPolicy": eplb_policy,
    "eplb balanced (fresh)": fresh_balanced,
}


def moe_rows(load):
    """The rows of a [layers, experts] load with any load (dense layers are all zero)."""
    load = np.asarray(load, dtype=np.float64)
    return load[load.sum(axis=1) > 0]


def drifting_loads(base, windows, sigma, seed):
    """`windows` loads: `base`, then each the last times lognormal(0, sigma) per entry."""
    rng = np.random.default_rng(seed)
    loads = [np.asarray(base, dtype=np.float64)]
    while len(loads) < windows:
        loads.append(loads[-1] * rng.lognormal(0.0, sigma, loads[-1].shape))
    return loads


def compare(base, physical, groups, nodes, ranks, rebalances=8, sigma=0.2, seed=0,
            policies=POLICIES):
    """Each policy places on the first of rebalances + 2 drifting loads, then rebalances on the
    next `rebalances` ones against its placement in force. Returns {policy: {"moved": fraction
    of slots changed per rebalance, "balancedness": on the load it was computed from, "next":
    on the following load}}, each a list with one float per rebalance."""
    loads = drifting_loads(base, rebalances + 2, sigma, seed)
    out = {}
    for name, place in policies.items():
        placement = place(loads[0], physical, groups, nodes, ranks, None)
        moved, balance, following = [], [], []
        for t in range(1, rebalances + 1):
            new = place(loads[t], physical, groups, nodes, ranks, placement)
            moved.append(float(np.mean(new != placement)))
            balance.append(eplb.balancedness(loads[t], new, ranks).mean)
            following.append(eplb.balancedness(loads[t + 1], new, ranks).mean)
            placement = new
        out[name] = {"moved": moved, "balancedness": balance, "next": following}
    return out


def read_load(path):
    with open(path) as f:
        return moe_rows(json.load(f)["logical_count"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="SGLang logical_count JSON files (default: "
                        "data/deepseek-v3-sglang/*.json)")
    parser.add_argument("--physical", type=int, default=288)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rebalances", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=0.2, help="lognormal drift per window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(_ROOT, "data", "deepseek-v3-sglang",
                                                        "*.json")))
    if not files:
        sys.exit("no load files given and none found in data/deepseek-v3-sglang/")

    totals = {name: {"moved": [], "balancedness": [], "next": []} for name in POLICIES}
    print(f"{args.physical} slots on {args.ranks} ranks, {args.nodes} nodes, {args.groups} "
          f"groups; {args.rebalances} rebalances, drift lognormal(0, {args.sigma}), seed "
          f"{args.seed}\n")
    header = "| load | policy | slots moved / rebalance | balancedness | next window |"
    print(header)
    print("|---|---|---:|---:|---:|")
    for path in files:
        load = read_load(path)
        result = compare(load, args.physical, args.groups, args.nodes, args.ranks,
                         args.rebalances, args.sigma, args.seed)
        for name, r in result.items():
            for key in totals[name]:
                totals[name][key] += r[key]
            print(f"| {os.path.basename(path)} | {name} | {100 * np.mean(r['moved']):.1f}% | "
                  f"{np.mean(r['balancedness']):.4f} | {np.mean(r['next']):.4f} |")
    print(f"\nAll {len(files)} files ({load.shape[0]} MoE layers x {load.shape[1]} experts "
          f"each):\n")
    print("| policy | slots moved / rebalance (max) | balancedness (min) | next window |")
    print("|---|---:|---:|---:|")
    for name, r in totals.items():
        print(f"| {name} | {100 * np.mean(r['moved']):.1f}% ({100 * np.max(r['moved']):.1f}%) "
              f"| {np.mean(r['balancedness']):.4f} ({np.min(r['balancedness']):.4f}) | "
              f"{np.mean(r['next']):.4f} |")


if __name__ == "__main__":
    main()
