#!/bin/bash
# Runs the two MPI tests concurrently, N times each (default 20), while two busy-loop processes
# per core keep the machine loaded, and prints how many runs passed. No retries: Bazel's
# --flaky_test_attempts=1 makes the first failure of a run count.
#
#   tools/mpi_stress.sh [runs] [extra bazel test flags...]
#
# Exit status: 0 when every run of both tests passed.
set -uo pipefail
runs="${1:-20}"
shift || true
cd "$(dirname "$0")/.."

hogs=()
stop_hogs() {
  local pid
  for pid in "${hogs[@]}"; do kill "${pid}" 2>/dev/null; done
  wait 2>/dev/null
}
trap stop_hogs EXIT
cores=$(nproc)
for ((i = 0; i < 2 * cores; ++i)); do
  ( while :; do :; done ) &
  hogs+=("$!")
done
echo "mpi_stress: ${#hogs[@]} busy loops on ${cores} cores; ${runs} runs of each MPI test"

targets=(//comm:mpi_test //zero:engine_mpi_test)
log=$(mktemp)
t0=$(date +%s)
bazel test --runs_per_test="${runs}" --flaky_test_attempts=1 --nocache_test_results \
  --local_test_jobs=2 --test_output=errors "$@" "${targets[@]}" 2>&1 |
  grep -v linux-sandbox | tee "${log}"
rc=${PIPESTATUS[0]}
# Bazel writes one test.xml per run; count the runs that passed and failed from them.
passed=0
failed=0
for t in "${targets[@]}"; do
  pkg="${t#//}"; pkg="${pkg%%:*}"; name="${t##*:}"
  for dir in bazel-testlogs/"${pkg}"/"${name}"/run_*_of_"${runs}"; do
    [[ -d "${dir}" ]] || continue
    # A run passed when its test.xml exists and records neither a failure nor an error.
    if [[ -f "${dir}/test.xml" ]] && ! grep -q '<failure\|<error' "${dir}/test.xml"; then
      passed=$((passed + 1))
    else
      failed=$((failed + 1))
    fi
  done
done
echo "mpi_stress: $((passed)) of $((2 * runs)) runs passed, ${failed} failed," \
  "in $(( $(date +%s) - t0 )) s (bazel exit ${rc})"
rm -f "${log}"
[[ ${rc} -eq 0 && ${passed} -eq $((2 * runs)) ]]
