#!/usr/bin/env bash
# Builds and runs every gpu-tagged test and GPU benchmark, on a machine with a GPU, and writes
# what they print into OUTDIR:
#   OUTDIR/nvidia-smi.txt        the GPU and driver the run saw
#   OUTDIR/gpu_tests.log         bazel's output for the gpu-tagged tests
#   OUTDIR/<package>_<test>.log  each test's full log (Catch2 output, SKIPPED lines included)
#   OUTDIR/<benchmark>.json      each gpu-tagged benchmark's JSON (--quick with --quick)
#   OUTDIR/summary.txt           one line per test and benchmark: "ran on the GPU: passed",
#                                "SKIPPED (no GPU): <reason>" or "FAILED", the counts, then
#                                "gpu_check: OK" or "gpu_check: FAILED"
# Exits non-zero if a build or test fails, or if tests skipped although nvidia-smi sees a GPU
# (a driver/runtime mismatch would otherwise pass as "no GPU").
#
# Usage: tools/gpu_check.sh OUTDIR [--quick] [--asan]
#   --quick  benchmarks on small arrays (seconds instead of a minute)
#   --asan   run the tests a second time under --config=asan
set -uo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [--quick] [--asan]" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
shift
quick=""
asan=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick="--quick" ;;
    --asan) asan=1 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.." || exit 2

summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
failed=0

gpu_seen=0
if nvidia-smi >"$out/nvidia-smi.txt" 2>&1; then gpu_seen=1; fi
note "nvidia-smi: $([ $gpu_seen -eq 1 ] && echo 'GPU visible' || echo 'no GPU visible')"

# Tests are found by tag, so a new gpu test needs no change here.
tests=$(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>>"$out/gpu_tests.log")
if [ -z "$tests" ]; then
  note "no gpu-tagged tests found"
  failed=1
fi

# One line per test saying exactly what happened to it, then the counts.
run_tests() {
  local label=$1
  shift
  local run_log="$out/gpu_tests.$label.log"
  # Local strategy: the sandbox's read-only /dev remount is no place to debug a driver issue.
  bazel test "$@" --test_output=all --cache_test_results=no --strategy=TestRunner=local \
    $tests >"$run_log" 2>&1
  cat "$run_log" >>"$out/gpu_tests.log"
  local t ran=0 skipped=0 bad=0
  for t in $tests; do
    local rel=${t#//}
    local log="bazel-testlogs/${rel/://}/test.log"
    local name
    name=$(echo "$rel" | tr '/:' '__')
    [ "$label" = default ] || name="${name}.${label}"
    [ -f "$log" ] && cp "$log" "$out/$name.log"
    if ! grep -qE "^$t\s+PASSED" "$run_log"; then
      note "$t ($label): FAILED (see $name.log and gpu_tests.$label.log)"
      bad=$((bad + 1))
    elif grep -q "SKIPPED:" "$log"; then
      local why
      why=$(grep -m1 -A2 'SKIPPED:' "$log" | tr -s ' \n' ' ' | sed 's/^ *SKIPPED: *//')
      note "$t ($label): SKIPPED (no GPU): $why"
      skipped=$((skipped + 1))
    else
      note "$t ($label): ran on the GPU: passed"
      ran=$((ran + 1))
    fi
  done
  note "gpu tests ($label): $ran ran on the GPU and passed, $skipped skipped (no GPU), $bad failed"
  if [ $bad -gt 0 ]; then failed=1; fi
  # Skipping although nvidia-smi sees a GPU: a driver/runtime mismatch, not a pass.
  if [ $skipped -gt 0 ] && [ $gpu_seen -eq 1 ]; then failed=1; fi
}

if [ -n "$tests" ]; then
  run_tests default
  if [ $asan -eq 1 ]; then run_tests asan --config=asan; fi
fi

benches=$(bazel query 'attr(tags, "\bgpu\b", kind(cc_binary, //benchmarks/...))' 2>/dev/null)
for b in $benches; do
  name=${b##*:}
  if bazel build "$b" >>"$out/gpu_tests.log" 2>&1; then
    bin="bazel-bin/${b#//}"
    bin=${bin/://}
    if "$bin" $quick >"$out/$name.json" 2>"$out/$name.stderr"; then
      if grep -q '"skipped"' "$out/$name.json"; then
        note "$b: SKIPPED (no GPU): $(tr -s ' \n' ' ' <"$out/$name.json")"
        if [ $gpu_seen -eq 1 ]; then failed=1; fi
      else
        note "$b: ran on the GPU ($(grep -c . "$out/$name.json") lines of JSON in $name.json)"
      fi
    else
      note "$b: FAILED (see $name.stderr)"
      failed=1
    fi
  else
    note "$b: build FAILED"
    failed=1
  fi
done

if [ $failed -ne 0 ]; then
  note "gpu_check: FAILED"
elif [ $gpu_seen -eq 0 ]; then
  # Not "OK": nothing GPU-side was verified, only that it builds and the host halves pass.
  note "gpu_check: OK (no GPU visible: the CUDA code built and the host halves passed; nothing ran on a GPU)"
else
  note "gpu_check: OK"
fi
exit $failed
