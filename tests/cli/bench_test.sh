#!/usr/bin/env bash
# Smoke test of the `eplb bench` verbs at tiny sizes: each runs, prints one JSON object with the
# fields the README names, and refuses a bad value. Figures are not judged (timings never
# decide a test). Usage: bench_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
. "$(dirname "$0")/lib.sh"

check() {  # name, fields..., -- eplb args...
  local name=$1
  shift
  local fields=()
  while [ "$1" != "--" ]; do fields+=("$1"); shift; done
  shift
  if ! "$eplb" bench "$@" --json >"$tmp/out" 2>"$tmp/err"; then
    fail "$name exited $?: $(tail -c 300 "$tmp/err")"
    return
  fi
  [ "$(wc -l <"$tmp/out")" -eq 1 ] || fail "$name printed more than one line"
  for f in "${fields[@]}"; do
    grep -q "\"$f\"" "$tmp/out" || fail "$name lacks $f: $(cat "$tmp/out")"
  done
}

check placement policy ms_per_call balancedness -- placement --layers 2 --repeat 2
check placement-shape shape policy ms_min balancedness gap_to_bound identical_repeats -- placement \
  --shape v3-ep144 --policy sticky --repeat 2
check placement-all shapes v4-ep32 k2-ep64 v3-ep320 moved_fraction ms_min_vs_deepseek -- placement \
  --shape all --repeat 1
# --shape all computes each shape's bound once, for its first policy, and gives it to the others:
# sticky's row must carry the bound sticky alone reports (to rounding of the mean rank load).
"$eplb" bench placement --shape all --repeat 1 --json >"$tmp/all.json" 2>"$tmp/err" \
  || fail "placement --shape all: $(cat "$tmp/err")"
"$eplb" bench placement --shape v3-ep144 --policy sticky --repeat 1 --json >"$tmp/one.json" \
  2>"$tmp/err" || fail "placement --shape v3-ep144 --policy sticky: $(cat "$tmp/err")"
/usr/bin/python3 - "$tmp/all.json" "$tmp/one.json" <<'PY' || fail "placement --shape all: sticky's bound differs from its own"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["shapes"] if r["shape"] == "v3-ep144"]
one = json.load(open(sys.argv[2]))["lower_bound_balancedness"]
assert len(rows) == 3 and all(abs(r["lower_bound_balancedness"] - one) < 1e-12 for r in rows), (rows, one)
PY
check placement-thorough thorough balancedness -- placement --shape v3-ep144 --policy balanced \
  --thorough --repeat 1
grep -q '"thorough":true' "$tmp/out" || fail "placement --thorough: $(cat "$tmp/out")"
check placement-all-thorough shapes -- placement --shape all --thorough --repeat 1
grep -q '"policy":"sticky"[^}]*"thorough":true\|"thorough":true[^}]*"policy":"sticky"' "$tmp/out" \
  || fail "placement --shape all --thorough: no thorough sticky row"
# Real loads on every shape of their expert count (256: the 384-expert shapes are skipped), and
# sticky's tolerance in its rows.
real="$src/data/deepseek-v3-sglang/prefill_in1024.json"
check placement-all-real shapes skipped v3-ep144 v3-ep256 tolerance -- placement --shape all \
  --load "$real" --tolerance 0.05 --repeat 1
/usr/bin/python3 - "$tmp/out" <<'PY' || fail "placement --shape all --load: $(head -c 400 "$tmp/out")"
import json, sys
d = json.load(open(sys.argv[1]))
shapes = {r["shape"] for r in d["shapes"]}
assert shapes == {"v3-ep32", "v3-ep144", "v3-ep256", "v3-ep320"}, shapes
assert sorted(d["skipped"]) == ["k2-ep64", "v4-ep32"], d["skipped"]
for r in d["shapes"]:
    assert r["layers"] == 61 and r["experts"] == 256, r
    if r["policy"] == "sticky":
        # Of the 58 MoE layers' slots: the 3 dense layers never move.
        assert r["tolerance"] == 0.05, r
        assert abs(r["moved_fraction"] - r["moved_slots"] / (58 * r["physical"])) < 1e-12, r
PY
# The tolerance reaches the policy: a looser one moves fewer slots on these loads.
moved_at() {
  "$eplb" bench placement --shape v3-ep256 --policy sticky --load "$real" --tolerance "$1" \
    --repeat 1 --json | /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["moved_slots"])'
}
tight=$(moved_at 0.01) loose=$(moved_at 0.05)
[ -n "$tight" ] && [ -n "$loose" ] && [ "$loose" -lt "$tight" ] \
  || fail "bench placement --tolerance: moved $tight at 0.01, $loose at 0.05 (expected fewer)"
