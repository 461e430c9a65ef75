#!/usr/bin/env bash
# launch_check under a real OpenMPI 4.1 `mpirun -np 2` (no MPI_Init: only the environment it
# exports, OMPI_COMM_WORLD_* together with PMIX_RANK, which must agree), with MASTER_ADDR and a
# free MASTER_PORT for the rendezvous.
set -uo pipefail
bin=$(realpath "$1")
source "$(dirname "$0")/check.sh"
source "$(dirname "$0")/../mpirun.sh"
port=$(python3 -c \
  'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=${TEST_TMPDIR:-$(mktemp -d)}/mpirun.out
if ! mpi_run 120 -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" "$bin" \
     --timeout_ms=60000 >"$out" 2>&1; then
  echo "FAIL: mpirun exited non-zero"; cat "$out"; exit 1
fi
env_check=$(mpi_run 60 -np 1 env | grep -c '^PMIX_RANK=0$')
if [ "$env_check" -ne 1 ]; then
  echo "FAIL: mpirun no longer exports PMIX_RANK: the agreement check is not exercised"; exit 1
fi
check_ranks "$out" 2 openmpi 0
