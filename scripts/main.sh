#!/usr/bin/env bash
# The main job: install what is missing, build eplb, and run the expert-parallel serving
# emulator on its defaults: 8 rank processes serve tokens drawn from DeepSeek-V3's real expert
# loads (data/deepseek-v3-sglang/prefill_in1024.json: its first 6 MoE layers x 256 experts,
# top-8) through real expert FFNs, route each step with `adaptive` dispatch, rebalance the
# experts live (`balanced` placement, async), verify outputs bit for bit, and print what
# rebalancing bought and cost.
# Usage: scripts/main.sh [build-dir] [-- extra eplb run options]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then build=$1; shift; fi
[ "${1:-}" = "--" ] && shift
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target eplb >/dev/null
exec "$build/src/cli/eplb" run "$@"
