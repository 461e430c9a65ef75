#!/usr/bin/env bash
# On a machine with both Bazel and a GPU: builds the GPU bundle (tools/gpu_bundle.sh) into a
# temporary folder and runs it (DIR/run.sh), so that the tests, benchmarks and compute-sanitizer
# passes are the same as on a lent GPU machine, which has no Bazel (there: build the bundle here
# with tools/gpu_bundle.sh, copy it over, run DIR/run.sh; docs/cuda.md). Writes into OUTDIR
# what run.sh writes: summary.txt (PASSED / SKIPPED / FAILED per step), run.log,
# benchmarks.json; exits as run.sh does (1 if a step failed, or if a GPU test skipped although
# nvidia-smi lists a GPU).
#
# Usage: tools/gpu_check.sh OUTDIR [--quick]
set -uo pipefail

quick=()
case "${2:-}" in
  "") ;;
  --quick) quick=(--quick) ;;
  --asan)
    echo "gpu_check: --asan is gone: run.sh runs compute-sanitizer's memcheck on the GPU; the" \
      "host code's ASan + UBSan runs in tools/test.sh" >&2
    exit 2
    ;;
  *) set -- ;;
esac
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 OUTDIR [--quick]" >&2
  exit 2
fi
out=$1
cd "$(dirname "$0")/.." || exit 2
bundle=$(mktemp -d)
trap 'rm -rf "$bundle"' EXIT
tools/gpu_bundle.sh "$bundle" || exit 1
"$bundle/run.sh" "$out" "${quick[@]}"
