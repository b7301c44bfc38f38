#!/usr/bin/env bash
# The engines' real code against eplb, on the CPU (no GPU): installs the current vLLM and SGLang
# releases from the Python package index into a virtual environment with eplb (`pip install .`,
# the standard isolated build), then
#   - runs vLLM's own tests/distributed/test_eplb_algo.py, unchanged, with eplb registered through
#     its vllm.general_plugins entry point: EPLB_VLLM_POLICY=deepseek must pass every test,
#     sticky and balanced every test but test_basic_rebalance (it pins DeepSeek's exact output);
#   - runs vLLM's own tests/distributed/test_eplb_migration_scheduler.py, unchanged, with vLLM's
#     scheduler (EPLB_VLLM_SCHEDULER unset: nothing changes) and with eplb's in its place
#     (EPLB_VLLM_SCHEDULER=eplb): every test but test_schedule_migration_batches_is_deterministic,
#     which pins vLLM's exact batches (docs/integrations.md);
#   - runs scripts/conformance/vllm_rearrange.py: vLLM's real EplbState.rearrange on the CPU in 4
#     processes over gloo, with eplb's EPLB communicator (EPLB_VLLM_COMMUNICATOR=eplb) and with
#     vLLM's torch_gloo: every rank's weights equal the one-process reference after every
#     rearrangement; prints both wall times side by side;
#   - runs scripts/conformance/sglang_check.py: SGLang's dispatcher and
#     ExpertLocationMetadata.init_by_eplb with eplb installed, against SGLang's own outputs;
#   - prints the versions it ran against.
# Where the package index cannot be reached it says so and exits 0. Not part of the default suite
# (it downloads several GiB: torch with CUDA libraries, which import fine without a GPU).
#
# Usage: scripts/engine-conformance.sh [--vllm VERSION] [--sglang VERSION] [--only vllm|sglang]
#   EPLB_CONFORMANCE_VENV  the environment (default ~/.cache/eplb/engine-conformance; reused)
#   EPLB_TORCH_INDEX       an index URL for torch (e.g. a CPU-only wheel index), else PyPI's
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=/usr/bin/python3
venv=${EPLB_CONFORMANCE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/eplb/engine-conformance}
vllm_version="" sglang_version="" only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) vllm_version=$2; shift 2 ;;
    --sglang) sglang_version=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "engine-conformance: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$only" in ""|vllm|sglang) ;; *) echo "engine-conformance: --only $only is not vllm or sglang" >&2; exit 2 ;; esac

"$root/scripts/install-deps.sh"

# vLLM's test FILE in $work/DIR, run with vLLM's sources and `env ENV...` (settings, or -u
# NAME to unset one), the test DESELECT left out ("": none), its output in $work/LOG.log; says
# "vllm V FILE, LABEL: every test [but DESELECT] passed" or FAILED (and sets failed=1).
vllm_pytest() {
  local dir=$1 file=$2 label=$3 log=$4 deselect=$5
  shift 5
  local args=() scope="every test"
  if [ -n "$deselect" ]; then
    args=(--deselect "$file::$deselect")
    scope="every test but $deselect"
  fi
  if (cd "$work/$dir" && env "$@" PYTHONPATH="$src" "$venv/bin/python" -m pytest -q \
        -p no:cacheprovider "$file" "${args[@]}" 2>&1 | tee "$work/$log.log" | tail -n 3); then
    echo "vllm $vllm_version $file, $label: $scope passed"
  else
    echo "vllm $vllm_version $file, $label: FAILED"
    failed=1
  fi
}

# The newest release of a package on the index, or nothing when the index cannot be reached.
latest() {
  timeout 120 "$python" -m pip index versions "$1" 2>/dev/null | sed -n 's/^[^ ]* (\(.*\))$/\1/p' | head -n 1
}
probe=$(latest pip || true)
if [ -z "$probe" ]; then
  echo "engine-conformance: the Python package index is not reachable from here (pip index" \
       "versions pip failed): vLLM and SGLang cannot be installed, nothing was checked"
  exit 0
fi
[ -n "$vllm_version" ] || vllm_version=$(latest vllm)
[ -n "$sglang_version" ] || sglang_version=$(latest sglang)
echo "engine-conformance: vLLM $vllm_version, SGLang $sglang_version, environment $venv"

# Installs into the environment take its lock: other checkouts may share it.
lock="$(dirname "$venv")/venv.lock"
mkdir -p "$(dirname "$venv")"
if [ ! -x "$venv/bin/python" ]; then
  flock "$lock" "$python" -m venv "$venv"
