#!/bin/bash
# Runs an MPI test program under mpirun with 2 and then 4 ranks; fails if any rank fails.
set -euo pipefail
bin="$1"
for np in 2 4; do
  echo "=== mpirun -np ${np} ${bin}"
  # timeout: a hang must fail the test, not stall CI.
  timeout 120 mpirun --allow-run-as-root --oversubscribe -np "${np}" "${bin}"
done
