#!/usr/bin/env bash
# `eplb run --metrics FILE` and `--metrics-port PORT`: Prometheus text that prometheus_client
# parses, every rank labelled, figures that agree with the run's JSON; the endpoint serving
# every rank while the run goes on; a port in use refused with a clear message.
# Usage: metrics_test.sh <eplb binary> <source dir>
set -u
eplb=$1
src=$2
# The bundled trace (64 experts) and small experts rather than the default workload: these
# checks are of the metrics, and must stay quick under the sanitizers (ThreadSanitizer too).
small=(--trace "$src/data/flame-moe-290m/routing_top6.csv" --hidden 64 --intermediate 64)
py=/usr/bin/python3
. "$(dirname "$0")/lib.sh"
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
if ! $py -c "import prometheus_client" 2>/dev/null; then
  echo "python3-prometheus-client is not installed (scripts/install-deps.sh installs it)"
  exit 1
fi

"$eplb" run "${small[@]}" --ranks 4 --steps 32 --interval 8 --window 8 --metrics "$tmp/m.prom" --json \
  >"$tmp/run.json" 2>"$tmp/err" || fail "eplb run --metrics failed: $(tail -c 300 "$tmp/err")"
$py - "$tmp/m.prom" "$tmp/run.json" <<'PY' || fail "the metrics file"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
fams = {f.name: f for f in text_string_to_metric_families(open(sys.argv[1]).read())}
run = json.load(open(sys.argv[2]))
def samples(name, **labels):
    return [s for s in fams[name].samples if all(s.labels.get(k) == v for k, v in labels.items())]
assert {s.labels["rank"] for s in samples("eplb_steps")} == {"0", "1", "2", "3"}
assert all(s.value == run["steps"] for s in samples("eplb_steps"))
assert all(s.labels["mode"] == "async" for s in samples("eplb_steps"))
done = samples("eplb_rebalances", outcome="completed")
assert len(done) == 4 and all(s.value == run["rebalances"] for s in done), done
# Each rank counts what it received: together the run's bytes moved and copied.
remote = sum(s.value for s in samples("eplb_bytes_moved") if s.labels["path"] != "local_copy")
local = sum(s.value for s in samples("eplb_bytes_moved", path="local_copy"))
assert remote == run["bytes_moved"], (remote, run["bytes_moved"])
assert local == run["bytes_local_copy"], (local, run["bytes_local_copy"])
b = samples("eplb_balancedness")
assert b and all(0 < s.value <= 1 for s in b)
assert {s.labels["source"] for s in b} == {"recorded", "predicted_before", "predicted_after"}
assert fams["eplb_forward_stall_seconds"].type == "histogram"
PY

# --compare: the three modes in one file, told apart by their label.
"$eplb" run "${small[@]}" --ranks 2 --steps 16 --interval 8 --window 8 --compare --metrics "$tmp/c.prom" \
  >/dev/null 2>"$tmp/err" || fail "eplb run --compare --metrics failed: $(tail -c 300 "$tmp/err")"
$py - "$tmp/c.prom" <<'PY' || fail "the --compare metrics file"
import sys
from prometheus_client.parser import text_string_to_metric_families
fams = {f.name: f for f in text_string_to_metric_families(open(sys.argv[1]).read())}
assert {s.labels["mode"] for s in fams["eplb_steps"].samples} == {"off", "sync", "async"}
PY

# --metrics-port: scraped while the run goes on, every rank there.
port=$($py -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$eplb" run "${small[@]}" --ranks 4 --steps 100000 --interval 8 --window 8 --metrics-port "$port" \
  >"$tmp/live.out" 2>"$tmp/live.err" &
live=$!
$py - "$port" "$live" <<'PY' || fail "scraping 127.0.0.1:$port/metrics while running: $(tail -c 300 "$tmp/live.err")"
import os, sys, time, urllib.request
from prometheus_client.parser import text_string_to_metric_families
url = f"http://127.0.0.1:{sys.argv[1]}/metrics"
deadline = time.monotonic() + 120
seen = set()
steps = {}
while time.monotonic() < deadline:
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        print("the run ended before it was scraped")
        sys.exit(1)
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        time.sleep(0.2)
        continue
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    if "eplb_steps" in fams:
        for s in fams["eplb_steps"].samples:
            seen.add(s.labels["rank"])
            steps.setdefault(s.labels["rank"], []).append(s.value)
    # Every rank, and a later scrape saw more steps than an earlier one: live figures.
    if seen == {"0", "1", "2", "3"} and all(max(v) > min(v) for v in steps.values()):
        sys.exit(0)
    time.sleep(0.3)
print("ranks seen", sorted(seen), {r: (min(v), max(v)) for r, v in steps.items()})
sys.exit(1)
PY
# A second run on the same port while the first still serves: refused, naming the port.
"$eplb" run "${small[@]}" --ranks 2 --steps 4 --metrics-port "$port" >/dev/null 2>"$tmp/busy.err"
rc=$?
{ [ $rc -eq 1 ] || [ $rc -eq 2 ]; } || fail "a port in use: exit $rc"
grep -q "127.0.0.1:$port" "$tmp/busy.err" || fail "a port in use: $(cat "$tmp/busy.err")"
kill -INT $live 2>/dev/null
wait $live 2>/dev/null
"$eplb" run "${small[@]}" --ranks 2 --steps 4 --metrics-port 70000 >/dev/null 2>"$tmp/bad.err"
grep -q -- "--metrics-port 70000" "$tmp/bad.err" || fail "a bad port: $(cat "$tmp/bad.err")"

if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "metrics CLI: all checks passed"
