#!/bin/bash
# Stage equivalence under MPI: 2 processes (the world), then 3 (uneven shards).
set -euo pipefail
bin="$1"
for np in 2 3; do
  echo "=== mpirun -np ${np} ${bin}"
  timeout 300 mpirun --allow-run-as-root --oversubscribe -np "${np}" "${bin}"
done
