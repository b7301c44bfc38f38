#!/usr/bin/env bash
# End-to-end checks of `eplb migrate-plan`: golden cases worked by hand, both placement formats,
# the table, --json and -o outputs, and clear errors for bad input.
# Usage: migrate_plan_test.sh <eplb binary> <source dir>
set -u
eplb=$1
. "$(dirname "$0")/lib.sh"

# expect_json FILE FIELD VALUE: the compact JSON in FILE has "FIELD":VALUE.
expect_json() {
  grep -q "\"$2\":$3[,}]" "$1" || fail "$2 is not $3 in: $(head -c 600 "$1")"
}

# Golden: old [0,0,1,1,1] -> new [0,0,0,0,0] on 5 ranks of 1 slot (eplb's format). Ranks 2, 3
# and 4 read expert 0 from ranks 0, 1, 0: rank 0 serves two peers, so two rounds at k = 1.
echo '{"version":1,"ranks":5,"nodes":1,"phy2log":[[0,0,1,1,1]]}' >"$tmp/old5.json"
echo '{"version":1,"ranks":5,"nodes":1,"phy2log":[[0,0,0,0,0]]}' >"$tmp/new5.json"
if "$eplb" migrate-plan --from "$tmp/old5.json" --to "$tmp/new5.json" --expert-bytes 100 --json \
    >"$tmp/out.json" 2>"$tmp/err"; then
  [ "$(wc -l <"$tmp/out.json")" -eq 1 ] || fail "--json printed more than one line"
  expect_json "$tmp/out.json" slots_unchanged 2
  expect_json "$tmp/out.json" slots_local_copy 0
  expect_json "$tmp/out.json" slots_free_ride 0
  expect_json "$tmp/out.json" slots_read_same_node 3
  expect_json "$tmp/out.json" slots_read_other_node 0
  expect_json "$tmp/out.json" bytes_total 300
  expect_json "$tmp/out.json" bytes_inter_node 0
  expect_json "$tmp/out.json" max_rank_bytes_in 100
  expect_json "$tmp/out.json" max_rank_bytes_out 200
  expect_json "$tmp/out.json" rounds 2
  expect_json "$tmp/out.json" rounds_lower_bound 2
  expect_json "$tmp/out.json" link_time 2
  expect_json "$tmp/out.json" link_time_lower_bound 2
  expect_json "$tmp/out.json" ranks 5
  expect_json "$tmp/out.json" ranks_assumed false
else
  fail "golden 5-rank plan failed: $(cat "$tmp/err")"
fi
"$eplb" migrate-plan --from "$tmp/old5.json" --to "$tmp/new5.json" --expert-bytes 100 \
  --peers-per-round 2 --json >"$tmp/out.json" || fail "golden 5-rank plan at k=2 failed"
expect_json "$tmp/out.json" rounds 1

# Golden: a 4-rank cycle in SGLang's format, 2 nodes: every rank reads one peer and serves one.
echo '{"physical_to_logical_map":[[0,1,2,3],[0,1,2,3]]}' >"$tmp/old4.json"
echo '{"physical_to_logical_map":[[1,2,3,0],[0,1,2,3]]}' >"$tmp/new4.json"
"$eplb" migrate-plan --from "$tmp/old4.json" --to "$tmp/new4.json" --expert-bytes 8 --ranks 4 \
  --nodes 2 --json -o "$tmp/plan.json" >"$tmp/out.json" 2>"$tmp/err" \
  || fail "4-rank cycle failed: $(cat "$tmp/err")"
expect_json "$tmp/out.json" slots_unchanged 4
expect_json "$tmp/out.json" slots_read_same_node 2
expect_json "$tmp/out.json" slots_read_other_node 2
expect_json "$tmp/out.json" bytes_inter_node 16
expect_json "$tmp/out.json" rounds 1
expect_json "$tmp/out.json" rounds_lower_bound 1
grep -q "note" "$tmp/err" && fail "a note on stderr although --ranks was given: $(cat "$tmp/err")"
# The full plan: actions of every slot and the reads with their rounds, per layer.
grep -q '"per_layer":\[' "$tmp/plan.json" || fail "-o plan lacks per_layer"
grep -q '"action":\["read_same_node","read_other_node","read_same_node","read_other_node"\]' \
  "$tmp/plan.json" || fail "-o plan actions differ: $(head -c 600 "$tmp/plan.json")"
