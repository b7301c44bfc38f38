#!/usr/bin/env bash
# `eplb run` when ranks are lost and when a run is short (docs/elastic.md, "Lost ranks";
# docs/run.md, "The summary"): a rank killed from outside an elastic run is lost like the one
# --kill-rank ends; the run serves on while the ranks left hold every expert and else stops
# saying why, and either way prints the figures of the steps served with every lost rank named.
# Also: the balancedness never above 1 while experts are unavailable (their tokens reported
# apart), --layers above the input's refused, and a run with no "after" steps saying so.
# The kills from outside come from EPLB_RUN_TEST_KILL at a given step, so no result depends on
# timing.
# Usage: run_lost_test.sh <eplb binary> <source dir>
set -u
eplb=$1
. "$(dirname "$0")/lib.sh"
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3)

# 12 experts in 2 layers, 4 ranks: with --redundant left at -1 the 3 ranks left after one loss
# hold every expert (4 slots each), 2 ranks do not.
echo '{"load": [[90,132,40,61,104,165,39,4,73,56,183,86],
                [20,107,104,64,19,197,187,157,172,86,16,27]]}' >"$tmp/load.json"
small=(--load "$tmp/load.json" --top-k 2 --sample-tokens 512 --ranks 4 --hidden 16
       --intermediate 8 --tokens-per-rank 32 --interval 8 --window 8 --verify all)
run24=("${small[@]}" --steps 24)

check() {  # name, json file, python condition on d (the --json object)
  "$py" - "$@" <<'PY'
import json, sys
name, path, condition = sys.argv[1:4]
try:
    d = json.load(open(path))
except Exception as e:
    print(f"{name}: no --json object ({e})"); sys.exit(1)
if not eval("(" + condition + ")"):
    print(f"{name}: not {condition}: " +
          json.dumps({k: v for k, v in d.items() if k not in ("per_step", "per_rebalance")}))
    sys.exit(1)
PY
}

