#!/usr/bin/env bash
# End-to-end checks of `eplb run`: small runs in async and sync modes (every output verified,
# at least one rebalance, balance not worse after it than before), --compare, --plot, bad
# input, a rank killed mid-run (clear error naming it, no process left behind), and mpirun on
# loopback when it is installed. Timings never decide a result.
# Usage: run_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
. "$(dirname "$0")/lib.sh"
py=$(command -v python3 || true)

# Small sizes: 64 tokens per rank, 4 ranks -> the 2048-token trace repeats every 8 steps.
sizes=(--hidden 32 --intermediate 16 --tokens-per-rank 64)
small=("${sizes[@]}" --steps 56 --interval 8 --window 8)

check_json() {  # file mode
  "$py" - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
errors = []
for f in ["steps", "rebalances", "balancedness_before", "balancedness_after", "bytes_moved",
          "stall_max_ms", "stall_total_ms", "mismatches", "mode"]:
    if f not in d: errors.append("missing " + f)
if not errors:
    if d["mode"] != sys.argv[2]: errors.append("mode " + d["mode"])
    if d["mismatches"] != 0: errors.append(f"{d['mismatches']} mismatches")
    if d["rebalances"] < 1: errors.append("no rebalance")
    if d["bytes_moved"] <= 0: errors.append("no bytes moved")
    if d["verified"] <= 0: errors.append("nothing verified")
    # MoE time in CPU time beside the wall time; the CPU time of a step never exceeds the wall.
    for when in ("before", "after"):
        cpu, wall = d[f"moe_ms_{when}"], d[f"moe_wall_ms_{when}"]
        if not 0 < cpu <= wall * 1.01 + 0.01: errors.append(f"moe {when}: cpu {cpu} wall {wall}")
    if not d["balancedness_after"] >= d["balancedness_before"]:
        errors.append(f"balancedness {d['balancedness_before']} -> {d['balancedness_after']}")
print("; ".join(errors))
sys.exit(1 if errors else 0)
PY
}

for mode in async sync; do
  if "$eplb" run "${small[@]}" --mode $mode --json >"$tmp/$mode.json" 2>"$tmp/$mode.err"; then
    [ "$(wc -l <"$tmp/$mode.json")" -eq 1 ] || fail "--json printed more than one line"
    [ -z "$py" ] || msg=$(check_json "$tmp/$mode.json" $mode) || fail "$mode: $msg"
  else
    fail "eplb run --mode $mode exited $?: $(tail -c 300 "$tmp/$mode.err")"
  fi
done

# The weights in the runtime's arena instead of each rank's own (the default): same outputs.
for weights in engine arena; do
  if "$eplb" run "${small[@]}" --weights $weights --json >"$tmp/w.json" 2>"$tmp/w.err"; then
    [ -z "$py" ] || msg=$(check_json "$tmp/w.json" async) || fail "--weights $weights: $msg"
    grep -q "\"weights\":\"$weights\"" "$tmp/w.json" || fail "--json lacks weights $weights"
  else
    fail "eplb run --weights $weights exited $?: $(tail -c 300 "$tmp/w.err")"
  fi
done
"$eplb" run --weights mine >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "weights 'mine'" "$tmp/err" || fail "--weights mine: $(cat "$tmp/err")"

# Two emulated nodes: the hybrid transport (shm within a node, UCX over TCP across), every
# output still right.
if "$eplb" run "${small[@]}" --nodes 2 --json >"$tmp/nodes.json" 2>"$tmp/nodes.err"; then
  [ -z "$py" ] || msg=$(check_json "$tmp/nodes.json" async) || fail "--nodes 2: $msg"
  grep -q '"transport":"hybrid"' "$tmp/nodes.json" || fail "--nodes 2 did not use hybrid"
else
  fail "eplb run --nodes 2 exited $?: $(tail -c 300 "$tmp/nodes.err")"
fi

# Every output verified, random dispatch, redundant slots, the summary a person reads.
if "$eplb" run "${small[@]}" --verify all --dispatch random --redundant 8 >"$tmp/all.txt" \
    2>"$tmp/all.err"; then
  grep -q " 0 mismatches" "$tmp/all.txt" || fail "--verify all: $(cat "$tmp/all.txt")"
  for word in balancedness "MoE per step" rebalances stall verified; do
    grep -q "$word" "$tmp/all.txt" || fail "summary lacks '$word'"
  done
else
  fail "eplb run --verify all exited $?: $(tail -c 300 "$tmp/all.err")"
fi

