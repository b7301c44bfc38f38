#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU (and ~16 cores), from the repository root,
# with nothing to download: configure a Release build with CUDA, build what the check needs, run
# the CUDA tests (which must not skip here) and the runtime tests, run the CUDA benchmarks, and
# print a summary block of figures to paste into docs/performance.md. A few minutes in all. The CUDA
# tests include the split and adaptive dispatch kernels against the CPU's routing, bit for bit
# (CudaSplitRouting.*), and routing-bench times them at DeepSeek-V3's shape.
#
# Usage: scripts/gpu-check.sh            (outputs also go to $OUT, or ./gpu-check-out)
#   BUILD_DIR=...   build folder (default build-gpu-check)
#   BUILD_TYPE=...  CMake build type (default Release)
#   JOBS=...        build parallelism (default 16)
set -euo pipefail

root=$(pwd)
if [ ! -f "$root/CMakeLists.txt" ] || [ ! -d "$root/src/transport" ]; then
  echo "gpu-check: run this from the eplb repository root" >&2
  exit 2
fi
out=${OUT:-$root/gpu-check-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${BUILD_DIR:-$root/build-gpu-check}
build_type=${BUILD_TYPE:-Release}
jobs=${JOBS:-16}
log="$out/gpu-check.log"
: >"$log"
started=$(date +%s)
problems=()

say() { echo "$*" | tee -a "$log"; }
step() { say ""; say "==== $* ($(( $(date +%s) - started )) s)"; }
# Runs a command, its output to the terminal, the log and $out/<name>.txt; returns its status.
run_logged() {
  local name=$1
  shift
  say "\$ $*"
  local rc=0
  "$@" 2>&1 | tee "$out/$name.txt" | tee -a "$log" || rc=${PIPESTATUS[0]}
  return "$rc"
}

# ---- 1. The machine ------------------------------------------------------------------------------
step "machine"
gpu="unknown GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
  run_logged nvidia-smi nvidia-smi || problems+=("nvidia-smi failed")
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
        head -1 || true)
else
  say "nvidia-smi not found: the CUDA tests will fail if there is no GPU"
  problems+=("no nvidia-smi")
