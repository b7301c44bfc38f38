#!/usr/bin/env bash
# End-to-end checks of the cost model (docs/dispatch.md, "What a step pays"): `eplb simulate
# --cost` scores every dispatch in modeled time with adaptive_cost never above adaptive and
# nothing below the bound, balanced_cost beside the other policies, models from presets and
# JSON files; `eplb run` fits a model and predicts its MoE time, and serves adaptive_cost with 0
# mismatches; bad models and options are refused naming the value (exit 2).
# Usage: cost_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
. "$(dirname "$0")/lib.sh"
py=$(command -v python3 || true)
trace=$src/data/flame-moe-290m/routing_top6.csv

expect_error() {
  local pattern=$1
  shift
  "$eplb" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ $rc -eq 2 ] || fail "$* exited $rc, expected 2 (stderr: $(cat "$tmp/err"))"
  grep -q -- "$pattern" "$tmp/err" || fail "$*: no '$pattern' in: $(cat "$tmp/err")"
}

# 1. The simulator in modeled time, under a preset and under a JSON model.
printf '{"slot_us": 40, "token_us": 2}' >"$tmp/linear.json"
for model in h100-v3-decode "$tmp/linear.json"; do
  "$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 4 --window 4 \
    --policy deepseek,balanced --cost "$model" --json >"$tmp/sim.json" 2>"$tmp/err" \
    || fail "simulate --cost $model: $(cat "$tmp/err")"
  [ -n "$py" ] || continue
  "$py" - "$tmp/sim.json" <<'PY' || fail "simulate --cost $model JSON: $(head -c 400 "$tmp/sim.json")"
import json, sys
d = json.load(open(sys.argv[1]))
assert set(d["results"]) == {"deepseek", "balanced", "balanced_cost"}, sorted(d["results"])
assert d["cost_model"]["slot_us"] > 0
for name, r in d["results"].items():
    disp = r["dispatch"]
    assert "adaptive_cost" in disp and len(disp) == 7, (name, sorted(disp))
    bound = r["dispatch_bound_detail"]["modeled_ms"]
    for k, v in disp.items():
        assert v["modeled_ms"] >= bound - 1e-9, (name, k, v["modeled_ms"], bound)
    assert disp["adaptive_cost"]["modeled_ms"] <= disp["adaptive"]["modeled_ms"] * (1 + 1e-9), name
PY
done
"$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 4 --window 4 \
  --policy balanced --cost h100-v3-decode >"$tmp/table.txt" 2>&1 || fail "table: $(cat "$tmp/table.txt")"
grep -q "model ms" "$tmp/table.txt" && grep -q "cost model: rank 0 us" "$tmp/table.txt" \
  && grep -q "its error on held-back steps: none (not a fit" "$tmp/table.txt" \
  || fail "simulate --cost table: $(cat "$tmp/table.txt")"
# A fitted model's held-back error travels with it into simulate.
printf '{"slot_us": 40, "token_us": 2, "noise": 0.05, "heldout_error": -0.012, "heldout_steps": 16}' \
  >"$tmp/fitted.json"
"$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 4 --window 4 \
  --policy balanced --cost "$tmp/fitted.json" >"$tmp/table.txt" 2>&1 \
  || fail "fitted table: $(cat "$tmp/table.txt")"
grep -q "its error on held-back steps: -1.2% on 16 held-back steps" "$tmp/table.txt" \
  && grep -q "rank noise 5.0%" "$tmp/table.txt" || fail "fitted model table: $(cat "$tmp/table.txt")"

