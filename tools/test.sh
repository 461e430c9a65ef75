#!/usr/bin/env bash
# Runs every test (the default optimised build, then the tests again under ASan + UBSan, then
# the consumers of an installed tree, tests/consumers/run.sh, then the GPU bundle's dry run,
# tools/gpu_bundle/dry_run.sh, then each fuzz target for ZERORT_FUZZ_SECONDS, default 45,
# through tools/fuzz.sh) and ends with one line:
# "tests: N passed, M failed". GPU tests skip with a message where no GPU exists.
# Usage: tools/test.sh [--no-asan] [--no-fuzz]   (CI runs everything)
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
passed=0
failed=0
asan=1
fuzz=1
for arg in "$@"; do
  case $arg in
    --no-asan) asan=0 ;;
    --no-fuzz) fuzz=0 ;;
    *) echo "usage: tools/test.sh [--no-asan] [--no-fuzz]" >&2; exit 2 ;;
  esac
done
# Adds the PASSED and FAILED result lines in $log (bazel test's, or tools/fuzz.sh's) to the counts.
count() {
  local p f
  p=$(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log")
  f=$(grep -cE '^//\S+\s+(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log")
  if grep -q '^ERROR:' "$log" && [ "$f" -eq 0 ]; then f=1; fi  # a build error counts as a failure
  passed=$((passed + p))
  failed=$((failed + f))
}
run() {
  local label=$1
  shift
  echo "== bazel test $* ($label)"
  bazel test "$@" //... 2>&1 | grep -v 'linux-sandbox' | tee "$log" |
    grep -E '^(//|ERROR|FAIL|Executed)' || true
  count
}
run default
if [ "$asan" -eq 1 ]; then
  run asan --config=asan
fi
# Outside Bazel: install into a temporary prefix, build and run the CMake and pkg-config
# consumers there. Each PASSED/FAILED line of run.sh counts as one test.
consumers() {
  local prefix
  prefix=$(mktemp -d)
  echo "== installed-tree consumers (tools/install.sh, tests/consumers/run.sh)"
  if tools/install.sh "$prefix" >"$log" 2>&1; then
    tests/consumers/run.sh "$prefix" >"$log" 2>&1
    grep -E '^(PASSED|FAILED) ' "$log"
    passed=$((passed + $(grep -c '^PASSED ' "$log")))
    failed=$((failed + $(grep -c '^FAILED ' "$log")))
  else
    tail -20 "$log"
    echo "FAILED tools/install.sh"
    failed=$((failed + 1))
  fi
  rm -rf "$prefix"
}
consumers
# The GPU bundle (tools/gpu_bundle.sh) as a lent GPU machine would meet it, without the GPU: it
# builds, every binary finds its libraries and starts from an empty environment, and everything
# skips cleanly. Each PASSED/FAILED line of dry_run.sh counts as one test.
gpu_bundle() {
  echo "== GPU bundle dry run (tools/gpu_bundle/dry_run.sh)"
  local rc p f
  tools/gpu_bundle/dry_run.sh >"$log" 2>&1
  rc=$?
  grep -E '^(PASSED|FAILED) ' "$log"
  p=$(grep -c '^PASSED ' "$log")
  f=$(grep -c '^FAILED ' "$log")
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    tail -20 "$log"
    f=1
  fi
  passed=$((passed + p))
  failed=$((failed + f))
}
gpu_bundle
if [ "$fuzz" -eq 1 ]; then
  echo "== tools/fuzz.sh ${ZERORT_FUZZ_SECONDS:-45}"
  tools/fuzz.sh "${ZERORT_FUZZ_SECONDS:-45}" 2>&1 | tee "$log"
  count
fi
rm -f "$log"
# torchrun_test passes without running only when its venv could not be made for want of network.
torch_failed=$(getent passwd "$(id -u)" | cut -d: -f6)/.cache/zerort/venv-torch.failed
if [ -f "$torch_failed" ] && grep -q '^no network' "$torch_failed"; then
  echo "skipped: //tests/launch:torchrun_test: $(cat "$torch_failed")"
fi
echo "tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
