#!/usr/bin/env bash
# Runs every test (the default optimised build, then the tests again under ASan + UBSan) and
# ends with one line: "tests: N passed, M failed". GPU tests skip with a message where no GPU
# exists. Usage: tools/test.sh [--no-asan]
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
passed=0
failed=0
run() {
  local label=$1
  shift
  echo "== bazel test $* ($label)"
  bazel test "$@" //... 2>&1 | grep -v 'linux-sandbox' | tee "$log" |
    grep -E '^(//|ERROR|FAIL|Executed)' || true
  local p f
  p=$(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log")
  f=$(grep -cE '^//\S+\s+(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log")
  if grep -q '^ERROR:' "$log" && [ "$f" -eq 0 ]; then f=1; fi  # a build error counts as a failure
  passed=$((passed + p))
  failed=$((failed + f))
}
run default
if [ "${1:-}" != "--no-asan" ]; then
  run asan --config=asan
fi
rm -f "$log"
echo "tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
