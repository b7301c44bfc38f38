#!/usr/bin/env bash
# End-to-end checks of `eplb simulate`: the bundled trace and a generated vLLM load history give
# one JSON object with every field and sane values; the hand-computed flip case; the table;
# clear errors for bad options.
# Usage: simulate_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
. "$(dirname "$0")/lib.sh"
py=$(command -v python3 || true)

# Checks one --json output: the fields of every policy and their ranges.
check_json() {
  local file=$1 policies=$2
  [ "$(wc -l <"$file")" -eq 1 ] || fail "--json printed more than one line: $(head -c 300 "$file")"
  if [ -z "$py" ]; then
    for field in balancedness balancedness_step moved_slots_per_rebalance bytes_per_rebalance \
        rounds_per_rebalance lower_bound_balancedness layer_steps_per_s; do
      grep -q "\"$field\"" "$file" || fail "--json lacks $field"
    done
    return
  fi
  "$py" - "$file" "$policies" <<'PY' || fail "bad JSON from $file: $(head -c 400 "$file")"
import json, sys
d = json.load(open(sys.argv[1]))
policies = sys.argv[2].split(",")
errors = []
def check(cond, what):
    if not cond: errors.append(what)
check(set(d["results"]) == set(policies), f"results for {sorted(d['results'])}, want {policies}")
check(d["layer_steps_per_s"] > 0, "layer_steps_per_s not positive")
check(d["layer_steps"] == d["steps"] * d["layers"] * len(policies), "layer_steps")
check(d["first_scored_step"] == d["window"], "first_scored_step != window")
check(d["rebalance_steps"] == list(range(d["window"], d["steps"], d["interval"])),
      "rebalance steps")
lb, lb_step = d["lower_bound_balancedness"], d["lower_bound_balancedness_step"]
check(0 < lb <= 1 + 1e-12 and 0 < lb_step <= 1 + 1e-12, f"lower bound {lb} {lb_step}")
for name, r in d["results"].items():
    for f in ["balancedness", "balancedness_step", "moved_slots_per_rebalance",
              "bytes_per_rebalance", "rounds_per_rebalance", "lower_bound_balancedness",
              "max_rank_load_per_step", "predicted_moe_ms_per_step"]:
        check(f in r, f"{name} lacks {f}")
    check(r["max_rank_load_per_step"] > 0, f"{name} max_rank_load_per_step")
    b, bs = r["balancedness"], r["balancedness_step"]
    check(0 < b <= 1 + 1e-12 and 0 < bs <= 1 + 1e-12, f"{name} balancedness {b} {bs}")
    # Guaranteed: no placement beats the lower bound of the windows it serves.
    check(bs <= lb_step + 1e-9, f"{name} step-weighted balancedness {bs} above the bound {lb_step}")
    # Not guaranteed for the mean over steps, but any real gap says something is off.
    check(b <= lb + 1e-9, f"{name} balancedness {b} above the lower bound {lb}")
    check(r["moved_slots_per_rebalance"] >= 0 and r["bytes_per_rebalance"] >= 0
          and r["rounds_per_rebalance"] >= 0, f"{name} negative moves")
    if name == "none":
        check(r["rebalances"] == 0 and r["moved_slots_per_rebalance"] == 0, "none moved")
    else:
        check(r["rebalances"] == len(d["rebalance_steps"]), f"{name} rebalances")
        check(r["moved_slots_per_rebalance"] <= d["layers"] * d["physical"], f"{name} moved")
        check((r["bytes_per_rebalance"] > 0) == (r["moved_slots_per_rebalance"] > 0)
              or r["bytes_per_rebalance"] == 0, f"{name} bytes without moves")
res = d["results"]
if "none" in res and "balanced" in res:
    check(res["balanced"]["balancedness"] > res["none"]["balancedness"],
          "balanced does not beat no rebalancing on a skewed load")
if "sticky" in res and "deepseek" in res:
    check(res["sticky"]["moved_slots_per_rebalance"] < res["deepseek"]["moved_slots_per_rebalance"],
          "sticky moves no fewer slots than deepseek")
if errors:
    print("\n".join(errors)); sys.exit(1)
PY
}