# Sticky from balanced's placement of a given workload instead of a synthetic drift: from the
# same workload nothing moves (a drift would move some), from another most slots stay.
check placement-previous-same moved_slots -- placement --shape v3-ep144 --policy sticky \
  --load "$real" --previous-load "$real" --repeat 1
grep -q '"moved_slots":0[,}]' "$tmp/out" || fail "placement --previous-load (same): $(cat "$tmp/out")"
check placement-previous-load moved_fraction -- placement --shape all --repeat 1 \
  --load "$src/data/deepseek-v3-sglang/prefill_in2048.json" --previous-load "$real"
/usr/bin/python3 - "$tmp/out" <<'PY' || fail "placement --previous-load: $(head -c 400 "$tmp/out")"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["shapes"] if r["policy"] == "sticky"]
assert len(rows) == 4 and all(0 < r["moved_fraction"] < 0.5 for r in rows), rows
PY
check migration rounds rounds_lower_bound bytes_total -- migration --layers 2 --repeat 2
check transport backend ranks bytes gbps memcpy_gbps ratio -- transport --backend shm --ranks 2 \
  --bytes 1048576
check transport-registered registered gbps ratio -- transport --backend shm --ranks 2 \
  --bytes 1048576 --registered
check transport-shareable memory gbps ratio -- transport --backend shm --ranks 2 \
  --bytes 1048576 --registered --shareable
check control backend ranks p50_us p99_us -- control --backend shm --ranks 2 --iters 50
# More ranks than this machine has cores: the shm waiters sleep on the futex.
check control-32 backend ranks p50_us p99_us -- control --backend shm --ranks 32 --iters 50
# A list of sizes: one JSON object a line, in the order given.
if "$eplb" bench control --backend shm --ranks 2,3 --iters 20 --json >"$tmp/out" 2>"$tmp/err"; then
  [ "$(wc -l <"$tmp/out")" -eq 2 ] || fail "control --ranks 2,3 printed $(wc -l <"$tmp/out") lines"
  grep -q '"ranks":2[,}]' "$tmp/out" && grep -q '"ranks":3[,}]' "$tmp/out" &&
    [ "$(grep -c '"p50_us"' "$tmp/out")" -eq 2 ] && [ "$(grep -c '"p99_us"' "$tmp/out")" -eq 2 ] ||
    fail "control --ranks 2,3: $(cat "$tmp/out")"
else
  fail "control --ranks 2,3 exited $?: $(tail -c 300 "$tmp/err")"
fi
check runtime async sync ratio_total ratio_max stall_max_ms stall_total_ms -- runtime --ranks 2 \
  --layers 4 --slots-per-rank 3 --expert-bytes 4096 --steps 60 --interval 10 --window 5 \
  --forward-ms 0.2
check runtime-engine async sync ratio_total weights -- runtime --ranks 2 --layers 4 \
  --slots-per-rank 3 --expert-bytes 4096 --steps 60 --interval 10 --window 5 --forward-ms 0.2 \
  --weights engine

"$eplb" bench transport --backend nope --ranks 2 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "nope" "$tmp/err" || fail "bench transport --backend nope: $(cat "$tmp/err")"
"$eplb" bench placement --shape nope >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "nope" "$tmp/err" && grep -q "v3-ep144" "$tmp/err" \
  || fail "bench placement --shape nope: $(cat "$tmp/err")"
"$eplb" bench placement --policy deepseek --thorough >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "thorough" "$tmp/err" || fail "bench placement deepseek --thorough: $(cat "$tmp/err")"
"$eplb" bench placement --policy nope >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "nope" "$tmp/err" || fail "bench placement --policy nope: $(cat "$tmp/err")"

for t in -0.1 1 nan; do
  "$eplb" bench placement --policy sticky --tolerance $t >/dev/null 2>"$tmp/err"
  [ $? -eq 2 ] && grep -q -- "--tolerance" "$tmp/err" \
    || fail "bench placement --tolerance $t: $(cat "$tmp/err")"
done
printf '{"load": [[1, 2, 3, 4]]}' >"$tmp/four.json"
"$eplb" bench placement --previous-load "$real" >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "needs --load" "$tmp/err" \
  || fail "bench placement --previous-load without --load: $(cat "$tmp/err")"
"$eplb" bench placement --policy sticky --load "$real" --previous-load "$tmp/four.json" \
  >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "1 layers x 4 experts" "$tmp/err" && grep -q "61 x 256" "$tmp/err" \
  || fail "bench placement --previous-load of another model: $(cat "$tmp/err")"
"$eplb" bench placement --shape all --load "$tmp/four.json" >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "4 experts" "$tmp/err" && grep -q "256" "$tmp/err" \
  || fail "bench placement --shape all --load (4 experts): $(cat "$tmp/err")"

if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "bench CLI: all checks passed"
