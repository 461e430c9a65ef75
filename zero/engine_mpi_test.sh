#!/bin/bash
# Stage equivalence under MPI: 2 processes (the issue's world), then 3 (uneven shards).
set -euo pipefail
source "$(dirname "$0")/../tests/mpirun.sh"
mpi_test_worlds 300 "$1" 2 3
