#!/bin/bash
# Runs an MPI test program under mpirun with 2 and then 4 ranks; fails if any rank fails.
set -euo pipefail
source "$(dirname "$0")/../tests/mpirun.sh"
mpi_test_worlds 120 "$1" 2 4
