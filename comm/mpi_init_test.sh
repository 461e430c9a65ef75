#!/bin/bash
# MpiSession::Init is bounded (mpi_init_test.cc): with 2 and 3 ranks, every rank but the last
# (which sleeps 60 s before MPI_Init) must print INIT_TIMEOUT_OK, well before the sleep ends.
# mpirun itself reports the job as failed (ranks left without MPI_Finalize), so its exit
# status is not the verdict; the ranks' lines are.
set -uo pipefail
source "$(dirname "$0")/../tests/mpirun.sh"
bin="$1"
reinit_bin="$2"
fail=0
for np in 2 3; do
  t0=$(date +%s)
  out=$(mpi_run 50 -np "${np}" "${bin}" 2>&1)
  rc=$?
  took=$(( $(date +%s) - t0 ))
  echo "--- np=${np} rc=${rc} wall=${took}s"
  echo "${out}" | grep "^rank " || true
  oks=$(echo "${out}" | grep -c "INIT_TIMEOUT_OK")
  if [[ ${oks} -ne $((np - 1)) || ${rc} -eq 124 ]]; then
    echo "FAIL: expected $((np - 1)) INIT_TIMEOUT_OK lines and no hang"
    echo "${out}"
    fail=1
  fi
done
# Init after MPI_Finalize is a status, not an abort inside OpenMPI (mpi_reinit_test.cc).
out=$(mpi_run 50 -np 1 "${reinit_bin}" 2>&1)
echo "--- reinit"
echo "${out}"
if ! echo "${out}" | grep -q "^REINIT_OK"; then
  echo "FAIL: Init after finalize did not return FailedPrecondition"
  fail=1
fi
exit ${fail}
