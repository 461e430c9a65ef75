#!/bin/bash
# HSDP with real shard groups under MPI: 4 processes as 2 shard groups of 2 (oversubscribed on
# small machines: tests/mpirun.sh passes --oversubscribe).
set -euo pipefail
source "$(dirname "$0")/../tests/mpirun.sh"
mpi_test_worlds 300 "$1" 4