grep -q '{"dst_rank":3,"dst_slot":3,"expert":0,"round":0,"src_rank":0,"src_slot":0}' \
  "$tmp/plan.json" || fail "-o plan lacks the read 0 -> 3"
"$eplb" migrate-plan --from "$tmp/old4.json" --to "$tmp/new4.json" --expert-bytes 8 --ranks 4 \
  --half-duplex --json >"$tmp/out.json" || fail "half duplex failed"
expect_json "$tmp/out.json" rounds 2
expect_json "$tmp/out.json" rounds_lower_bound 2
expect_json "$tmp/out.json" link_time 2
expect_json "$tmp/out.json" link_time_lower_bound 2
expect_json "$tmp/out.json" half_duplex true

# SGLang's format without --ranks: one slot per rank is assumed, and said on stderr only.
"$eplb" migrate-plan --from "$tmp/old4.json" --to "$tmp/new4.json" --expert-bytes 8 --nodes 2 \
  --json >"$tmp/out.json" 2>"$tmp/err" || fail "SGLang files without --ranks failed"
expect_json "$tmp/out.json" ranks 4
expect_json "$tmp/out.json" ranks_assumed true
grep -q -- "--ranks" "$tmp/err" || fail "no note about the assumed ranks: $(cat "$tmp/err")"

# The table: one row per layer and a total.
"$eplb" migrate-plan --from "$tmp/old4.json" --to "$tmp/new4.json" --expert-bytes 1048576 \
  --ranks 2 >"$tmp/table" 2>&1 || fail "table failed"
grep -q "^ *total" "$tmp/table" || fail "no total row: $(cat "$tmp/table")"
grep -q "rounds" "$tmp/table" || fail "no rounds column"
grep -q "^link time [0-9]* against a lower bound of [0-9]*" "$tmp/table" \
  || fail "no link time line: $(cat "$tmp/table")"

# Errors: non-zero exit, a message naming the value on stderr, never an internal error.
expect_error() {
  local want=$1
  shift
  if "$eplb" migrate-plan "$@" >"$tmp/out" 2>"$tmp/err"; then
    fail "accepted: $*"
  elif ! grep -q -- "$want" "$tmp/err"; then
    fail "message for '$*' lacks '$want': $(cat "$tmp/err")"
  elif grep -q "internal error" "$tmp/err"; then
    fail "internal error for '$*': $(cat "$tmp/err")"
  fi
}
o="--from $tmp/old4.json --to $tmp/new4.json"
expect_error "--expert-bytes 0" $o --expert-bytes 0
expect_error "--expert-bytes -5" $o --expert-bytes -5
expect_error "--peers-per-round 0" $o --expert-bytes 8 --peers-per-round 0
expect_error "not a multiple of --nodes 3" $o --expert-bytes 8 --ranks 4 --nodes 3
expect_error "not a multiple of ranks 3" $o --expert-bytes 8 --ranks 3
expect_error "disagrees" --from "$tmp/old5.json" --to "$tmp/new5.json" --expert-bytes 8 --ranks 1
echo '{"physical_to_logical_map":[[0,1,2,3]]}' >"$tmp/one_layer.json"
expect_error "2 layers" --from "$tmp/old4.json" --to "$tmp/one_layer.json" --expert-bytes 8
echo '{"physical_to_logical_map":[[0,1,2,3,0,1],[0,1,2,3,0,1]]}' >"$tmp/wide.json"
expect_error "physical slots" --from "$tmp/old4.json" --to "$tmp/wide.json" --expert-bytes 8
echo '{"physical_to_logical_map":[[0,1,2,2],[0,1,2,2]]}' >"$tmp/three.json"
expect_error "expert 3 (new slot 2) is in no slot of the old placement" \
  --from "$tmp/three.json" --to "$tmp/new4.json" --expert-bytes 8
expect_error "missing.json" --from "$tmp/missing.json" --to "$tmp/new4.json" --expert-bytes 8
echo '{"phy2log": [[0, 1], [2' >"$tmp/broken.json"
expect_error "broken.json" --from "$tmp/broken.json" --to "$tmp/new4.json" --expert-bytes 8
expect_error "expert-bytes" $o

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "migrate-plan: all checks passed"