# 1. The bundled trace (8 layers x 2048 tokens, top-6 of 64 experts): 8 steps of 256 tokens.
trace="$src/data/flame-moe-290m/routing_top6.csv"
if "$eplb" simulate --trace "$trace" --ranks 4 --redundant 8 --interval 2 --window 2 \
    --policy none,deepseek,balanced,sticky --json >"$tmp/trace.json" 2>"$tmp/err"; then
  check_json "$tmp/trace.json" none,deepseek,balanced,sticky
  grep -q '"steps":8' "$tmp/trace.json" || fail "trace: expected 8 steps of 256 tokens"
  grep -q '"tokens_per_step":256' "$tmp/trace.json" || fail "trace: tokens_per_step missing"
else
  fail "simulate on the bundled trace failed: $(cat "$tmp/err")"
fi
# The same trace through --load-history is grouped the same way.
"$eplb" simulate --load-history "$trace" --ranks 4 --redundant 8 --interval 2 --window 2 \
  --policy none,deepseek,balanced,sticky --json >"$tmp/trace2.json" 2>"$tmp/err" \
  || fail "simulate --load-history on a trace failed: $(cat "$tmp/err")"
strip() { sed -e 's/"layer_steps_per_s":[^,}]*//g; s/"replay_s":[^,}]*//; s/"replay_cpu_s":[^,}]*//; s/"cpu_s":[^,}]*//; s/"source":"[^"]*"//' "$1"; }
[ "$(strip "$tmp/trace.json")" = "$(strip "$tmp/trace2.json")" ] \
  || fail "--trace and --load-history give different results on the trace"
# Deterministic: the same run twice gives the same figures.
"$eplb" simulate --trace "$trace" --ranks 4 --redundant 8 --interval 2 --window 2 \
  --policy none,deepseek,balanced,sticky --json >"$tmp/trace3.json" 2>/dev/null
[ "$(strip "$tmp/trace.json")" = "$(strip "$tmp/trace3.json")" ] || fail "two runs differ"
# Smaller steps, more rebalances, the table.
"$eplb" simulate --trace "$trace" --ranks 4 --nodes 2 --physical 72 --interval 3 --window 5 \
  --tokens-per-step 64 --policy deepseek,sticky >"$tmp/table" 2>"$tmp/err" \
  || fail "table run failed: $(cat "$tmp/err")"
for word in deepseek sticky balancedness "lower bound" "32 steps"; do
  grep -q "$word" "$tmp/table" || fail "table lacks '$word': $(cat "$tmp/table")"
done

# 2. A generated vLLM load_history (one entry per step), skewed and drifting.
if [ -n "$py" ]; then
  "$py" - "$tmp/vllm.json" <<'PY'
import json, random, sys
random.seed(5); L, E, steps = 4, 32, 60
base = [[random.lognormvariate(0, 1.2) for _ in range(E)] for _ in range(L)]
hist = []
for s in range(steps):
    if s % 20 == 0:  # the hot experts drift
        for row in base: random.shuffle(row)
    hist.append({"logical_expert_load": [[int(b * random.uniform(0.7, 1.3) * 30) for b in row]
                                         for row in base]})
json.dump({"load_history": hist}, open(sys.argv[1], "w"))
PY
  if "$eplb" simulate --load-history "$tmp/vllm.json" --ranks 8 --nodes 2 --physical 40 \
      --groups 4 --interval 5 --window 10 --policy none,deepseek,balanced,sticky \
      --expert-bytes 1048576 --json >"$tmp/vllm-out.json" 2>"$tmp/err"; then
    check_json "$tmp/vllm-out.json" none,deepseek,balanced,sticky
    grep -q '"format":"vllm"' "$tmp/vllm-out.json" || fail "vLLM history not read as vllm"
    grep -q '"steps":60' "$tmp/vllm-out.json" || fail "vLLM history: expected 60 steps"
  else
    fail "simulate on a vLLM history failed: $(cat "$tmp/err")"
  fi
fi

