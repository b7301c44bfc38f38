#!/usr/bin/python3
"""The best balancedness any placement can reach at two slots per rank, per layer, by an integer
program: how far `balanced` and eplb's reported lower bound are from it (docs/placement.md, "Two
slots per rank at 144 ranks").

At two slots per rank a rank carries two replicas, and for given replica counts the best packing
is the sorted pairing: a largest rank load T is reachable with counts r_e (sum 2 * ranks) only if,
for every level t above T / 2, the replicas of load >= t are no more than those of load <= T - t
(each needs its own partner that light). This program chooses the counts exactly (one binary per
expert and count, HiGHS through scipy) under those conditions, bisecting on T. Replicas lighter
than T minus the heaviest possible replica partner anything, so counts past that point are one
shared "spare light replica" variable: the program is exact, not truncated. It ignores that a
rank's two replicas must be of two experts, so its optimum is an upper bound on every placement's
balancedness; where `balanced` reaches it, `balanced` is optimal.

A tool, not part of the library: it needs scipy (Debian's python3-scipy, which
scripts/install-deps.sh installs for its test, tests/cli/two_slots_exact_test.sh) and takes
seconds to minutes per layer.

  scripts/two-slots-exact.py --load data.json --ranks 144 --eplb build/src/cli/eplb \
      --layers 3,10,20 [--json]
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
    import scipy.sparse as sparse
    from scipy.optimize import Bounds, LinearConstraint, milp
except ImportError as err:  # pragma: no cover - depends on the machine
    sys.exit(f"two-slots-exact: needs numpy and scipy ({err}); on Debian: apt-get install python3-scipy")


def read_load(path):
    """[layers][experts] loads from eplb's {"load": ...} or SGLang's {"logical_count": ...}
    (summed over steps when it has them)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        sys.exit(f"two-slots-exact: --load {path}: {err}")
    for key in ("load", "logical_count"):
        if isinstance(doc, dict) and key in doc:
            w = np.asarray(doc[key], dtype=float)
            if w.ndim == 3:
                w = w.sum(axis=0)
            if w.ndim != 2:
                sys.exit(f"two-slots-exact: {path}: '{key}' has {w.ndim} dimensions, expected "
                         "[layers][experts] or [steps][layers][experts]")
            return w
    sys.exit(f"two-slots-exact: {path}: no 'load' or 'logical_count' key (convert other formats "
             "with `eplb convert`)")


def reachable(w, ranks, T, time_limit):
    """True when counts with a sorted pairing of largest pair <= T may exist; False when the
    program proves none do. A solver that runs out of time answers True (never claims more
    than it proved)."""
    slots = 2 * ranks
    experts = len(w)
    least = np.maximum(1, np.ceil(w / T - 1e-12)).astype(int)
    if least.sum() > slots:
        return False
    heaviest = float(np.max(w / least))
    spare = T - heaviest  # a replica this light partners any replica
    most = slots - (experts - 1)
    cols_e, cols_r, vals = [], [], []
    for e in range(experts):
        top = most
        if w[e] == 0:
            top = least[e]
        elif spare > 0:
            top = min(most, max(least[e], math.ceil(w[e] / spare - 1e-12)))
        for r in range(least[e], top + 1):
            cols_e.append(e)
            cols_r.append(r)
            vals.append(w[e] / r)
    n = len(vals)
    vals = np.asarray(vals)
    rs = np.asarray(cols_r, dtype=float)
    # Columns: one binary per (expert, count), then the spare light replicas (integer >= 0).
    one = sparse.csr_matrix((np.ones(n), (cols_e, np.arange(n))), shape=(experts, n + 1))
    total = sparse.csr_matrix(np.append(rs, 1.0))
    levels = np.unique(vals[vals > T / 2])
    rows = []
    for t in levels:
        rows.append(np.append(rs * ((vals >= t).astype(float) - (vals <= T - t).astype(float)), -1.0))
    cons = [LinearConstraint(one, 1, 1), LinearConstraint(total, slots, slots)]
    if rows:
        cons.append(LinearConstraint(sparse.csr_matrix(np.array(rows)), -np.inf, 0))
    upper = np.append(np.ones(n), slots)
    res = milp(c=np.zeros(n + 1), constraints=cons, integrality=np.ones(n + 1),
               bounds=Bounds(0, upper), options={"time_limit": time_limit})
    if res.status == 2:  # infeasible: proven
        return False
    return True


def best_balancedness(w, ranks, low, high, precision, time_limit):
    """Bisection on balancedness between `low` (reached by a placement) and `high` (a bound):
    returns (lo, hi) with hi proven: no placement's balancedness exceeds it."""
    mean = w.sum() / ranks
    # The given bound is printed rounded: the program checks it one step above.
    lo, hi = low, min(1.0, max(high, low) + precision)
    if hi < 1.0 and reachable(w, ranks, mean / hi, time_limit):
        hi = 1.0  # the given bound did not hold up under the program: search all of it
    while hi - lo > precision:
        mid = 0.5 * (lo + hi)
        if reachable(w, ranks, mean / mid, time_limit):
            lo = mid
        else:
            hi = mid
    return lo, hi