# 2. Bad models and options.
t=(simulate --trace "$trace" --ranks 8 --redundant 8 --interval 4 --window 4)
expect_error "neither a preset" "${t[@]}" --cost a100
printf '{"slot_us": -3}' >"$tmp/neg.json"
expect_error "slot_us is -3" "${t[@]}" --cost "$tmp/neg.json"
printf '{"slot_us": 1, "tokens_us": 2}' >"$tmp/typo.json"
expect_error 'unknown field "tokens_us"' "${t[@]}" --cost "$tmp/typo.json"
printf '{"roofline": {"hbm_bytes_per_s": 3.35e12, "expert_bytes": 1e6, "flops_per_token": 2e6}}' \
  >"$tmp/roof.json"
expect_error "peak_flops is 0" "${t[@]}" --cost "$tmp/roof.json"
expect_error "adaptive_cost needs a cost model" "${t[@]}" --dispatch adaptive_cost
expect_error "balanced_cost needs a cost model" "${t[@]}" --policy balanced_cost

# 3. eplb run: the fitted model and its prediction, and adaptive_cost served and verified.
run=(run --ranks 2 --layers 2 --steps 24 --interval 8 --window 8 --tokens-per-rank 16 --json)
"$eplb" "${run[@]}" >"$tmp/run.json" 2>"$tmp/err" || fail "run: $(cat "$tmp/err")"
"$eplb" "${run[@]}" --dispatch adaptive_cost >"$tmp/run-cost.json" 2>"$tmp/err" \
  || fail "run --dispatch adaptive_cost: $(cat "$tmp/err")"
"$eplb" "${run[@]}" --dispatch adaptive_cost --cost h100-v3-decode >"$tmp/run-preset.json" \
  2>"$tmp/err" || fail "run --cost h100-v3-decode: $(cat "$tmp/err")"
if [ -n "$py" ]; then
  for f in run run-cost run-preset; do
    "$py" - "$tmp/$f.json" <<'PY' || fail "$f JSON: $(head -c 400 "$tmp/$f.json")"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["mismatches"] == 0 and d["verified"] > 0
assert d["cost_samples"] > 0
if d["cost_model"] is not None:
    assert d["moe_ms_predicted_after"] is not None and d["moe_ms_predicted_after"] > 0
    # The model's noise, and its error on the steps held back from it (4 sets of the fitted
    # steps, each predicted by a fit of the others).
    m = d["cost_model"]
    assert 0 <= m["noise"] <= 1, m
    assert m["heldout_steps"] >= 4 and abs(m["heldout_error"]) < 10, m
    assert d["moe_ms_predicted_before"] > 0
    assert len(d["per_step"]["moe_ms_predicted"]) == d["steps"]
    # The floor: no placement or dispatch beats it under the model, so every step's
    # prediction (the largest modeled rank time per layer) is at least that step's floor.
    ps = d["per_step"]
    assert d["moe_ms_floor_after"] is not None and 0 < d["moe_ms_floor_after"]
    assert len(ps["moe_ms_floor"]) == d["steps"]
    for floor, predicted in zip(ps["moe_ms_floor"], ps["moe_ms_predicted"]):
        assert 0 < floor <= predicted * (1 + 1e-9), (floor, predicted)
else:
    assert d["cost_fit_error"], d
    assert d["moe_ms_floor_after"] is None
# The time balancedness: the mean rank time over the busiest's, in (0, 1].
assert 0 < d["time_balancedness_after"] <= 1
assert all(0 < b <= 1 for b in d["per_step"]["time_balancedness"])
PY
  done
fi
# 4. A rebalance only when it pays: simulate --min-gain reports what it did and skipped.
for g in 0 1; do
  "$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 2 --window 2 \
    --policy sticky --cost "$tmp/linear.json" --min-gain $g --stall-ms 50 --json \
    >"$tmp/gain$g.json" 2>"$tmp/err" || fail "simulate --min-gain $g: $(cat "$tmp/err")"
done
if [ -n "$py" ]; then
  "$py" - "$tmp/gain0.json" "$tmp/gain1.json" <<'PY' || fail "simulate --min-gain JSON"
