#!/usr/bin/env bash
# scripts/two-slots-exact.py against exhaustive search on small layers: its optimum is never below
# what a placement reaches (every count vector with every pairing of two different experts per
# rank), equals the best sorted pairing over all counts (the relaxation it solves) within its
# precision, and never below `balanced` or above eplb's reported bound. Skipped (77) where scipy
# is missing: the script is a tool, not a dependency (docs/placement.md).
# Usage: two_slots_exact_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
py=/usr/bin/python3
$py -c "import scipy.optimize, numpy" 2>/dev/null || { echo "SKIP: no scipy for $py"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$py - "$eplb" "$src/scripts/two-slots-exact.py" "$tmp" <<'PY'
import itertools, json, random, subprocess, sys
eplb, tool, tmp = sys.argv[1:]
rng = random.Random(7)
failures = 0

def compositions(total, parts):
    for cut in itertools.combinations(range(1, total), parts - 1):
        b = (0,) + cut + (total,)
        yield [b[i + 1] - b[i] for i in range(parts)]

def matchings(items):
    if not items:
        yield []
        return
    a = items[0]
    for i in range(1, len(items)):
        for rest in matchings(items[1:i] + items[i + 1:]):
            yield [(a, items[i])] + rest

def brute(w, ranks):
    """(best sorted pairing over all counts, best placement with two different experts a rank)"""
    mean = sum(w) / ranks
    relaxed = placed = float("inf")
    for r in compositions(2 * ranks, len(w)):
        reps = sorted((w[e] / r[e] for e in range(len(w)) for _ in range(r[e])), reverse=True)
        relaxed = min(relaxed, max(reps[k] + reps[-1 - k] for k in range(ranks)))
        if max(r) > ranks:
            continue
        items = [(e, w[e] / r[e]) for e in range(len(w)) for _ in range(r[e])]
        for m in matchings(items):
            if all(a[0] != b[0] for a, b in m):
                placed = min(placed, max(a[1] + b[1] for a, b in m))
    return mean / relaxed, mean / placed

layers = []
for case in range(6):
    experts = rng.choice([4, 5, 6])
    layers.append([round(rng.lognormvariate(0, 1) * 100, 3) for _ in range(experts)] + [0.0] * (6 - experts))
# Shapes: 6 experts (zero loads pad the narrower cases) on 4 ranks (8 slots).
ranks = 4
json.dump({"load": layers}, open(f"{tmp}/load.json", "w"))
out = subprocess.run([tool, "--load", f"{tmp}/load.json", "--ranks", str(ranks), "--eplb", eplb,
                      "--precision", "1e-4", "--json"], capture_output=True, text=True)
if out.returncode != 0:
    print("FAIL: two-slots-exact exited", out.returncode, out.stderr)
    sys.exit(1)
rows = json.loads(out.stdout)["rows"]
if len(rows) != len(layers):
    print(f"FAIL: {len(rows)} rows for {len(layers)} layers"); sys.exit(1)
for row, w in zip(rows, layers):
    relaxed, placed = brute(w, ranks)
    l, hi = row["layer"], row["optimum_at_most"]
    if hi < placed - 1e-9:
        print(f"FAIL: layer {l}: optimum at most {hi:.5f} but a placement reaches {placed:.5f}"); failures += 1
    if abs(hi - relaxed) > 2e-4:
        print(f"FAIL: layer {l}: optimum at most {hi:.5f}, exhaustive relaxation {relaxed:.5f}"); failures += 1
    if row["balanced"] > hi + 1e-9 or row["eplb_bound"] < hi - 2e-4:
        print(f"FAIL: layer {l}: balanced {row['balanced']:.5f}, optimum {hi:.5f}, "
              f"eplb bound {row['eplb_bound']:.5f} out of order"); failures += 1
    print(f"layer {l}: loads {w}: balanced {row['balanced']:.4f}, optimum <= {hi:.4f} "
          f"(exhaustive: {relaxed:.4f} relaxed, {placed:.4f} placed), eplb bound {row['eplb_bound']:.4f}")
# Bad input names the value.
bad = subprocess.run([tool, "--load", f"{tmp}/load.json", "--ranks", "2", "--eplb", eplb],
                     capture_output=True, text=True)
if bad.returncode == 0 or "do not fit 4 slots" not in bad.stderr:
    print("FAIL: 6 experts on 2 ranks not refused:", bad.returncode, bad.stderr); failures += 1
print(f"{len(layers) - failures} passed, {failures} failed")
sys.exit(1 if failures else 0)
PY