def eplb_figures(eplb, load, ranks):
    """`balanced`'s balancedness and eplb's reported bound per layer, from `eplb plan`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "placement.json")
        try:
            proc = subprocess.run([eplb, "plan", "--load", load, "--ranks", str(ranks),
                                   "--physical", str(2 * ranks), "--policy", "balanced", "-o", out],
                                  capture_output=True, text=True)
        except OSError as err:
            sys.exit(f"two-slots-exact: --eplb {eplb}: {err}")
        if proc.returncode != 0:
            sys.exit(f"two-slots-exact: eplb plan failed: {proc.stderr.strip()}")
        with open(out) as f:
            placement = json.load(f)
    bound = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[1] != "dense":
            bound[int(parts[0])] = float(parts[2])
    return placement["phy2log"], bound


def layer_balancedness(w, phy2log, ranks):
    count = np.bincount(phy2log, minlength=len(w))
    per_slot = w[phy2log] / count[phy2log]
    rank_load = per_slot.reshape(ranks, -1).sum(axis=1)
    return rank_load.mean() / rank_load.max()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", required=True, help="eplb JSON {\"load\"} or SGLang logical_count JSON")
    ap.add_argument("--ranks", type=int, required=True, help="ranks; slots are 2 x ranks")
    ap.add_argument("--eplb", required=True, help="the eplb binary (for balanced and its bound)")
    ap.add_argument("--layers", default="all", help="comma-separated layer indices, or all")
    ap.add_argument("--precision", type=float, default=1e-4, help="balancedness step of the bisection")
    ap.add_argument("--time-limit", type=float, default=300, help="seconds per integer program")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    if args.ranks < 1:
        sys.exit(f"two-slots-exact: --ranks {args.ranks}: must be >= 1")
    if not 0 < args.precision < 0.1:
        sys.exit(f"two-slots-exact: --precision {args.precision}: must lie in (0, 0.1)")
    w_all = read_load(args.load)
    if w_all.shape[1] > 2 * args.ranks:
        sys.exit(f"two-slots-exact: {w_all.shape[1]} experts do not fit {2 * args.ranks} slots")
    phy2log, bound = eplb_figures(args.eplb, args.load, args.ranks)
    moe = [l for l in range(w_all.shape[0]) if w_all[l].sum() > 0]
    if not moe:
        sys.exit(f"two-slots-exact: {args.load}: every layer has zero load (nothing to place)")
    if args.layers == "all":
        layers = moe
    else:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            sys.exit(f"two-slots-exact: --layers {args.layers!r}: expected indices like 3,10,20 or all")
        bad = [l for l in layers if l not in moe]
        if bad:
            sys.exit(f"two-slots-exact: --layers: {bad} are not MoE layers of {args.load} "
                     f"(MoE layers: {moe[0]}..{moe[-1]})")
    rows = []
    if not args.json:
        print(f"{'layer':>5} {'balanced':>9} {'optimum <=':>11} {'eplb bound':>11} {'seconds':>8}")
    for l in layers:
        w = w_all[l]
        start = time.monotonic()
        got = layer_balancedness(w, np.asarray(phy2log[l]), args.ranks)
        lo, hi = best_balancedness(w, args.ranks, got, bound.get(l, 1.0), args.precision,
                                   args.time_limit)
        row = {"layer": l, "balanced": got, "optimum_at_most": hi, "eplb_bound": bound.get(l),
               "seconds": time.monotonic() - start}
        rows.append(row)
        if not args.json:
            print(f"{l:5d} {got:9.4f} {hi:11.4f} {bound.get(l, float('nan')):11.4f} "
                  f"{row['seconds']:8.1f}", flush=True)
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    summary = {"layers": len(rows), "balanced": mean("balanced"),
               "optimum_at_most": mean("optimum_at_most"), "eplb_bound": mean("eplb_bound"),
               "gap_to_optimum_at_most": mean("optimum_at_most") - mean("balanced"),
               "gap_to_eplb_bound": mean("eplb_bound") - mean("balanced")}
    if args.json:
        print(json.dumps({"rows": rows, "mean": summary}, indent=1))
    else:
        print(f"mean over {len(rows)} layers: balanced {summary['balanced']:.4f}, optimum at most "
              f"{summary['optimum_at_most']:.4f} (gap {summary['gap_to_optimum_at_most']:.4f}), eplb "
              f"bound {summary['eplb_bound']:.4f} (gap {summary['gap_to_eplb_bound']:.4f})")


if __name__ == "__main__":
    main()