# 3. The hand-computed flip (see tests/unit/sim): 2 experts on 4 one-slot ranks, the hot expert
# flips every 2 steps, each placement made from the 2 steps before it: 1/3 at every scored step;
# the trivial placement keeps 2/3.
printf '{"load": [[[3,1]],[[3,1]],[[1,3]],[[1,3]],[[3,1]],[[3,1]],[[1,3]],[[1,3]]]}' >"$tmp/flip.json"
if "$eplb" simulate --load-history "$tmp/flip.json" --ranks 4 --physical 4 --interval 2 \
    --window 2 --policy sticky,none --expert-bytes 1000 --json >"$tmp/flip-out.json" 2>"$tmp/err"; then
  if [ -n "$py" ]; then
    "$py" - "$tmp/flip-out.json" <<'PY' || fail "flip figures: $(cat "$tmp/flip-out.json")"
import json, sys
d = json.load(open(sys.argv[1]))
s, n = d["results"]["sticky"], d["results"]["none"]
assert abs(s["balancedness"] - 1 / 3) < 1e-12, s
assert abs(n["balancedness"] - 2 / 3) < 1e-12, n
assert s["moved_slots"] == [1, 2, 2] and s["bytes"] == [1000, 2000, 2000], s
assert s["rounds"] == [1, 2, 2], s
assert d["lower_bound_balancedness"] == 1, d
PY
  fi
else
  fail "flip run failed: $(cat "$tmp/err")"
fi

# 4. --plot draws a PNG when gnuplot is there, and says what is missing otherwise.
if command -v gnuplot >/dev/null 2>&1; then
  "$eplb" simulate --trace "$trace" --ranks 4 --redundant 8 --interval 2 --window 2 \
    --policy deepseek,none --plot "$tmp/plot.png" >/dev/null 2>"$tmp/err" \
    || fail "--plot failed: $(cat "$tmp/err")"
  [ -s "$tmp/plot.png" ] && head -c 4 "$tmp/plot.png" | grep -q PNG || fail "--plot wrote no PNG"
else
  "$eplb" simulate --trace "$trace" --ranks 4 --interval 2 --window 2 --plot "$tmp/p.png" \
    >/dev/null 2>"$tmp/err"
  grep -q gnuplot "$tmp/err" || fail "--plot without gnuplot gives no clear error: $(cat "$tmp/err")"
fi

# 4b. --token-us turns the predicted MoE time into ms: busiest-rank load x us per token-expert.
if [ -n "$py" ]; then
  if "$eplb" simulate --trace "$trace" --ranks 4 --interval 2 --window 2 --token-us 2.5 \
      --policy none,sticky --json >"$tmp/moe.json" 2>"$tmp/moe.err"; then
    "$py" - "$tmp/moe.json" <<'PY' || fail "--token-us: $(head -c 300 "$tmp/moe.json")"
import json, sys
for name, r in json.load(open(sys.argv[1]))["results"].items():
    assert abs(r["predicted_moe_ms_per_step"] - r["max_rank_load_per_step"] * 2.5 / 1000) < 1e-9, name
PY
  else
    fail "simulate --token-us exited $?: $(cat "$tmp/moe.err")"
  fi
fi

# 5. Bad options: exit code 2, a message naming the problem, never a crash.
expect_error() {
  local pattern=$1
  shift
  "$eplb" simulate "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ $rc -eq 2 ] || fail "simulate $* exited $rc, expected 2 (stderr: $(cat "$tmp/err"))"
  grep -q -- "$pattern" "$tmp/err" || fail "simulate $*: no '$pattern' in: $(cat "$tmp/err")"
}
t=(--trace "$trace" --ranks 4)
expect_error "--interval 0 must be at least 1" "${t[@]}" --interval 0 --window 2
expect_error "--window 0 must be at least 1" "${t[@]}" --interval 1 --window 0
expect_error "--window 8 leaves no step to score" "${t[@]}" --interval 1 --window 8
expect_error "unknown policy 'greedy'" "${t[@]}" --interval 1 --window 2 --policy deepseek,greedy
expect_error "listed twice" "${t[@]}" --interval 1 --window 2 --policy sticky,sticky
expect_error "--tokens-per-step 5000 exceeds the 2048 tokens" "${t[@]}" --interval 1 --window 2 \
  --tokens-per-step 5000
expect_error "--tokens-per-step 0 must be at least 1" "${t[@]}" --interval 1 --window 2 \
  --tokens-per-step 0
