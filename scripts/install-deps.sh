#!/usr/bin/env bash
# Installs the Debian 12 packages eplb builds and tests with; a no-op when all are present.
# Usage: scripts/install-deps.sh            (as root, or with sudo available)
set -euo pipefail

packages=(
  # build (ccache: scripts/test.sh compiles through it when present)
  cmake g++ make pkg-config ccache
  # libraries
  libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev
  libucx-dev libgloo-dev libhiredis-dev libopenmpi-dev openmpi-bin
  # tests and benchmarks
  libgtest-dev libgmock-dev librapidcheck-dev libbenchmark-dev redis-server
  # plots of eplb run / simulate
  gnuplot-nox
  # fuzzers and sanitizers (clang's libFuzzer and runtimes)
  clang libclang-rt-14-dev
  # python module and its tests
  python3 python3-dev python3-numpy python3-pytest python3-torch pybind11-dev
  # `pip install .` (setup.py, pyproject.toml): the offline build and its tests
  python3-pip python3-setuptools python3-wheel python3-venv
  # metrics: prometheus-cpp (core + pull) and the Python client the tests parse with
  prometheus-cpp-dev python3-prometheus-client
  # scripts/two-slots-exact.py (an integer program through scipy's HiGHS) and its test
  python3-scipy
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "installing: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
