#!/bin/bash
# --json everywhere the CLI offers it: standard output is exactly one JSON document (parsed
# whole, not its last line) and the logs go to standard error. Small inputs: every verb runs in
# a second or two. Usage: json_test.sh <eplb binary> <source dir>
eplb=$1
src=$2
. "$src/tests/cli/lib.sh"
load="$src/data/deepseek-v3-sglang/prefill_in1024.json"
trace="$src/data/flame-moe-290m/routing_top6.csv"

# name, then the command: runs it, parses its standard output whole.
one_document() {
  local name=$1
  shift
  if ! "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"; then
    fail "$name: exit $?: $(tail -c 300 "$tmp/$name.err")"
    return
  fi
  /usr/bin/python3 - "$tmp/$name.out" "$name" <<'PY' || fail "$name: standard output is not one JSON document"
import json, sys
text = open(sys.argv[1]).read()
try:
    value = json.loads(text)  # the whole of it: a log line before or after fails here
except ValueError as e:
    print(f"{sys.argv[2]}: {e}; standard output was: {text[:300]!r}")
    sys.exit(1)
if not isinstance(value, dict):
    print(f"{sys.argv[2]}: a {type(value).__name__}, not an object")
    sys.exit(1)
PY
}

one_document plan "$eplb" plan --load "$load" --ranks 8 --redundant 32 -o "$tmp/p1.json" --json
one_document plan2 "$eplb" plan --load "$load" --ranks 8 --redundant 32 --policy deepseek \
  -o "$tmp/p2.json" --json
one_document migrate-plan "$eplb" migrate-plan --from "$tmp/p1.json" --to "$tmp/p2.json" \
  --expert-bytes 4096 --json
one_document simulate "$eplb" simulate --trace "$trace" --ranks 4 --redundant 8 --interval 4 \
  --window 4 --json
one_document run "$eplb" run --ranks 2 --layers 2 --steps 16 --interval 8 --window 8 \
  --tokens-per-rank 16 --verbose --json
# The runtime's log lines (--verbose) went to standard error.
grep -q "eplb runtime rank 0: connected" "$tmp/run.err" || fail "run: no log on standard error"
one_document run-elastic "$eplb" run --ranks 4 --layers 2 --steps 24 --interval 8 --window 8 \
  --tokens-per-rank 16 --kill-rank 1 --at-step 10 --json
one_document bench-placement "$eplb" bench placement --layers 2 --experts 16 --physical 24 \
  --ranks 4 --nodes 1 --repeat 1 --json
one_document bench-migration "$eplb" bench migration --layers 2 --experts 16 --physical 24 \
  --ranks 4 --nodes 1 --expert-bytes 4096 --repeat 1 --json
one_document bench-transport "$eplb" bench transport --backend inproc --ranks 2 --bytes 65536 \
  --json
one_document bench-control "$eplb" bench control --backend inproc --ranks 2 --iters 20 --json
one_document bench-runtime "$eplb" bench runtime --threads --ranks 4 --steps 60 --layers 2 \
  --json

[ "$failures" -eq 0 ] || exit 1
echo "every --json printed one JSON document"
