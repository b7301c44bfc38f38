#!/usr/bin/env bash
# End-to-end checks of `eplb plan`: the golden example, the bundled trace, every load format,
# and clear errors (non-zero exit, a message on stderr, no crash) for bad input.
# Usage: plan_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
. "$(dirname "$0")/lib.sh"

# The DeepSeek reference README example.
echo '{"load": [[90,132,40,61,104,165,39,4,73,56,183,86],[20,107,104,64,19,197,187,157,172,86,16,27]]}' >"$tmp/golden.json"
if "$eplb" plan --load "$tmp/golden.json" --physical 16 --groups 4 --nodes 2 --ranks 8 \
    --policy deepseek -o "$tmp/p.json" --json >"$tmp/out.json"; then
  grep -q '"phy2log":\[\[5,6,5,7,8,4,3,4,10,9,10,2,0,1,11,1\],\[7,10,6,8,6,11,8,9,2,4,5,1,5,0,3,1\]\]' "$tmp/p.json" \
    || fail "golden phy2log differs: $(head -c 300 "$tmp/p.json")"
  grep -q '"replica_count":\[\[1,2,1,1,2,2,1,1,1,1,2,1\],\[1,2,1,1,1,2,2,1,2,1,1,1\]\]' "$tmp/p.json" \
    || fail "golden replica_count differs"
  for field in policy layers experts physical ranks nodes balancedness balancedness_step \
      lower_bound_balancedness moved_slots compute_ms; do
    grep -q "\"$field\"" "$tmp/out.json" || fail "--json lacks $field"
  done
  [ "$(wc -l <"$tmp/out.json")" -eq 1 ] || fail "--json printed more than one line"
else
  fail "golden plan failed"
fi

# The bundled trace, every policy, then sticky from the balanced placement of the same load.
trace="$src/data/flame-moe-290m/routing_top6.csv"
for policy in deepseek balanced; do
  "$eplb" plan --load "$trace" --ranks 4 --redundant 8 --policy $policy -o "$tmp/$policy.json" \
    >"$tmp/table" || fail "plan --policy $policy on the trace failed"
  grep -q "balancedness" "$tmp/table" || fail "no table for $policy"
done
"$eplb" plan --load "$trace" --ranks 4 --redundant 8 --previous "$tmp/balanced.json" --json \
  >"$tmp/sticky.json" || fail "sticky from previous failed"
grep -q '"policy":"sticky"' "$tmp/sticky.json" || fail "--previous does not default to sticky"
grep -q '"moved_slots":0' "$tmp/sticky.json" || fail "sticky moved slots on an unchanged load: $(cat "$tmp/sticky.json")"

# --thorough at two slots per rank, on DeepSeek-V3's real loads at 144 ranks: said in --json,
# never less balanced than the default, never above the bound; sticky from it moves nothing.
real="$src/data/deepseek-v3-sglang/prefill_in4096.json"
for t in default thorough; do
  flag=$([ $t = thorough ] && echo --thorough)
  "$eplb" plan --load "$real" --ranks 144 --physical 288 --nodes 18 --policy balanced $flag \
    -o "$tmp/$t.json" --json >"$tmp/$t.out" || fail "plan --policy balanced $flag failed"
done
grep -q '"thorough":false' "$tmp/default.out" || fail "--json lacks thorough false: $(cat "$tmp/default.out")"
grep -q '"thorough":true' "$tmp/thorough.out" || fail "--json lacks thorough true: $(cat "$tmp/thorough.out")"
field() { grep -o "\"$1\":[0-9.e-]*" "$2" | head -1 | cut -d: -f2; }
awk -v d="$(field balancedness "$tmp/default.out")" -v t="$(field balancedness "$tmp/thorough.out")" \
    -v b="$(field lower_bound_balancedness "$tmp/thorough.out")" \
    'BEGIN { exit !(t >= d - 1e-12 && t <= b + 1e-9) }' \
  || fail "thorough balancedness out of [default, bound]: $(cat "$tmp/default.out" "$tmp/thorough.out")"
"$eplb" plan --load "$real" --ranks 144 --physical 288 --nodes 18 --thorough \
  --previous "$tmp/thorough.json" --json >"$tmp/sticky-thorough.out" \
  || fail "sticky --thorough from the thorough placement failed"
grep -q '"moved_slots":0' "$tmp/sticky-thorough.out" \
  || fail "sticky --thorough moved slots from balanced --thorough's placement: $(cat "$tmp/sticky-thorough.out")"

# Two slots per rank at 144 ranks on real loads: balanced is never above the bound, never below
# deepseek, and within 0.005 of the bound (its two stages and the count search's two-move step:
# docs/placement.md, "Two slots per rank at 144 ranks").
real="$src/data/deepseek-v3-sglang/prefill_in1024.json"
for p in balanced deepseek; do
  "$eplb" plan --load "$real" --ranks 144 --physical 288 --nodes 18 --groups 8 --policy $p --json \
    >"$tmp/two-$p.out" || fail "plan --policy $p at 144 ranks x 2 failed"