fi
pip=(flock "$lock" "$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
torch_index=()
[ -n "${EPLB_TORCH_INDEX:-}" ] && torch_index=(--index-url "$EPLB_TORCH_INDEX")
"${pip[@]}" --upgrade pip
"${pip[@]}" "${torch_index[@]}" torch
# What importing the engines' EPLB modules needs (not their GPU stacks: they are installed
# without dependencies, and these are the ones their EPLB code paths import).
"${pip[@]}" numpy pytest psutil pyzmq urllib3 regex pydantic transformers aiohttp requests \
  pillow pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo prometheus_client \
  llguidance xgrammar orjson packaging starlette tqdm IPython
echo "engine-conformance: building and installing eplb (pip install ., isolated build)"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "${pip[@]}" --force-reinstall --no-deps "$root"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0

if [ "$only" != sglang ]; then
  # vLLM's tests live in its source distribution; its Python sources run without the compiled
  # extension, which the EPLB policy never imports.
  # Fetched from the index's simple API (PEP 691): `pip download` of an sdist would prepare its
  # metadata, which needs vLLM's whole build toolchain.
  "$venv/bin/python" - "$vllm_version" "$work" "${PIP_INDEX_URL:-https://pypi.org/simple}" <<'PY'
import hashlib, json, sys, urllib.request
version, folder, index = sys.argv[1:]
request = urllib.request.Request(f"{index.rstrip('/')}/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(request, timeout=120) as r:
    files = json.load(r)["files"]
name = f"vllm-{version}.tar.gz"
entry = next((f for f in files if f["filename"] == name), None)
if entry is None:
    sys.exit(f"engine-conformance: the index has no {name}")
path = f"{folder}/{name}"
urllib.request.urlretrieve(entry["url"], path)
digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
if digest != entry["hashes"].get("sha256", digest):
    sys.exit(f"engine-conformance: {name} does not match the index's sha256")
PY
  tar -xzf "$work"/vllm-*.tar.gz -C "$work"
  src=$(ls -d "$work"/vllm-*/ | head -n 1)
  mkdir -p "$work/vllm-tests"
  cp "$src/tests/distributed/test_eplb_algo.py" "$work/vllm-tests/"
  cp "$root/scripts/conformance/vllm_conftest.py" "$work/vllm-tests/conftest.py"
  for mode in deepseek sticky balanced; do
    deselect=""
    [ "$mode" = deepseek ] || deselect=test_basic_rebalance
    vllm_pytest vllm-tests test_eplb_algo.py "EPLB_VLLM_POLICY=$mode" "vllm-$mode" "$deselect" \
      EPLB_VLLM_POLICY="$mode"
  done

  # The migration scheduler (vLLM 0.34 and later), with vLLM's own and with eplb's in its place.
  scheduler_tests=$src/tests/distributed/test_eplb_migration_scheduler.py
  if [ -f "$scheduler_tests" ]; then
    mkdir -p "$work/vllm-scheduler-tests"
    cp "$scheduler_tests" "$work/vllm-scheduler-tests/"
    cp "$root/scripts/conformance/vllm_scheduler_conftest.py" \
      "$work/vllm-scheduler-tests/conftest.py"
    vllm_pytest vllm-scheduler-tests test_eplb_migration_scheduler.py \
      "EPLB_VLLM_SCHEDULER unset" vllm-scheduler-vllm "" -u EPLB_VLLM_SCHEDULER
    vllm_pytest vllm-scheduler-tests test_eplb_migration_scheduler.py \
      "EPLB_VLLM_SCHEDULER=eplb" vllm-scheduler-eplb \
      test_schedule_migration_batches_is_deterministic EPLB_VLLM_SCHEDULER=eplb
  else
    echo "vllm $vllm_version has no tests/distributed/test_eplb_migration_scheduler.py (it" \
         "predates the migration scheduler): eplb's drop-in for it was not checked"
  fi

  # eplb's EPLB communicator inside vLLM's EplbState.rearrange, beside vLLM's torch_gloo.
  if ! (cd "$work" && PYTHONPATH="$src" VLLM_LOGGING_LEVEL=WARNING \
        "$venv/bin/python" "$root/scripts/conformance/vllm_rearrange.py" 2>"$work/rearrange.log"); then
    tail -n 30 "$work/rearrange.log"
    echo "vllm $vllm_version EplbState.rearrange with EPLB_VLLM_COMMUNICATOR=eplb: FAILED"
    failed=1
  fi
fi

if [ "$only" != vllm ]; then
  "${pip[@]}" --no-deps "sglang==$sglang_version"
  if ! (cd "$work" && "$venv/bin/python" "$root/scripts/conformance/sglang_check.py"); then
    failed=1
  fi
fi

versions=$("$venv/bin/python" -c 'import torch, eplb
print(f"torch {torch.__version__}, eplb {eplb.__version__}")')
echo "engine-conformance: ran against vLLM $vllm_version, SGLang $sglang_version ($versions)"
exit $failed
