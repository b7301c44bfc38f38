#!/usr/bin/env bash
# The engines' files end to end: `eplb plan` on SGLang's published expert statistics (2-D float
# logical_count with the all-zero rows of dense layers), `--write-format sglang` (what SGLang's
# --init-expert-location reads), and `eplb convert` between every load format.
# Usage: engine_files_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
py=/usr/bin/python3
. "$(dirname "$0")/lib.sh"
stats="$src/data/deepseek-v3-sglang/prefill_in1024.json"

# DeepSeek's prefill layout on the real loads. The 3 dense layers are placed trivially and left
# out of the means: the deepseek figure is the mean over the 58 MoE layers (0.869, the data's
# README), not 0.876 with three perfect layers counted in.
for policy in deepseek balanced; do
  "$eplb" plan --load "$stats" --ranks 32 --nodes 4 --groups 8 --physical 288 --policy $policy \
    --write-format sglang -o "$tmp/$policy.loc.json" --json >"$tmp/$policy.out" \
    || fail "plan --policy $policy on $stats failed"
done
"$eplb" plan --load "$stats" --ranks 32 --nodes 4 --groups 8 --physical 288 --policy balanced \
  >"$tmp/table" || fail "plan table failed"
grep -q "dense" "$tmp/table" || fail "the table does not mark the dense layers"
$py - "$tmp" <<'PY' || fail "plan on SGLang's statistics"
import json, math, sys
t = sys.argv[1]
d = {p: json.load(open(f"{t}/{p}.out")) for p in ("deepseek", "balanced")}
for p, o in d.items():
    assert o["layers"] == 61 and o["moe_layers"] == 58 and o["dense_layers"] == 3, o
    b = o["balancedness"]
    assert isinstance(b, float) and math.isfinite(b) and 0 < b <= 1, o
    loc = json.load(open(f"{t}/{p}.loc.json"))
    assert list(loc) == ["physical_to_logical_map"], list(loc)  # SGLang passes it as **kwargs
    m = loc["physical_to_logical_map"]
    assert len(m) == 61 and all(len(r) == 288 for r in m)
    assert all(sorted(set(r)) == list(range(256)) for r in m)
    if p == "balanced":  # dense layers: the trivial placement
        assert all(m[l] == [q % 256 for q in range(288)] for l in range(3)), m[0][250:]
assert abs(d["deepseek"]["balancedness"] - 0.869) < 0.0015, d["deepseek"]["balancedness"]
assert d["balanced"]["balancedness"] >= d["deepseek"]["balancedness"]
PY

# The SGLang placement reads back as --previous: sticky keeps every slot on the same loads.
"$eplb" plan --load "$stats" --ranks 32 --nodes 4 --groups 8 --physical 288 \
  --previous "$tmp/balanced.loc.json" --json >"$tmp/sticky.out" || fail "sticky from SGLang's file"
grep -q '"moved_slots":0' "$tmp/sticky.out" || fail "sticky moved slots: $(cat "$tmp/sticky.out")"

# The benchmark on the real loads: their layers and experts, the MoE layers' mean.
"$eplb" bench placement --load "$stats" --policy deepseek --repeat 1 --json >"$tmp/bench.out" \
  || fail "bench placement --load"
$py -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(not (d['layers'] == 61 and d['experts'] == 256 and abs(d['balancedness'] - 0.869) < 0.0015))" \
  "$tmp/bench.out" || fail "bench placement --load: $(cat "$tmp/bench.out")"

# An all-dense file: nothing to balance, no division by zero.
printf '{"logical_count": [[0.0,0.0,0.0,0.0],[0,0,0,0]]}' >"$tmp/dense.json"
"$eplb" plan --load "$tmp/dense.json" --ranks 2 --physical 6 --policy balanced --json \
  >"$tmp/dense.out" || fail "plan on an all-dense file"
grep -q '"balancedness":1.0' "$tmp/dense.out" || fail "all-dense balancedness: $(cat "$tmp/dense.out")"
grep -q '"moe_layers":0' "$tmp/dense.out" || fail "all-dense moe_layers: $(cat "$tmp/dense.out")"

# convert: every format to every other, the loads unchanged (csv sums the steps).
printf '{"load": [[[2,1,0,1.5],[1,0,1,4]],[[3,0,1,0],[0,1,0,5]]]}' >"$tmp/steps.json"
for to in eplb sglang vllm csv; do
  "$eplb" convert "$tmp/steps.json" --to $to -o "$tmp/c.$to" >"$tmp/msg" || fail "convert to $to"
  grep -q "eplb -> $to" "$tmp/msg" || fail "convert to $to says: $(cat "$tmp/msg")"
  for back in eplb sglang vllm; do
    "$eplb" convert --from $to "$tmp/c.$to" --to $back -o "$tmp/c.$to.$back" >/dev/null \
      || fail "convert $to -> $back"
  done
done
$py - "$tmp" <<'PY' || fail "convert changed the loads"
import json, sys
t = sys.argv[1]
steps = [[[2, 1, 0, 1.5], [1, 0, 1, 4]], [[3, 0, 1, 0], [0, 1, 0, 5]]]
total = [[sum(s[l][e] for s in steps) for e in range(4)] for l in range(2)]
def loads(path):
    d = json.load(open(path))
    if "load" in d: v = d["load"]
    elif "logical_count" in d: v = d["logical_count"]
    else: v = [x["logical_expert_load"] for x in d["load_history"]]
    return v if isinstance(v[0][0], list) else [v]
for to in ("eplb", "sglang", "vllm", "csv"):
    for back in ("eplb", "sglang", "vllm"):
        got = loads(f"{t}/c.{to}.{back}")
        want = [total] if to == "csv" else steps
        assert got == want, (to, back, got)
assert [list(map(float, l.split(","))) for l in open(f"{t}/c.csv").read().split()] == total
PY
# The real file: SGLang -> vLLM -> eplb -> SGLang gives the file's numbers back.
"$eplb" convert --from sglang --to vllm "$stats" -o "$tmp/v.json" >/dev/null &&
  "$eplb" convert --to eplb "$tmp/v.json" -o "$tmp/e.json" >/dev/null &&
  "$eplb" convert --to sglang "$tmp/e.json" -o "$tmp/s.json" >/dev/null || fail "convert the real file"
$py -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); sys.exit(a!=b)" \
  "$stats" "$tmp/s.json" || fail "the real file changed through sglang -> vllm -> eplb -> sglang"
"$eplb" convert "$tmp/steps.json" --to sglang | grep -q '^{"logical_count":\[\[\[' \
  || fail "convert to standard output"

expect_error() {  # description, expected text in the message, eplb args...
  local what=$1 text=$2
  shift 2
  "$eplb" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc -ne 1 ] && [ $rc -ne 2 ]; then fail "$what: exit $rc"; return; fi
  grep -q -- "$text" "$tmp/err" || fail "$what: message lacks '$text': $(cat "$tmp/err")"
}
expect_error "convert to a trace" "--to trace" convert "$tmp/steps.json" --to trace
expect_error "convert to nothing" "xml" convert "$tmp/steps.json" --to xml
expect_error "convert a missing file" "nope.json" convert "$tmp/nope.json" --to eplb
expect_error "convert from the wrong format" "load_history" convert --from vllm "$tmp/steps.json" --to eplb
expect_error "bad --write-format" "--write-format yaml" plan --load "$tmp/steps.json" --ranks 2 \
  --physical 4 --write-format yaml -o "$tmp/x.json"

if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "engine files: all checks passed"
