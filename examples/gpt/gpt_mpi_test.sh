#!/bin/bash
# The GPT's stage equivalence under MPI: 2 processes, then 3 (uneven shards).
set -euo pipefail
source "$(dirname "$0")/../../tests/mpirun.sh"
mpi_test_worlds 300 "$1" 2 3
