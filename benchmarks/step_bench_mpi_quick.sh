#!/bin/bash
# step_bench --mpi in its --quick mode under `mpirun -np 2` (CI): rank 0 must print a JSON
# object with one result per stage at world 2.
set -euo pipefail
source "$(dirname "$0")/../tests/mpirun.sh"
out=$(mpi_run 300 -np 2 "$1" --quick --model gpt --mpi --repeat 2)
echo "$out"
case "$out" in
  "{"*"}") ;;
  *) echo "step_bench --mpi did not print a JSON object" >&2; exit 1 ;;
esac
n=$(grep -c '"world": 2' <<<"$out" || true)
[[ "$n" == 4 ]] || { echo "expected 4 results at world 2, got ${n}" >&2; exit 1; }
