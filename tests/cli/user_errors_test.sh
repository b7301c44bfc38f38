#!/usr/bin/env bash
# User errors found by a probe of the CLI: option parse errors, loads whose layer sum overflows,
# a spread that overflows good loads, a bench shape past the limits, counts a double cannot
# hold. Each must end with one "eplb: error: ..." line naming the option or the value, exit 2,
# never CLI11's own exit codes, an internal check or NaN; --help and --version still exit 0.
# Usage: user_errors_test.sh <eplb binary> <source dir>
set -u
eplb=$1
. "$(dirname "$0")/lib.sh"

# expect_error NAME PATTERN COMMAND...: exit 2, one "eplb: error:" message matching PATTERN
# (grep -E), no internal check text, no NaN on either stream.
expect_error() {
  local name=$1 pattern=$2
  shift 2
  timeout 120 "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc -ne 2 ]; then
    fail "$name: exit $rc (expected 2): $(head -c 300 "$tmp/err")"
  elif ! grep -q "^eplb: error: " "$tmp/err" || grep -qE "internal error|heap.empty|\[.* at src/" "$tmp/err"; then
    fail "$name: not one clear error: $(head -c 300 "$tmp/err")"
  elif grep -qi "nan" "$tmp/out"; then
    fail "$name: NaN in the output: $(head -c 300 "$tmp/out")"
  elif ! grep -qE -- "$pattern" "$tmp/err"; then
    fail "$name: message does not match '$pattern': $(head -c 300 "$tmp/err")"
  fi
}

cd "$tmp" || exit 1

# Option parse errors: the CLI's prefix and exit status, the option named.
expect_error steps-abc "--steps abc is not an integer; see 'eplb run --help'" "$eplb" run --steps abc
expect_error metrics-port "--metrics-port 99999999999 is out of the range" \
  "$eplb" run --metrics-port 99999999999
expect_error unknown-flag "unexpected argument --no-such-flag for 'eplb run'" \
  "$eplb" run --no-such-flag
expect_error convert-no-input "input is required; see 'eplb convert --help'" "$eplb" convert
expect_error spread-no-value "--spread needs a value \(a number\)" "$eplb" simulate --spread
expect_error unknown-command "unknown command 'nope' \(expected plan, " "$eplb" nope
expect_error no-command "'eplb' needs a command" "$eplb"
# Per-step scoring of a history of huge counts: refused up front, not hours of token visits or
# a count rounded past int64.
printf '{"load": [[[1e12, 2e12, 3e11, 4e12], [1, 2, 3, 4]], [[1e12, 2e12, 3e11, 4e12], [1, 2, 3, 4]]]}' \
  >"$tmp/huge.json"
printf '{"load": [[[1e19, 2, 3, 4]], [[1, 2, 3, 4]]]}' >"$tmp/huger.json"
expect_error simulate-visits "would visit 1.4.*e\+13 token-expert pairs one by one .*--dispatch static,split,adaptive" \
  "$eplb" simulate --load-history "$tmp/huge.json" --ranks 2 --redundant 2 --interval 1 --window 1
expect_error simulate-count "step 0 layer 0 expert 0 has 1e\+19 \(at most 2\^48" \
  "$eplb" simulate --load-history "$tmp/huger.json" --ranks 2 --redundant 2 --interval 1 --window 1
"$eplb" simulate --load-history "$tmp/huge.json" --ranks 2 --redundant 2 --interval 1 --window 1 \
  --dispatch static,split,adaptive >"$tmp/out" 2>&1 || fail "huge counts without per-token dispatches: $(tail -n 2 "$tmp/out")"
# --seed of every verb: a negative, octal-looking or too large seed is refused, not wrapped.
expect_error seed-negative "--seed: -1 is not a seed \(expected an integer from 0 to 18446744073709551615\)" \
  "$eplb" run --seed -1
expect_error seed-octal "--seed: 010 is not a seed" "$eplb" simulate --seed 010
expect_error seed-too-large "--seed: 18446744073709551616 is not a seed" \
  "$eplb" bench placement --seed 18446744073709551616
expect_error seed-migration "--seed: 1.5 is not a seed" "$eplb" bench migration --seed 1.5
expect_error seed-runtime "--seed: x is not a seed" "$eplb" bench runtime --seed x
"$eplb" bench placement --layers 2 --experts 16 --physical 20 --ranks 4 --repeat 1 \
  --seed 18446744073709551615 >"$tmp/out" 2>&1 || fail "seed 2^64 - 1 refused: $(cat "$tmp/out")"
