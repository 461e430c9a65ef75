#!/bin/bash
# hpZ and the hierarchical gather under MPI: 4 processes (2 "nodes" of 2 ranks).
set -euo pipefail
source "$(dirname "$0")/../tests/mpirun.sh"
mpi_test_worlds 300 "$1" 4