# A load file and the seeded sampler, every dispatch that chooses per token or per step.
echo '{"load": [[90,132,40,61,104,165,39,4,73,56,183,86],[20,107,104,64,19,197,187,157,172,86,16,27]]}' >"$tmp/load.json"
for dispatch in hash weighted split adaptive static; do
  "$eplb" run --load "$tmp/load.json" --top-k 2 --sample-tokens 512 --ranks 2 --redundant 4 \
    --hidden 16 --intermediate 8 --tokens-per-rank 32 --steps 24 --interval 8 --window 8 \
    --dispatch $dispatch --verify all --json >"$tmp/load.out" 2>"$tmp/load.err" \
    || fail "--load with $dispatch dispatch exited $?: $(tail -c 300 "$tmp/load.err")"
  grep -q '"mismatches":0' "$tmp/load.out" || fail "--load $dispatch: $(cat "$tmp/load.out")"
done
# The default workload: DeepSeek-V3's loads, 6 MoE layers (its 3 dense ones left out),
# adaptive dispatch, and the throughput the slowest rank allows.
"$eplb" run "${sizes[@]}" --steps 8 --json >"$tmp/default.json" 2>"$tmp/default.err" \
  || fail "default workload exited $?: $(tail -c 300 "$tmp/default.err")"
for want in '"dispatch":"adaptive"' '"tokens_per_s_after":' '"ranks":8' '"mismatches":0'; do
  grep -q "$want" "$tmp/default.json" || fail "default run lacks $want: $(head -c 300 "$tmp/default.json")"
done
"$eplb" run "${sizes[@]}" --steps 8 --layers -2 >/dev/null 2>"$tmp/err" && fail "--layers -2 accepted"
grep -q "layers -2 must not be negative" "$tmp/err" || fail "--layers -2: $(cat "$tmp/err")"
# Physical slots (12 experts + 4) divide over 8 ranks though the redundant slots alone do not.
"$eplb" run --load "$tmp/load.json" --top-k 2 --sample-tokens 512 --ranks 8 --redundant 4 \
  --hidden 16 --intermediate 8 --tokens-per-rank 16 --steps 16 --interval 8 --window 8 \
  --json >"$tmp/load8.out" 2>"$tmp/load8.err" \
  || fail "12 experts + 4 redundant on 8 ranks exited $?: $(tail -c 300 "$tmp/load8.err")"

# Off, sync and async side by side.
# Logs go to standard error: with --verbose (every rebalance logged) stdout is still one JSON
# object, and the logs are there on stderr.
if "$eplb" run "${small[@]}" --verbose --json >"$tmp/verbose.json" 2>"$tmp/verbose.err"; then
  [ "$(wc -l <"$tmp/verbose.json")" -eq 1 ] || fail "--verbose --json: stdout has log lines"
  grep -q "eplb runtime rank 0: rebalance" "$tmp/verbose.err" || fail "--verbose logged nothing on stderr"
else
  fail "--verbose --json failed: $(tail -c 300 "$tmp/verbose.err")"
fi
if "$eplb" run "${small[@]}" --compare --json >"$tmp/compare.json" 2>"$tmp/compare.err"; then
  for mode in off sync async; do
    grep -q "\"$mode\":{" "$tmp/compare.json" || fail "--compare lacks $mode"
  done
  grep -q '"mismatches":[1-9]' "$tmp/compare.json" && fail "--compare has mismatches"
else
  fail "--compare exited $?: $(tail -c 300 "$tmp/compare.err")"
fi
# Side by side into a pipe: the header once (the runs are forked after it is flushed), the table.
"$eplb" run "${sizes[@]}" --steps 16 --interval 8 --window 8 --compare 2>"$tmp/cmp.err" | cat >"$tmp/cmp.txt"
[ "$(grep -c '^eplb run:' "$tmp/cmp.txt")" -eq 1 ] \
  || fail "--compare header printed $(grep -c '^eplb run:' "$tmp/cmp.txt") times"
