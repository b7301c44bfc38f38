#!/usr/bin/env bash
# Builds everything and runs every test: install what is missing, configure, build, ctest.
# Usage: scripts/test.sh [--sanitize address,undefined|thread] [build-dir]
#   --sanitize: build in build-<sanitizer> with -DEPLB_SANITIZE=... and run the suite under it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=""
if [ "${1:-}" = "--sanitize" ]; then
  sanitize=$2
  shift 2
fi
default_build="$root/build"
[ -n "$sanitize" ] && default_build="$root/build-${sanitize//,/-}"
build=${1:-$default_build}

"$root/scripts/install-deps.sh"

config=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
if [ -n "$sanitize" ]; then
  config+=(-DEPLB_SANITIZE="$sanitize" -DEPLB_BUILD_BENCHMARKS=OFF)
  export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1}  # leak checking is on by default
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
fi
cmake -S "$root" -B "$build" "${config[@]}"
cmake --build "$build" -j"$(nproc)"
cd "$build"
ctest --output-on-failure -j"$(nproc)" --timeout 600
