# Sourced by the tests/cli/*_test.sh scripts: a scratch folder removed on exit, and fail(),
# which reports a failed check and counts it in $failures (each script exits 1 when it is not 0).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
