#!/usr/bin/env bash
# `pip install .` as a user runs it offline (Debian's packages, no build isolation), in a fresh
# virtual environment: the module imports, has the multi-machine backends whose Debian packages
# are installed, and declares both engines' plugin entry points.
# Usage: tests/packaging/pip_install.sh SOURCE_DIR   (ctest label: packaging, long)
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
# A copy of the sources: setuptools builds in ./build, which must not be the developer's tree.
tar -C "$src" --exclude='./build*' --exclude=./.git -cf - . | tar -C "$work" -xf - --one-top-level=src
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$work/venv/bin/pip" install --quiet --no-build-isolation \
  --no-deps --disable-pip-version-check "$work/src"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import importlib.metadata as md
import eplb
control, transport = eplb.control_backends(), eplb.transport_backends()
print("eplb", eplb.__version__, "control", control, "transport", transport)
for name in ("gloo", "mpi"):
    assert name in control, f"{name} missing from a pip install on a machine that has it"
assert "ucx" in transport, "ucx missing from a pip install on a machine that has it"
groups = {e.group: e.value for e in md.distribution("eplb").entry_points}
assert groups["vllm.general_plugins"] == "eplb.integrations.vllm:plugin", groups
assert groups["sglang.srt.plugins"] == "eplb.integrations.sglang:plugin", groups
import eplb.integrations.vllm, eplb.integrations.sglang
print("pip install: ok")
PY