grep -q "tokens/s after" "$tmp/cmp.txt" || fail "--compare table: $(cat "$tmp/cmp.txt" "$tmp/cmp.err")"
# A Ctrl-C at a terminal reaches the whole process group: every run stops at one step and
# reports, exit 130, nothing left behind (one run, and side by side).
for extra in "" "--compare"; do
  want=$([ -z "$extra" ] && echo 9 || echo 27)  # launcher(s) and ranks in the session
  setsid bash -c "trap '' INT; \"$eplb\" run ${sizes[*]} --steps 1000000 --interval 4 \
      --window 4 $extra >'$tmp/int.out' 2>'$tmp/int.err' & child=\$!; \
      for i in \$(seq 1 600); do [ \$(pgrep -s 0 -c -f 'eplb run') -ge $want ] && break; sleep 0.1; done; \
      sleep 2; kill -INT -\$\$; wait \$child; echo \$? >'$tmp/int.rc'"
  [ "$(cat "$tmp/int.rc")" = 130 ] \
    || fail "Ctrl-C ($extra): exit $(cat "$tmp/int.rc"): $(tail -c 300 "$tmp/int.err")"
  grep -q "interrupted\|off *sync *async" "$tmp/int.out" \
    || fail "Ctrl-C ($extra): no summary: $(tail -c 300 "$tmp/int.out")"
done
sleep 1
pgrep -f "eplb run ${sizes[*]} --steps 1000000" >/dev/null && fail "Ctrl-C left processes behind"

# The plot, when gnuplot is installed; a clear error otherwise.
if command -v gnuplot >/dev/null; then
  "$eplb" run "${small[@]}" --plot "$tmp/run.png" >/dev/null 2>"$tmp/plot.err" \
    || fail "--plot exited $?: $(tail -c 300 "$tmp/plot.err")"
  [ -s "$tmp/run.png" ] || fail "--plot wrote no file"
else
  PATH=/nonexistent "$eplb" run "${small[@]}" --plot "$tmp/run.png" >/dev/null 2>"$tmp/plot.err" \
    && fail "--plot without gnuplot succeeded"
  grep -q gnuplot "$tmp/plot.err" || fail "--plot without gnuplot: $(cat "$tmp/plot.err")"
fi

# Bad input: exit 2 and a message naming the value.
"$eplb" run --redundant 3 >/dev/null 2>"$tmp/bad.err"
[ $? -eq 2 ] || fail "--redundant 3 did not exit 2"
grep -q "redundant 3" "$tmp/bad.err" || fail "--redundant 3: $(cat "$tmp/bad.err")"
"$eplb" run --trace "$tmp/missing.csv" >/dev/null 2>"$tmp/bad.err" && fail "missing trace accepted"
grep -q "missing.csv" "$tmp/bad.err" || fail "missing trace: $(cat "$tmp/bad.err")"

# A rank killed mid-run: the run stops with a message naming it, and no process is left.
"$eplb" run "${sizes[@]}" --steps 1000000 --interval 4 --window 4 >"$tmp/kill.out" 2>"$tmp/kill.err" &
launcher=$!
ranks=""
for _ in $(seq 1 300); do
  ranks=$(pgrep -P $launcher | tr '\n' ' ')
  [ "$(echo $ranks | wc -w)" -ge 4 ] && break
  sleep 0.1
done
if [ "$(echo $ranks | wc -w)" -ge 4 ]; then
  sleep 2  # into the run
  victim=$(echo $ranks | cut -d' ' -f3)
  kill -9 "$victim"
  wait $launcher
  rc=$?
  [ $rc -ne 0 ] || fail "killed rank: exit code 0"
  grep -q "rank 2 (pid $victim).*signal 9" "$tmp/kill.err" \
    || fail "killed rank: message does not name rank 2: $(tail -c 400 "$tmp/kill.err")"
  for pid in $ranks; do
    kill -0 "$pid" 2>/dev/null && fail "rank pid $pid left behind"
  done
else
  kill -9 $launcher 2>/dev/null
  fail "killed rank: the ranks did not start ($ranks)"
fi

# One rank per process under mpirun, on loopback.
if command -v mpirun >/dev/null && mpirun --version 2>&1 | grep -q "Open MPI"; then
  root=()
  [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
  # OpenMPI's own allocations at MPI_Init are never freed: no leak checking of this run in a
  # sanitizer build (eplb's code is leak-checked by every other test).
  if ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" \
      timeout 300 mpirun -np 2 --oversubscribe "${root[@]}" "$eplb" run "${small[@]}" \
      --redundant 2 --json >"$tmp/mpi.json" 2>"$tmp/mpi.err"; then
    grep -q '"mismatches":0' "$tmp/mpi.json" || fail "mpirun: $(cat "$tmp/mpi.json")"
    grep -q '"ranks":2' "$tmp/mpi.json" || fail "mpirun: not 2 ranks: $(cat "$tmp/mpi.json")"
  else
    fail "mpirun exited $?: $(tail -c 400 "$tmp/mpi.err")"
  fi
else
  echo "SKIP: OpenMPI's mpirun not installed"
fi

[ $failures -eq 0 ] && echo "run_test: all passed"
exit $((failures > 0))