done
awk -v b="$(field balancedness "$tmp/two-balanced.out")" \
    -v d="$(field balancedness "$tmp/two-deepseek.out")" \
    -v lb="$(field lower_bound_balancedness "$tmp/two-balanced.out")" \
    'BEGIN { exit !(b >= d && b <= lb + 1e-9 && lb - b <= 0.005) }' \
  || fail "two slots at 144 ranks: balanced, deepseek, bound out of order or gap > 0.005: $(cat "$tmp/two-balanced.out" "$tmp/two-deepseek.out" | head -c 600)"

# Every load format gives the same placement for the same loads.
printf '{"load": [[5,1,1,1],[1,1,1,9]]}' >"$tmp/a.json"
printf '{"load": [[[2,1,0,1],[1,0,1,4]],[[3,0,1,0],[0,1,0,5]]]}' >"$tmp/steps.json"
printf '{"logical_count": [[[2,1,0,1],[1,0,1,4]],[[3,0,1,0],[0,1,0,5]]]}' >"$tmp/sglang.json"
printf '{"load_history": [{"logical_expert_load": [[2,1,0,1],[1,0,1,4]]}, {"logical_expert_load": [[3,0,1,0],[0,1,0,5]]}]}' >"$tmp/vllm.json"
printf '5,1,1,1\n1,1,1,9\n' >"$tmp/a.csv"
for f in a.json steps.json sglang.json vllm.json a.csv; do
  "$eplb" plan --load "$tmp/$f" --physical 6 --ranks 2 --policy deepseek -o "$tmp/out-$f.json" \
    >/dev/null || fail "format $f failed"
  grep -o '"phy2log":[^]]*\]\]' "$tmp/out-$f.json" >"$tmp/phy-$f" 2>/dev/null
  cmp -s "$tmp/phy-a.json" "$tmp/phy-$f" || fail "format $f gives another placement"
done

# Bad input: an error message and exit code 1 or 2, never a crash.
printf '{"load": [[1,2,3],[4,5]]}' >"$tmp/ragged.json"
printf '{"load": [[1,-2,3,4]]}' >"$tmp/neg.json"
printf '{"load": [[1,2,' >"$tmp/trunc.json"
printf '' >"$tmp/empty.json"
printf '1,2,x,4\n' >"$tmp/bad.csv"
printf '{"load": [[NaN,1,2,3]]}' >"$tmp/nan.json"
printf 'layer,token,experts,weights\n2,0,1 2 999,0.1 0.1 0.1\n' >"$tmp/trace.csv"
printf '{"load": [[1,2,3,4]]}' >"$tmp/ok.json"
expect_error() {  # description, expected text in the message, eplb args...
  local what=$1 text=$2
  shift 2
  "$eplb" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc -ne 1 ] && [ $rc -ne 2 ]; then fail "$what: exit $rc"; return; fi
  grep -q -- "$text" "$tmp/err" || fail "$what: message lacks '$text': $(cat "$tmp/err")"
}
for f in ragged.json neg.json trunc.json empty.json bad.csv nan.json; do
  expect_error "load $f" "$f" plan --load "$tmp/$f" --physical 8 --ranks 2
done
expect_error "trace experts outnumber slots" "physical 8 is below experts 1000" \
  plan --load "$tmp/trace.csv" --physical 8 --ranks 2
expect_error "missing file" "nope.json" plan --load "$tmp/nope.json" --physical 8 --ranks 2
expect_error "physical not a multiple" "physical 7 is not a multiple of ranks 2" \
  plan --load "$tmp/ok.json" --physical 7 --ranks 2
expect_error "physical below experts" "physical 2 is below experts 4" \
  plan --load "$tmp/ok.json" --physical 2 --ranks 2
expect_error "zero ranks" "ranks 0" plan --load "$tmp/ok.json" --physical 8 --ranks 0
expect_error "unknown policy" "unknown policy 'nope'" \
  plan --load "$tmp/ok.json" --physical 8 --ranks 2 --policy nope
expect_error "groups" "groups 3 does not divide experts 4" \
  plan --load "$tmp/ok.json" --physical 8 --ranks 2 --groups 3 --nodes 1 --policy deepseek
expect_error "redundant" "--redundant 3" plan --load "$tmp/ok.json" --redundant 3 --ranks 2
expect_error "sticky without previous" "previous" \
  plan --load "$tmp/ok.json" --physical 8 --ranks 2 --policy sticky
expect_error "thorough deepseek" "thorough applies to the balanced and sticky policies" \
  plan --load "$tmp/ok.json" --physical 8 --ranks 2 --policy deepseek --thorough
expect_error "unknown format" "xml" plan --load "$tmp/ok.json" --physical 8 --ranks 2 \
  --format xml
printf '{"physical_to_logical_map": [[0,1,2]]}' >"$tmp/prev3.json"
expect_error "previous of another shape" "prev" \
  plan --load "$tmp/ok.json" --physical 8 --ranks 2 --previous "$tmp/prev3.json"

if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "plan CLI: all checks passed"
