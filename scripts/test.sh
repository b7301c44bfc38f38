#!/usr/bin/env bash
# Builds everything and runs every test: install what is missing, configure, build, ctest.
# Usage: scripts/test.sh [--sanitize address,undefined|thread | --cuda | --long] [build-dir]
#   --sanitize: build in build-<sanitizer> with -DEPLB_SANITIZE=... and run the suite under it.
#   --cuda:     build the CUDA layer in build-cuda (-DEPLB_WITH_CUDA=ON; needs nvcc, not a GPU)
#               and run its tests, which skip with a message where there is no GPU
#               (scripts/gpu-check.sh runs them, and the measurements, on a GPU machine).
#   --long:     the tests labelled long instead, in build/: the runtime soak, 500 kill trials,
#               256 thread ranks and the pip install; the default suite leaves them out and runs
#               a short version of each.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=""
cuda=0
long=0
if [ "${1:-}" = "--sanitize" ]; then
  sanitize=$2
  shift 2
elif [ "${1:-}" = "--cuda" ]; then
  cuda=1
  shift
elif [ "${1:-}" = "--long" ]; then
  long=1
  shift
fi
default_build="$root/build"
[ -n "$sanitize" ] && default_build="$root/build-${sanitize//,/-}"
[ "$cuda" = 1 ] && default_build="$root/build-cuda"
build=${1:-$default_build}

"$root/scripts/install-deps.sh"

config=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
# A compiler cache: rebuilds, and the CUDA stage's C++ (the same sources and flags as the
# normal build's), come from it. CCACHE_BASEDIR makes its keys independent of where the
# checkout is, so every build folder of a clone shares it.
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
  config+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
           -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
if [ -n "$sanitize" ]; then
  config+=(-DEPLB_SANITIZE="$sanitize" -DEPLB_BUILD_BENCHMARKS=OFF)
  export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1}  # leak checking is on by default
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
fi
if [ "$cuda" = 1 ]; then
  nvcc=$(command -v nvcc || true)
  [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
  if [ -z "$nvcc" ]; then
    echo "scripts/test.sh --cuda: no nvcc on PATH or in /usr/local/cuda/bin (install the CUDA" \
         "toolkit)" >&2
    exit 1
  fi
  config+=(-DEPLB_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DEPLB_WITH_PYTHON=OFF)
  cmake -S "$root" -B "$build" "${config[@]}"
  cmake --build "$build" -j"$(nproc)" --target eplb_cuda_tests eplb_cuda_routing_bench \
    eplb_cuda_transport_measure
  cd "$build"
  ctest --output-on-failure -L cuda --timeout 600
  exit 0
fi
cmake -S "$root" -B "$build" "${config[@]}"
cmake --build "$build" -j"$(nproc)"
cd "$build"
if [ "$long" = 1 ]; then
  ctest --output-on-failure -L long --timeout 3600
else
  ctest --output-on-failure -j"$(nproc)" --timeout 600 -LE long
fi