expect_error "--token-us -1 is outside \\[0, 1e+06\\]" "${t[@]}" --interval 1 --window 2 \
  --token-us -1
expect_error "exactly one of --load-history" --ranks 4 --interval 1 --window 2
expect_error "exactly one of --load-history" "${t[@]}" --load-history "$tmp/flip.json" \
  --interval 1 --window 2
expect_error "not a routing trace" --trace "$tmp/flip.json" --ranks 4 --interval 1 --window 2
expect_error "not a multiple of --ranks" "${t[@]}" --redundant 3 --interval 1 --window 2
expect_error "physical 70 is not a multiple of ranks 4" "${t[@]}" --physical 70 --interval 1 \
  --window 2
expect_error "--physical 32 is below the 64 experts" "${t[@]}" --physical 32 --interval 1 \
  --window 2
expect_error "groups 5 does not divide experts 64" "${t[@]}" --groups 5 --interval 1 --window 2
expect_error "--expert-bytes 0 must be at least 1" "${t[@]}" --interval 1 --window 2 \
  --expert-bytes 0
printf '{"load": [[[1,2]],[[1,-2]]]}' >"$tmp/neg.json"
expect_error "" --load-history "$tmp/neg.json" --ranks 2 --interval 1 --window 1
"$eplb" simulate --load-history "$tmp/missing.json" --ranks 2 --interval 1 --window 1 \
  >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "missing.json" "$tmp/err" || fail "missing file: $(cat "$tmp/err")"

# Per-step scoring at token level: every dispatch and both bounds in --json, adaptive at the
# dispatch bound and nothing above it, the placement bound above it; --dispatch chooses.
"$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 4 --window 4 \
  --tokens-per-step 128 --policy none,deepseek --json >"$tmp/steps.json" 2>"$tmp/err" \
  || fail "per-step simulate failed: $(cat "$tmp/err")"
if [ -n "$py" ]; then
  "$py" - "$tmp/steps.json" <<'PY' || fail "per-step JSON: $(head -c 400 "$tmp/steps.json")"
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d["results"].items():
    want = {"static", "random", "hash", "weighted", "split", "adaptive"}
    assert set(r["dispatch"]) == want, (name, sorted(r["dispatch"]))
    db, pb = r["dispatch_bound"], r["placement_bound"]
    for k, v in r["dispatch"].items():
        assert 0 < v["balancedness"] <= db + 1e-9, (name, k, v, db)
    assert abs(r["dispatch"]["adaptive"]["balancedness"] - db) < 1e-9
    assert db <= pb <= 1 + 1e-9, (db, pb)
assert d["results"]["deepseek"]["dispatch"]["adaptive"]["balancedness"] >= 0.9
assert d["per_step"]["layer_steps"] == 12 * 8 * 2 and d["per_step"]["layer_steps_per_s"] > 0
PY
fi
"$eplb" simulate --trace "$trace" --ranks 8 --redundant 8 --interval 4 --window 4 \
  --tokens-per-step 128 --policy deepseek --dispatch split,adaptive >"$tmp/steps.txt" 2>&1
grep -q "dispatch bound" "$tmp/steps.txt" && grep -q "adaptive" "$tmp/steps.txt" \
  && ! grep -qw "hash" "$tmp/steps.txt" || fail "--dispatch split,adaptive table: $(cat "$tmp/steps.txt")"
"$eplb" simulate --trace "$trace" --ranks 8 --interval 4 --window 4 --policy deepseek \
  --dispatch none --json >"$tmp/nosteps.json" 2>&1
! grep -q '"dispatch"' "$tmp/nosteps.json" || fail "--dispatch none still scored per step"
expect_error "unknown dispatch policy 'roundrobin'" "${t[@]}" --interval 1 --window 2 \
  --dispatch hash,roundrobin
expect_error "--spread -1 must be a finite number of standard deviations" "${t[@]}" --interval 1 \
  --window 2 --spread -1
"$eplb" simulate "${t[@]}" --interval 2 --window 2 --policy balanced --spread 0.5 --json \
  >"$tmp/spread.json" 2>"$tmp/err" || fail "--spread 0.5 failed: $(cat "$tmp/err")"

if [ $failures -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "simulate: all checks passed"