# 1. Rank 3 killed from outside at step 4, rank 1 by --kill-rank at step 12; the 2 ranks left
#    still hold every expert (--redundant 12: 6 slots each): the run serves all its steps.
if EPLB_RUN_TEST_KILL=3:4 timeout 300 "$eplb" run "${run24[@]}" --redundant 12 --kill-rank 1 \
    --at-step 12 --json >"$tmp/on.json" 2>"$tmp/on.err"; then
  msg=$(check "serve on" "$tmp/on.json" 'd["steps"] == 24 and d["stopped"] is None and
    d["kills"] == 2 and d["mismatches"] == 0 and d["verified"] > 0 and
    [(l["rank"], l["step"], l["planned"]) for l in d["lost"]] == [(3, 4, False), (1, 12, True)]
    and "signal 9" in d["lost"][0]["how"] and d["no_service_steps"] == 2') || fail "$msg"
else
  fail "an outside kill the survivors can serve through: exit $?: $(tail -c 400 "$tmp/on.err")"
fi

# 2. The same kills with the fewest redundant slots: after the second loss the 2 ranks left hold
#    8 slots, fewer than the 12 experts. The run stops at step 12, exit 1, and still prints the
#    figures of the 12 steps served, both losses named, and why it stopped.
EPLB_RUN_TEST_KILL=3:4 timeout 300 "$eplb" run "${run24[@]}" --kill-rank 1 --at-step 12 --json \
  >"$tmp/stop.json" 2>"$tmp/stop.err"
rc=$?
[ $rc -eq 1 ] || fail "too few ranks left: exit $rc (want 1): $(tail -c 400 "$tmp/stop.err")"
grep -q "eplb: error: the run stopped after 12 of 24 steps: .*fewer than the 12 experts" \
  "$tmp/stop.err" || fail "too few ranks left: stderr says: $(tail -c 400 "$tmp/stop.err")"
msg=$(check "stop" "$tmp/stop.json" 'd["steps"] == 12 and "fewer than the 12 experts" in
  d["stopped"] and d["kills"] == 2 and d["mismatches"] == 0 and d["verified"] > 0 and
  [(l["rank"], l["step"], l["planned"]) for l in d["lost"]] == [(3, 4, False), (1, 12, True)]') \
  || fail "$msg"
# The text summary names both losses and the stop.
EPLB_RUN_TEST_KILL=3:4 timeout 300 "$eplb" run "${run24[@]}" --kill-rank 1 --at-step 12 \
  >"$tmp/stop.txt" 2>"$tmp/stop.err"
grep -q "elastic *2 ranks lost: rank 3 (pid [0-9]*): killed by signal 9 (Killed), from outside \
eplb, at step 4; rank 1 at step 12 (--kill-rank)" "$tmp/stop.txt" \
  || fail "the summary does not name the lost ranks: $(cat "$tmp/stop.txt")"
grep -q "stopped after 12 of 24 steps" "$tmp/stop.txt" && grep -q "^  stopped .*fewer than" \
  "$tmp/stop.txt" || fail "the summary does not say the run stopped: $(cat "$tmp/stop.txt")"

# 3. With --rejoin-at-step a new process waits for the seat --kill-rank empties; when the run
#    stops before it can join, the launcher ends it and the run still reports (no hang).
EPLB_RUN_TEST_KILL=3:4 timeout 300 "$eplb" run "${run24[@]}" --kill-rank 1 --at-step 12 \
  --rejoin-at-step 18 --json >"$tmp/wait.json" 2>"$tmp/wait.err"
rc=$?
[ $rc -eq 1 ] \
  || fail "a replacement left waiting: exit $rc (want 1): $(tail -c 400 "$tmp/wait.err")"
msg=$(check "replacement" "$tmp/wait.json" 'd["steps"] == 12 and d["rejoins"] == 0 and
  d["kills"] == 2') || fail "$msg"

# 4. A lost expert: its tokens go nowhere until the repair restores it. The balancedness counts
#    what reached a rank (never above 1); the dropped choices are reported apart.
if "$eplb" run --ranks 4 --hidden 16 --intermediate 16 --kill-rank 1 --steps 20 --at-step 5 \
    --mode off --json >"$tmp/b.json" 2>"$tmp/b.err"; then
  msg=$(check "balancedness" "$tmp/b.json" 'max(d["per_step"]["balancedness"]) <= 1 and
    0 < d["balancedness_after"] <= 1 and 0 < d["balancedness_before"] <= 1 and
    d["tokens_dropped"] > 0 and d["unavailable_steps"] > 0') || fail "$msg"
else
  fail "a lost expert with --mode off: exit $?: $(tail -c 400 "$tmp/b.err")"
fi

# 5. --layers above what the input has: refused, naming the value and the range.
"$eplb" run --layers 99999999999 --steps 2 >/dev/null 2>"$tmp/l.err"
rc=$?
want="eplb: error: --layers 99999999999 is more than the 58 MoE layers .*(1 to 58, or 0: every"
[ $rc -eq 2 ] && grep -q "$want layer)" "$tmp/l.err" \
  || fail "--layers 99999999999: exit $rc: $(cat "$tmp/l.err")"
"$eplb" run "${run24[@]}" --layers 3 >/dev/null 2>"$tmp/l.err"
rc=$?
[ $rc -eq 2 ] && grep -q -- "--layers 3 is more than the 2 MoE layers" "$tmp/l.err" \
  || fail "--layers 3 of 2: exit $rc: $(cat "$tmp/l.err")"
"$eplb" run "${small[@]}" --layers 2 --steps 2 >/dev/null 2>"$tmp/l.err" \
  || fail "--layers 2 of 2 refused: $(cat "$tmp/l.err")"

# 6. A run too short for an "after": the summary says so, --json has null after figures.
if "$eplb" run "${small[@]}" --steps 2 >"$tmp/short.txt" 2>"$tmp/short.err"; then
  grep -q 'no "after"' "$tmp/short.txt" \
    || fail "--steps 2: no word of the missing after: $(cat "$tmp/short.txt")"
  grep -q "steps 2-1\| 0 tokens/s\|->  0 " "$tmp/short.txt" \
    && fail "--steps 2: figures of an empty range: $(cat "$tmp/short.txt")"
else
  fail "--steps 2 exited $?: $(tail -c 300 "$tmp/short.err")"
fi
if "$eplb" run "${small[@]}" --steps 2 --json >"$tmp/short.json" 2>"$tmp/short.err"; then
  msg=$(check "short" "$tmp/short.json" 'all(d[k] is None for k in ("balancedness_after",
    "after_steps", "moe_ms_after", "moe_wall_ms_after", "tokens_per_s_after")) and
    d["balancedness_before"] is not None and d["before_steps"] == [0, 2]') || fail "$msg"
else
  fail "--steps 2 --json exited $?: $(tail -c 300 "$tmp/short.err")"
fi

# 7. A rank lost while the ranks start (before its group connects): no step served, exit 1,
#    and still the summary and a --json object naming the rank and saying so.
EPLB_RUN_TEST_KILL=2:start timeout 300 "$eplb" run "${run24[@]}" --kill-rank 1 --at-step 12 \
  --timeout-ms 3000 --json >"$tmp/start.json" 2>"$tmp/start.err"
rc=$?
[ $rc -eq 1 ] || fail "a loss at start-up: exit $rc (want 1): $(tail -c 400 "$tmp/start.err")"
grep -q "eplb: error: the run stopped after 0 of 24 steps: rank 2 .*no step was served" \
  "$tmp/start.err" || fail "a loss at start-up: stderr says: $(tail -c 400 "$tmp/start.err")"
msg=$(check "start-up loss" "$tmp/start.json" 'd["steps"] == 0 and d["kills"] == 1 and
  [(l["rank"], l["step"], l["planned"]) for l in d["lost"]] == [(2, 0, False)] and
  "no step was served" in d["stopped"] and d["mismatches"] == 0') || fail "$msg"
EPLB_RUN_TEST_KILL=2:start timeout 300 "$eplb" run "${run24[@]}" --kill-rank 1 --at-step 12 \
  --timeout-ms 3000 >"$tmp/start.txt" 2>"$tmp/start.err"
grep -q "stopped after 0 of 24 steps" "$tmp/start.txt" && grep -q "rank 2 (pid [0-9]*)" \
  "$tmp/start.txt" || fail "a loss at start-up: the summary says: $(cat "$tmp/start.txt")"

# 8. A rank stopped (SIGSTOP) in an elastic run is not lost (it still lives): its peers' step
#    collective times out with no new group, and the error names that collective, the step, the
#    group's seats and the ranks it waited for, not only the membership board's wait. (Should
#    the machine be so loaded that a step outlasts --timeout-ms before the stop, the message is
#    the same: whichever rank was late is named.)
scratch=$tmp/scratch
mkdir -p "$scratch"
TMPDIR=$scratch "$eplb" run "${small[@]}" --steps 100000 --kill-rank 1 --at-step 99999 \
  --timeout-ms 5000 >/dev/null 2>"$tmp/slow.err" &
launcher=$!
for _ in $(seq 1 300); do
  [ "$(pgrep -c -P $launcher)" -ge 4 ] && break
  sleep 0.1
done
sleep 2
rank=$(pgrep -P $launcher | tail -n 1)
[ -n "$rank" ] && kill -STOP "$rank" 2>/dev/null
wait $launcher
rc=$?
[ $rc -eq 1 ] || fail "a stopped rank in an elastic run: exit $rc: $(tail -c 400 "$tmp/slow.err")"
grep -q "the lockstep all-reduce ending step [0-9]* (group of epoch 0, whose ranks are seats \
0, 1, 2, 3) failed: control all_reduce (shm, rank [0-3] of 4): .*timed out waiting for rank.*; \
no rank was lost" "$tmp/slow.err" \
  || fail "a stopped rank in an elastic run: $(tail -c 600 "$tmp/slow.err")"

# 9. A malformed test kill is refused before any rank starts.
EPLB_RUN_TEST_KILL=9:4 "$eplb" run "${run24[@]}" --kill-rank 1 --at-step 12 >/dev/null \
  2>"$tmp/k.err"
rc=$?
[ $rc -eq 2 ] && grep -q "EPLB_RUN_TEST_KILL='9:4' is not SEAT:STEP" "$tmp/k.err" \
  || fail "EPLB_RUN_TEST_KILL=9:4: exit $rc: $(cat "$tmp/k.err")"

[ $failures -eq 0 ] && echo "run_lost_test: all passed"
exit $((failures > 0))
