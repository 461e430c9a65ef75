#!/usr/bin/env bash
# The C trainer on 2 in-process ranks, then as 2 MPI processes.
set -euo pipefail
source "$(dirname "$0")/../mpirun.sh"
"$1"
mpi_test_worlds 300 "$1" 2
