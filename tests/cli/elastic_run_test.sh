#!/usr/bin/env bash
# End-to-end checks of `eplb run --kill-rank` (docs/elastic.md): a rank process killed mid-run,
# the survivors reconfigure, shrink and restore its experts, a new process takes the rank back;
# every output still verified, the run finishes its steps. Also the first rank lost (the others
# report without it) and the bad inputs. Timings never decide a result.
# Usage: elastic_run_test.sh <eplb binary> <source dir>
set -u
eplb=$1
. "$(dirname "$0")/lib.sh"
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3)

small=(--ranks 4 --hidden 32 --intermediate 16 --tokens-per-rank 64 --interval 8 --window 8
       --layers 3)

check() {  # name, json file, kills, rejoins, steps
  "$py" - "$@" <<'PY'
import json, sys
name, path, kills, rejoins, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
d = json.load(open(path))
errors = []
for f in ["kills", "rejoins", "unavailable_steps", "no_service_steps", "restored_bytes",
          "mismatches", "steps"]:
    if f not in d: errors.append("missing " + f)
if not errors:
    if d["kills"] != kills: errors.append(f"kills {d['kills']}")
    if d["rejoins"] != rejoins: errors.append(f"rejoins {d['rejoins']}")
    if d["steps"] != steps or d["interrupted"]: errors.append(f"steps {d['steps']}")
    if d["mismatches"] != 0: errors.append(f"{d['mismatches']} mismatches")
    if d["verified"] <= 0: errors.append("nothing verified")
    if d["restored_bytes"] <= 0: errors.append("nothing restored")
    if d["no_service_steps"] != 1: errors.append(f"no service {d['no_service_steps']} steps")
    repairs = [r for r in d["per_rebalance"] if r["repair"] and r["outcome"] == "completed"]
    if len(repairs) < 1 + rejoins: errors.append(f"{len(repairs)} repairs completed")
print(name + ": " + "; ".join(errors) if errors else "")
sys.exit(1 if errors else 0)
PY
}

# Killed at step 20, taken back at step 40.
if timeout 600 "$eplb" run "${small[@]}" --steps 64 --kill-rank 1 --at-step 20 \
    --rejoin-at-step 40 --json >"$tmp/grow.json" 2>"$tmp/grow.err"; then
  msg=$(check grow "$tmp/grow.json" 1 1 64) || fail "$msg"
else
  fail "--kill-rank 1 --rejoin-at-step 40 exited $?: $(tail -c 400 "$tmp/grow.err")"
fi

# The first rank lost for good, in sync mode, with the engine's own weights.
if timeout 600 "$eplb" run "${small[@]}" --steps 48 --kill-rank 0 --at-step 12 --mode sync \
    --weights engine --json >"$tmp/shrink.json" 2>"$tmp/shrink.err"; then
  msg=$(check shrink "$tmp/shrink.json" 1 0 48) || fail "$msg"
else
  fail "--kill-rank 0 --mode sync exited $?: $(tail -c 400 "$tmp/shrink.err")"
fi

# The text summary names what happened.
if timeout 600 "$eplb" run "${small[@]}" --steps 40 --kill-rank 3 --at-step 10 \
    >"$tmp/text.out" 2>"$tmp/text.err"; then
  grep -q "elastic.*1 rank lost at step 10" "$tmp/text.out" \
    || fail "summary lacks the elastic line: $(cat "$tmp/text.out")"
else
  fail "--kill-rank 3 exited $?: $(tail -c 400 "$tmp/text.err")"
fi

# Bad input: a clear error (exit 1 or 2, "error:", never a crash).
bad() {  # expected text, args...
  local want=$1; shift
  "$eplb" run "${small[@]}" "$@" >"$tmp/bad.out" 2>"$tmp/bad.err"; local rc=$?
  if [ $rc -ne 1 ] && [ $rc -ne 2 ]; then fail "$* exited $rc"; return; fi
  grep -q -- "$want" "$tmp/bad.err" || fail "$*: no '$want' in: $(cat "$tmp/bad.err")"
}
bad "--kill-rank 9 is outside" --steps 20 --kill-rank 9 --at-step 5
bad "--at-step -1 must be in" --steps 20 --kill-rank 1
bad "--rejoin-at-step 4 must be in" --steps 20 --kill-rank 1 --at-step 5 --rejoin-at-step 4
bad "need --kill-rank" --steps 20 --at-step 5
bad "drop --compare" --steps 20 --kill-rank 1 --at-step 5 --compare
bad "fewer than the" --steps 20 --kill-rank 1 --at-step 5 --redundant 4
bad "random" --steps 20 --kill-rank 1 --at-step 5 --rejoin-at-step 10 --dispatch random

[ $failures -eq 0 ] && echo "elastic_run_test: all passed"
exit $((failures > 0))