"$eplb" --help >"$tmp/out" 2>"$tmp/err" && grep -q "Usage:" "$tmp/out" \
  || fail "--help: exit $?: $(head -c 200 "$tmp/err")"
"$eplb" run --help >"$tmp/out" 2>"$tmp/err" && grep -q -- "--steps" "$tmp/out" \
  || fail "run --help: $(head -c 200 "$tmp/err")"
"$eplb" --version >"$tmp/out" 2>"$tmp/err" && [ -s "$tmp/out" ] || fail "--version: exit $?"

# Loads each finite, whose layer sums past what eplb takes: every policy and every verb that
# places refuses them naming the layer and the sum.
echo '{"load": [[1e308,1e308,1e308,1e308,1e308,1e308,1e308,1e308]]}' >big.json
echo '{"load": [[1,1,1,1,1,1,1,1]]}' >one.json
"$eplb" plan --load one.json --ranks 2 --redundant 2 -o previous.json >/dev/null || fail "plan one.json"
for policy in balanced sticky deepseek; do
  expect_error "overflow-$policy" "the loads of layer 0 sum to inf .*above 1e\+38" \
    "$eplb" plan --load big.json --ranks 2 --redundant 2 --policy $policy --previous previous.json
done
expect_error overflow-bench "the loads of layer 0 sum to inf" \
  "$eplb" bench placement --load big.json --physical 10 --ranks 2 --nodes 1 --groups 1 --repeat 1
expect_error overflow-bench-sticky "the loads of layer 0 sum to inf" \
  "$eplb" bench placement --load big.json --physical 10 --ranks 2 --nodes 1 --groups 1 \
  --repeat 1 --policy sticky
# Finite in double but past float32, in which deepseek computes.
echo '{"load": [[1e38,1e38,1e38,1e38,1e38,1e38,1e38,1e38]]}' >float32.json
expect_error overflow-float32 "the loads of layer 0 sum to 8e\+38, above 1e\+38" \
  "$eplb" plan --load float32.json --ranks 2 --redundant 2 --policy deepseek

# --spread that takes good loads past the bound is named, not the loads.
{
  printf '{"load_history": ['
  for s in $(seq 0 11); do
    [ "$s" -gt 0 ] && printf ','
    printf '{"logical_expert_load": [[%s,1,2,3,4,5,6,7]]}' $((s % 2))
  done
  printf ']}'
} >steps.json
expect_error spread "spread 1e\+308 \(--spread\) takes the load" \
  "$eplb" simulate --ranks 2 --redundant 2 --interval 4 --window 4 --load-history steps.json \
  --spread 1e308
"$eplb" simulate --ranks 2 --redundant 2 --interval 4 --window 4 --load-history steps.json \
  --spread 2 >/dev/null 2>"$tmp/err" || fail "simulate --spread 2: $(head -c 300 "$tmp/err")"

# The bench's shape is checked before its loads are sized.
expect_error bench-layers "--layers 100000 is outside \[1, 65536\]" \
  "$eplb" bench placement --layers 100000 --repeat 1
expect_error bench-experts "experts 100000000 is outside \[1, 65536\]" \
  "$eplb" bench placement --experts 100000000 --repeat 1

# Integer counts stay exact or are refused.
echo '{"load": [[9223372036854775807,1,2,3]]}' >int64.json
expect_error convert-int64 "load\[0\]\[0\] is 9223372036854775807, above 9007199254740992 \(2\^53\)" \
  "$eplb" convert int64.json --to eplb
echo '{"load": [[9007199254740992,1,2,3]]}' >exact.json
out=$("$eplb" convert exact.json --to csv 2>"$tmp/err") || fail "convert 2^53: $(head -c 300 "$tmp/err")"
[ "$out" = "9007199254740992,1,2,3" ] || fail "convert 2^53 wrote '$out'"

# Numbers that used to slip through, and options that named the wrong option: each verb names
# the option it was given, its value and the range, the way every other verb does.
expect_error changed-nan "--changed nan is not a number in \[0, 1\]" \
  "$eplb" bench migration --changed nan --repeat 1
expect_error changed-inf "--changed inf is outside \[0, 1\]" \
  "$eplb" bench migration --changed inf --repeat 1
expect_error token-us "--token-us 1e\+308 is outside \[0, 1e\+06\]" \
  "$eplb" simulate --load-history steps.json --ranks 2 --redundant 2 --interval 4 --window 4 \
  --token-us 1e308
