#!/bin/bash
# examples/cpp_engine.cc as an engine runs: 4 rank processes started the way torchrun starts
# them (RANK, WORLD_SIZE, EPLB_RENDEZVOUS), once per control-plane backend named. Every rank
# compares each of its outputs with the single-process reference and exits 1 unless they all
# match and a rebalance installed layers; here every rank must exit 0, and rank 0's summary
# must say ok.
# Usage: cpp_engine_test.sh CPP_ENGINE BACKEND...
set -u
engine=$1
shift
ranks=4
scratch=$(mktemp -d "${TMPDIR:-/tmp}/eplb-cpp-engine-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
status=0
for backend in "$@"; do
  # gloo meets in a fresh folder (its FileStore); shm in a segment named for this run.
  rendezvous=eplb-cpp-engine-$$-$backend
  [ "$backend" = gloo ] && rendezvous=$scratch/gloo
  pids=()
  for ((r = 0; r < ranks; r++)); do
    # A rank whose peer died fails its next collective within the control timeout; the
    # timeout below only guards against a hang the engine should never have.
    RANK=$r WORLD_SIZE=$ranks EPLB_CONTROL_BACKEND=$backend EPLB_RENDEZVOUS=$rendezvous \
      EPLB_CONTROL_TIMEOUT_MS=60000 timeout -k 10 400 "$engine" shm \
      >"$scratch/$backend.$r.log" 2>&1 &
    pids+=($!)
  done
  failed=()
  for ((r = 0; r < ranks; r++)); do
    wait "${pids[r]}" || failed+=("rank $r exited $?")
  done
  summary=$(grep '^cpp_engine: ' "$scratch/$backend.0.log" | tail -1)
  if [ ${#failed[@]} -eq 0 ] && [[ $summary == *": ok" ]]; then
    echo "$backend: $summary"
    continue
  fi
  status=1
  echo "FAIL ($backend): ${failed[*]:-rank 0 printed no ok summary}"
  for ((r = 0; r < ranks; r++)); do
    echo "--- rank $r"
    cat "$scratch/$backend.$r.log"
  done
done
exit $status