fi
nvcc=""
if [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=/usr/local/cuda/bin/nvcc
elif command -v nvcc >/dev/null 2>&1; then
  nvcc=$(command -v nvcc)
else
  say "gpu-check: no nvcc (looked in /usr/local/cuda/bin and PATH): install the CUDA toolkit" >&2
  exit 1
fi
say "nvcc: $nvcc ($("$nvcc" --version | tail -1))"
say "cores: $(nproc), build jobs: $jobs"

# ---- 2. Configure --------------------------------------------------------------------------------
# UCX, gloo and MPI stay at their defaults unless this machine lacks them: a configure that stops
# on one of them is retried with that one off, and the summary says so.
step "configure ($build)"
config=(-DCMAKE_BUILD_TYPE="$build_type" -DEPLB_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc"
        -DEPLB_WITH_PYTHON=OFF -DEPLB_BUILD_FUZZERS=OFF)
turned_off=()
configured=0
for _ in 1 2 3 4; do
  if run_logged configure cmake -S "$root" -B "$build" "${config[@]}"; then
    configured=1
    break
  fi
  missing=""
  for dep in UCX GLOO MPI; do
    if grep -q "EPLB_WITH_$dep=ON but" "$out/configure.txt"; then missing=$dep; break; fi
  done
  if [ -z "$missing" ]; then break; fi
  say "note: $missing is missing on this machine: configuring again with -DEPLB_WITH_$missing=OFF"
  config+=("-DEPLB_WITH_$missing=OFF")
  turned_off+=("$missing")
done
if [ "$configured" -ne 1 ]; then
  say "gpu-check: configure failed (see $out/configure.txt)" >&2
  exit 1
fi

# ---- 3. Build ------------------------------------------------------------------------------------
step "build"
targets=(eplb_cuda_tests eplb_runtime_tests eplb_cuda_routing_bench eplb_cuda_transport_measure)
cmake --build "$build" --target help >"$out/targets.txt" 2>&1 || true
present=()
for t in "${targets[@]}"; do
  # (a generator without a "help" target lists nothing: then every target is tried)
  if grep -q -- "\\b$t\\b" "$out/targets.txt" || ! grep -q "eplb_" "$out/targets.txt"; then
    present+=("$t")
  else
    say "gpu-check: target $t is not defined in this build"
    problems+=("target $t missing")
  fi
done
if [ "${#present[@]}" -eq 0 ] || ! run_logged build cmake --build "$build" -j"$jobs" --target "${present[@]}"; then
  say "gpu-check: build failed (see $out/build.txt)" >&2
  exit 1
fi

# ---- 4. Tests ------------------------------------------------------------------------------------
# The CUDA tests run one at a time (they share the GPU, and one of them fills every SM); on this
# machine they must not skip, so EPLB_REQUIRE_GPU=1 turns a "no device" skip into a failure.
ctest_summary() {  # "<passed> passed, <failed> failed, <skipped> skipped of <total>" from a log
  local file=$1
  local total failed skipped
  total=$(grep -Eo "tests passed, [0-9]+ tests failed out of [0-9]+" "$file" | grep -Eo "[0-9]+$" || echo 0)
  failed=$(grep -Eo "[0-9]+ tests failed out of" "$file" | grep -Eo "^[0-9]+" || echo 0)
  skipped=$(grep -c "(Skipped)" "$file" || true)
  echo "$((total - failed - skipped)) passed, $failed failed, $skipped skipped, of $total"
}
step "ctest -L cuda"
cuda_rc=0
(cd "$build" && export EPLB_REQUIRE_GPU=1 &&
   run_logged ctest-cuda ctest -L cuda --output-on-failure --timeout 240) || cuda_rc=$?
cuda_line=$(ctest_summary "$out/ctest-cuda.txt")
if [ "$cuda_rc" -ne 0 ]; then problems+=("cuda tests failed"); fi
if grep -q "(Skipped)" "$out/ctest-cuda.txt"; then problems+=("cuda tests skipped on a GPU machine"); fi
if grep -q "No tests were found" "$out/ctest-cuda.txt"; then problems+=("no cuda tests found"); fi
# ctest shows a passing test's output only on failure: run the spin test once more for its line.
spin_line=""
if [ -x "$build/tests/cuda/eplb_cuda_tests" ] && [ "$cuda_rc" -eq 0 ]; then
  step "spin test, for its figures"
  if EPLB_REQUIRE_GPU=1 run_logged spin-test timeout 240 "$build/tests/cuda/eplb_cuda_tests" \
       --gtest_filter='*CudaSpin*:*CudaRuntimeSpin*'; then
    spin_line=$(grep -h "held all" "$out/spin-test.txt" | sed 's/^.*\] /  /' || true)
  else
    problems+=("spin test failed")
  fi
fi

step "ctest -L runtime"
runtime_rc=0
(cd "$build" && run_logged ctest-runtime \
   ctest -L runtime --output-on-failure --timeout 240 -j"$jobs") || runtime_rc=$?
runtime_line=$(ctest_summary "$out/ctest-runtime.txt")
if [ "$runtime_rc" -ne 0 ]; then problems+=("runtime tests failed"); fi

# ---- 5. Benchmarks -------------------------------------------------------------------------------
bench() {  # <name> <binary> : readable run, then --json, each saved to $out
  local name=$1 binary=$2
  if [ ! -x "$binary" ]; then
    say "gpu-check: $binary was not built"
    problems+=("$name not built")
    return 0
  fi
  step "$name"
  run_logged "$name" timeout 240 "$binary" || problems+=("$name failed")
  run_logged "$name-json" timeout 240 "$binary" --json || problems+=("$name --json failed")
}
bench routing-bench "$build/bench/cuda/eplb_cuda_routing_bench"
bench transport-measure "$build/bench/cuda/eplb_cuda_transport_measure"
for f in routing-bench transport-measure; do
  if [ -f "$out/$f.txt" ] && grep -qi "no CUDA device" "$out/$f.txt"; then
    problems+=("$f found no CUDA device")
  fi
done

# ---- 6. Summary ----------------------------------------------------------------------------------
elapsed=$(( $(date +%s) - started ))
{
  echo ""
  echo "===== eplb GPU check: summary ====="
  echo "GPU: $gpu"
  echo "nvcc: $("$nvcc" --version | tail -1)"
  if commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null); then
    git -C "$root" diff --quiet HEAD 2>/dev/null || commit="$commit (with local changes)"
    echo "commit: $commit"
  fi
  if [ "${#turned_off[@]}" -ne 0 ]; then echo "built without: ${turned_off[*]} (missing here)"; fi
  echo "ctest -L cuda:    $cuda_line"
  echo "ctest -L runtime: $runtime_line"
  if [ -n "$spin_line" ]; then
    echo "spin test (a layer pulled while a kernel holds every SM):"
    echo "$spin_line"
  fi
  for f in routing-bench transport-measure; do
    if [ -f "$out/$f.txt" ]; then
      echo ""
      echo "$f:"
      sed 's/^/  /' "$out/$f.txt"
    fi
  done
  echo ""
  echo "wall time: ${elapsed} s; outputs in $out"
  if [ "${#problems[@]}" -eq 0 ]; then
    echo "status: OK"
  else
    echo "status: FAILED ($(IFS=';'; echo "${problems[*]}"))"
  fi
} | tee "$out/summary.txt" | tee -a "$log"

[ "${#problems[@]}" -eq 0 ]