expect_error migration-layers "--layers 100000 is outside \[1, 65536\] \(MoE layers\)" \
  "$eplb" bench migration --layers 100000 --repeat 1
expect_error transport-bytes "--bytes -1 is outside \[2, [0-9]+\]" \
  "$eplb" bench transport --backend shm --ranks 2 --bytes -1
expect_error transport-bytes-0 "--bytes 0 is outside \[2, [0-9]+\]" \
  "$eplb" bench transport --backend shm --ranks 2 --bytes 0
expect_error transport-ranks "--ranks 100 is outside \[1, 64\]" \
  "$eplb" bench transport --backend shm --ranks 100
expect_error run-layers "--layers -1 must not be negative" "$eplb" run --layers -1 --steps 2
expect_error run-verify "--verify 0 is not all, sample or a number N >= 1" \
  "$eplb" run --verify 0 --steps 2
expect_error run-trace-sample "--sample-tokens 10 is for sampled loads" \
  "$eplb" run --trace "$2/data/flame-moe-290m/routing_top6.csv" --sample-tokens 10 --steps 2
expect_error run-trace-top-k "--top-k 2 is for sampled loads" \
  "$eplb" run --trace "$2/data/flame-moe-290m/routing_top6.csv" --top-k 2 --steps 2
expect_error convert-to "--to 'bogus' is not a load format" "$eplb" convert steps.json --to bogus
expect_error convert-from "--from 'bogus' is not a load format" \
  "$eplb" convert steps.json --from bogus --to csv
head -c 100 steps.json >truncated.json
expect_error truncated "truncated.json: not valid JSON at byte" \
  "$eplb" simulate --load-history truncated.json --ranks 2 --redundant 2 --interval 4 --window 4
echo '{"load_history": [{"logical_expert_load": [[1,1,1,1,1,1,1,1]]}]}' >one-step.json
expect_error one-step "the input has 1 step, and a replay needs at least 2" \
  "$eplb" simulate --load-history one-step.json --ranks 2 --redundant 2 --interval 4 --window 4
expect_error window-past "--window 12 leaves no step to score: .* --window must be at most 11" \
  "$eplb" simulate --load-history steps.json --ranks 2 --redundant 2 --interval 4 --window 12
expect_error cost-empty "--cost '' is empty" \
  "$eplb" simulate --load-history steps.json --ranks 2 --redundant 2 --interval 4 --window 4 \
  --cost ''
expect_error trace-empty "--trace '' is empty" "$eplb" run --trace '' --steps 2
echo '{}' >no-model.json
expect_error cost-no-parameter "--cost no-model.json gives no cost model parameter" \
  "$eplb" simulate --load-history steps.json --ranks 2 --redundant 2 --interval 4 --window 4 \
  --cost no-model.json
expect_error control-ranks-trailing "--ranks '2,' is not a list of integers: item 2 is empty" \
  "$eplb" bench control --backend shm --ranks 2, --iters 10
expect_error control-ranks-gap "--ranks '2,,3' is not a list of integers: item 2 is empty" \
  "$eplb" bench control --backend shm --ranks 2,,3 --iters 10
expect_error runtime-ranks-gap "--ranks '8,,32' is not a list of integers" \
  "$eplb" bench runtime --threads --ranks 8,,32
expect_error runtime-threads-lag "--lag 0 is outside \[1, 1024\]" \
  "$eplb" bench runtime --threads --lag 0
echo '{"load": [[1,2,3,4,5,6,7,8]], "load": [[1,1,1,1,1,1,1,1]]}' >duplicate.json
expect_error duplicate-key "duplicate.json: the key 'load' appears twice in the top-level object" \
  "$eplb" plan --load duplicate.json --ranks 2 --redundant 2
echo '{"load": [[[1e308,1e308,1,1]],[[1e308,1e308,1,1]],[[1,1,1,1]]]}' >step-sum.json
expect_error csv-step-sum "layer 0 expert 0 sum over 3 steps past the largest double" \
  "$eplb" convert step-sum.json --to csv
expect_error simulate-step-sum "the loads of layer 0 expert 0, each finite, sum over steps \[0, 2\) past the largest double" \
  "$eplb" simulate --load-history step-sum.json --ranks 2 --redundant 2 --interval 1 --window 2

[ $failures -eq 0 ] && echo "user errors: all checks passed"
exit $((failures > 0))
