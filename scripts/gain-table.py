#!/usr/bin/python3
"""A rebalance only when it pays, on real loads: `eplb simulate --min-gain` 0 and 1 on
DeepSeek-V3's expert loads, stationary and drifting, and the table docs/dispatch.md shows
("A rebalance only when it pays").

The workloads, 6 MoE layers (layers 3-8 of SGLang's published DeepSeek-V3 statistics), --tokens
token-expert choices per layer and step (default 2048, a decode batch of 256 tokens) drawn from
the loads (multinomial, seed 7), 200 steps:
  stationary  every step from prefill_in1024.json's loads
  drifting    step t from the mixture (1 - t/199) prefill_in512 + (t/199) prefill_in4096: the
              hot experts move from one workload's to the other's over the run
  shifting    prefill_in1024's loads, the expert ids rotated by half the experts from step 100 on:
              the hot experts become others at once (a new kind of traffic)
Each is replayed on 8 ranks with 8 redundant slots, a rebalance every 20 steps from the last 20,
under a cost model (default the h100-v3-decode preset; --cost for another), with min_gain 0
(every rebalance) and 1 (only those whose modeled gain over the next 20 steps reaches their
price, the bytes at 100 GB/s per rank), and prints per workload, policy and min_gain the
rebalances done, the bytes they moved after the first, and the modeled MoE time per step of the
adaptive dispatch.

  scripts/gain-table.py --eplb build/src/cli/eplb [--cost MODEL] [--policy sticky,balanced]
      [--tokens N]

A tool, not part of the library: it needs numpy.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "deepseek-v3-sglang")


def shares(name):
    w = np.array(json.load(open(os.path.join(DATA, name)))["logical_count"], dtype=float)[3:9]
    return w / w.sum(axis=1, keepdims=True)


def history(path, mixture, tokens, steps=200, seed=7):
    rng = np.random.default_rng(seed)
    out = [{"logical_expert_load": [rng.multinomial(tokens, row).tolist() for row in mixture(t)]}
           for t in range(steps)]
    with open(path, "w") as f:
        json.dump({"load_history": out}, f)


def simulate(eplb, path, cost, policies, min_gain):
    cmd = [eplb, "simulate", "--load-history", path, "--ranks", "8", "--redundant", "8",
           "--interval", "20", "--window", "20", "--policy", policies, "--dispatch", "adaptive",
           "--cost", cost, "--min-gain", str(min_gain), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eplb", default=os.path.join(ROOT, "build", "src", "cli", "eplb"))
    parser.add_argument("--cost", default="h100-v3-decode")
    parser.add_argument("--policy", default="sticky,balanced")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    stationary, a, b = shares("prefill_in1024.json"), shares("prefill_in512.json"), \
        shares("prefill_in4096.json")
    with tempfile.TemporaryDirectory() as tmp:
        workloads = {
            "stationary": (os.path.join(tmp, "stationary.json"), lambda t: stationary),
            "drifting": (os.path.join(tmp, "drifting.json"),
                         lambda t: (1 - t / 199) * a + (t / 199) * b),
            "shifting": (os.path.join(tmp, "shifting.json"),
                         lambda t: stationary if t < 100 else np.roll(
                             stationary, stationary.shape[1] // 2, axis=1)),
        }
        print(f"cost model {args.cost}; {args.tokens} token-expert choices per layer and step; "
              f"8 ranks, 8 redundant slots, interval and window 20; bytes after the first "
              f"rebalance")
        print("| workload | policy | min_gain | rebalances done | bytes moved | modeled MoE "
              "ms/step |")
        print("|---|---|---|---|---|---|")
        for name, (path, mixture) in workloads.items():
            history(path, mixture, args.tokens)
            runs = {g: simulate(args.eplb, path, args.cost, args.policy, g) for g in (0, 1)}
            for policy in args.policy.split(","):
                for g, d in runs.items():
                    r = d["results"][policy]
                    moved = sum(r["bytes"][1:])
                    modeled = r["dispatch"]["adaptive"]["modeled_ms"]
                    print(f"| {name} | {policy} | {g} | {r['rebalances_done']} of "
                          f"{r['rebalances']} | {moved / 1e9:.2f} GB | {modeled:.4f} |")


if __name__ == "__main__":
    main()
