#!/usr/bin/env bash
# The main job: install what is missing, build eplb, and compute a placement for the bundled
# real routing trace (FLAME-MoE-290M, 8 MoE layers x 64 experts, top-6) on 4 ranks with 8
# redundant slots, first as the DeepSeek reference would, then with eplb's balanced policy.
# Usage: scripts/main.sh [build-dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DEPLB_BUILD_TESTS=OFF \
  -DEPLB_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target eplb >/dev/null
eplb="$build/src/cli/eplb"
trace="$root/data/flame-moe-290m/routing_top6.csv"
echo "== the DeepSeek reference algorithm"
"$eplb" plan --load "$trace" --ranks 4 --redundant 8 --policy deepseek
echo
echo "== eplb's balanced policy"
"$eplb" plan --load "$trace" --ranks 4 --redundant 8 --policy balanced -o "$build/placement.json"