import json, sys
a, b = (json.load(open(f))["results"]["sticky"] for f in sys.argv[1:3])
assert a["rebalances_done"] == a["rebalances"] and a["gain_checks"] == [], a
assert len(b["gain_checks"]) == b["rebalances"], b
skipped = [c for c in b["gain_checks"] if not c["rebalanced"]]
assert b["rebalances_skipped"] == len(skipped) >= 1, b["gain_checks"]
for c in skipped:  # each skip: its gain did not reach its price (the stall at least)
    assert c["gain_ms"] < c["price_ms"] and c["price_ms"] >= 50, c
assert b["bytes_moved"] == sum(b["bytes"]) <= a["bytes_moved"], (b["bytes_moved"], a["bytes_moved"])
PY
fi
"$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 2 --window 2 --policy sticky \
  --cost "$tmp/linear.json" --min-gain 1 --stall-ms 50 >"$tmp/table.txt" 2>&1 \
  || fail "simulate --min-gain table: $(cat "$tmp/table.txt")"
grep -q "min_gain 1: a rebalance only when" "$tmp/table.txt" && grep -q "rebalanced" "$tmp/table.txt" \
  || fail "simulate --min-gain table: $(cat "$tmp/table.txt")"
for g in -1 nan inf; do
  expect_error "min-gain is $g" "${t[@]}" --cost "$tmp/linear.json" --min-gain $g
  expect_error "min-gain is $g" run --ranks 2 --steps 4 --min-gain $g
done
expect_error "give --cost MODEL" "${t[@]}" --min-gain 1
expect_error "pull-gbps 0 must be" "${t[@]}" --cost "$tmp/linear.json" --min-gain 1 --pull-gbps 0
# eplb run --min-gain: every check in --json, with its gain and price; too few samples for the
# ranks' fit say so, and price with the tokens preset.
"$eplb" "${run[@]}" --min-gain 1 >"$tmp/run-gain.json" 2>"$tmp/err" \
  || fail "run --min-gain: $(cat "$tmp/err")"
if [ -n "$py" ]; then
  "$py" - "$tmp/run-gain.json" <<'PY' || fail "run --min-gain JSON: $(head -c 600 "$tmp/run-gain.json")"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["min_gain"] == 1 and d["mismatches"] == 0
checked = [r for r in d["per_rebalance"] if r["gain_checked"]]
assert checked, d["per_rebalance"]
assert d["rebalances_below_min_gain"] == sum(r["below_min_gain"] for r in checked)
for r in checked:
    assert r["modeled_moe_ms_before"] > 0 and r["predicted_gain_ms"] is not None
    if r["below_min_gain"]:
        assert r["outcome"] == "skipped" and r["price_ms"] is not None, r
        assert r["predicted_gain_ms"] < r["price_ms"], r
PY
fi
"$eplb" run --ranks 2 --layers 2 --steps 4 --interval 1 --window 1 --tokens-per-rank 4 \
  --min-gain 1 >"$tmp/out" 2>"$tmp/err" || fail "run --min-gain, few samples: $(cat "$tmp/err")"
grep -q "could not be fitted at step 0 (cost model fit: 4 samples" "$tmp/err" \
  && grep -q "tokens preset" "$tmp/err" || fail "run --min-gain, few samples: $(cat "$tmp/err")"
"$eplb" run --ranks 2 --steps 4 --min-gain 1 --cost h100-v3-decode >"$tmp/out" 2>"$tmp/err" \
  || fail "run --min-gain --cost: $(cat "$tmp/err")"

expect_error "needs --dispatch adaptive_cost" run --ranks 2 --steps 4 --cost h100-v3-decode
expect_error "neither a preset" run --ranks 2 --steps 4 --dispatch adaptive_cost \
  --cost "$tmp/missing.json"
expect_error "slot_us is -3" run --ranks 2 --steps 4 --dispatch adaptive_cost --cost "$tmp/neg.json"

if [ $failures -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "cost: all checks passed"
