#!/usr/bin/env bash
# Builds the libFuzzer targets (--config=fuzz: clang, ASan + UBSan; tests/fuzz/fuzz.bzl) and runs
# each for SECONDS (default 45) from its corpus folder tests/fuzz/<corpus>/, the project's own
# configs, model files, flag lines and manifests. New inputs go to a scratch folder, so a run
# leaves the tree unchanged unless it finds a failure: a crash, sanitizer report, leak, timeout
# (25 s per input) or out-of-memory keeps its input in tests/fuzz/<corpus>/ (crash-<sha1>, ...),
# where the target's *_corpus_test replays it in every `bazel test //...` until it is fixed.
# Prints one line per target as `bazel test` does ("//zero:config_fuzzer  PASSED in 45s"), which
# tools/test.sh counts. Usage: tools/fuzz.sh [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-45}
# label corpus-folder
targets=(
  "//zero:config_fuzzer config"
  "//zero:model_spec_fuzzer model_spec"
  "//cli:flags_fuzzer flags"
  "//checkpoint:ckpt_manifest_fuzzer ckpt_manifest"
)
labels=()
for t in "${targets[@]}"; do labels+=("${t%% *}"); done
if ! build_log=$(bazel build --config=fuzz "${labels[@]}" 2>&1); then
  echo "$build_log" | grep -E '^ERROR' | head -20
  for label in "${labels[@]}"; do echo "$label FAILED TO BUILD"; done
  exit 1
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
for t in "${targets[@]}"; do
  label=${t%% *}
  corpus=tests/fuzz/${t##* }
  binary=bazel-out/k8-optfuzz/bin/$(echo "${label#//}" | tr ':' '/')
  mkdir -p "$scratch/${t##* }"
  log="$scratch/${t##* }.log"
  start=$(date +%s)
  "$binary" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$corpus/" "$scratch/${t##* }" "$corpus" >"$log" 2>&1
  rc=$?
  elapsed=$(($(date +%s) - start))
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  if [ "$rc" -eq 0 ]; then
    echo "$label PASSED in ${elapsed}s (${runs:-?} inputs)"
  else
    status=1
    echo "$label FAILED in ${elapsed}s: input kept in $corpus/; libFuzzer's report:"
    grep -E 'ERROR|SUMMARY|Test unit written|runtime error|==[0-9]+==' "$log" | head -20 | sed 's/^/    /'
  fi
done
exit $status
