#!/usr/bin/env bash
# `eplb bench runtime --threads`: the runtime protocol with many ranks as threads of one
# process. Each run must complete rebalances with every invariant holding at every step
# (identical tables on every rank, the right expert in every slot, every layer switched at the
# same step everywhere), and bad input must be refused with a message naming it. Figures
# (timings) are not judged. Usage: bench_threads_test.sh <eplb binary> <source dir>
# EPLB_BENCH_THREADS_RANKS: the rank counts to run (default "32 128"; 32 alone under TSan).
set -u
eplb=$1
. "$(dirname "$0")/lib.sh"

run() {  # name, eplb bench runtime args...
  local name=$1
  shift
  "$eplb" bench runtime --threads "$@" --json >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc -ne 0 ]; then
    fail "$name exited $rc: $(tail -c 400 "$tmp/err")"
    return 1
  fi
}

# Prints the problems of the JSON in $tmp/out, nothing when it holds. Args: ranks, runs.
judge() {
  python3 - "$tmp/out" "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
ranks, runs = int(sys.argv[2]), int(sys.argv[3])
objs = [d] if runs == 1 else d.get("runs", [])
if len(objs) != runs:
    print(f"expected {runs} runs, got {len(objs)}")
if runs == 1 and d.get("ranks") != ranks:
    print(f"top-level ranks {d.get('ranks')} != {ranks}")
for o in objs:
    for k in ["ranks", "rebalances_completed", "invariant_failures", "step_end_p50_ms",
              "step_end_p99_ms", "agreement_p99_ms", "host_bytes_per_rank", "invariant_checks"]:
        if k not in o:
            print(f"lacks {k}")
    if o.get("invariant_failures") != 0:
        print(f"{o.get('mode')}: invariant_failures {o.get('invariant_failures')}: "
              f"{o.get('invariant_failures_by_check')}")
    if not o.get("rebalances_completed", 0) > 0:
        print(f"{o.get('mode')}: no rebalance completed")
    if o.get("rebalances_failed", 1) != 0:
        print(f"{o.get('mode')}: {o.get('rebalances_failed')} rebalances failed")
    if not o.get("host_bytes_per_rank", 0) > 0:
        print("host_bytes_per_rank is not positive")
PY
}

for ranks in ${EPLB_BENCH_THREADS_RANKS:-32 128}; do
  if run "$ranks ranks" --ranks "$ranks" --steps 120 --interval 20 --window 10 --seed 7; then
    problems=$(judge "$ranks" 1)
    [ -z "$problems" ] || fail "$ranks ranks: $problems"
  fi
done

# Both modes, engine weights (installs copy into the ranks' own tensors), a list of counts.
if run "both modes" --ranks 4,8 --mode both --weights engine --layers 3 --slots-per-rank 3 \
  --steps 60 --interval 10 --window 5 --max-delay-us 50; then
  problems=$(judge 0 4)
  [ -z "$problems" ] || fail "both modes: $problems"
fi

# One slot per rank (DeepSeek-V3's widest decode shape): fewer experts than ranks.
if run "one slot per rank" --ranks 16 --slots-per-rank 1 --experts 12 --layers 3 --steps 120 \
  --interval 20 --window 10; then
  problems=$(judge 16 1)
  [ -z "$problems" ] || fail "one slot per rank: $problems"
fi

refuse() {  # name, expected text, eplb bench runtime args...
  local name=$1 text=$2
  shift 2
  "$eplb" bench runtime "$@" >/dev/null 2>"$tmp/err"
  local rc=$?
  [ $rc -eq 2 ] && grep -q -- "$text" "$tmp/err" || fail "$name: exit $rc: $(cat "$tmp/err")"
}
refuse "threads with shm" "--transport 'shm' does not take --threads" --threads --ranks 8 \
  --transport shm
refuse "one rank" "--ranks 1 is outside" --threads --ranks 1
refuse "too many ranks" "--ranks 100000 is outside" --threads --ranks 100000
refuse "a list without threads" "--ranks takes one count without --threads" --ranks 4,8
refuse "inproc without threads" "--transport inproc needs --threads" --ranks 2 \
  --transport inproc
refuse "one slot, no experts given" "--experts has no default" --threads --ranks 8 \
  --slots-per-rank 1
refuse "more than memory" "thread ranks" --threads --ranks 64 --layers 4000 --window 100000 \
  --expert-bytes 8
refuse "negative delay" "--max-delay-us -1" --threads --ranks 8 --max-delay-us -1

if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "bench runtime --threads: all checks passed"
