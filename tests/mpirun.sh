# Shared by the MPI sh_tests (a sh_library they depend on), which source it:
#   source "$(dirname "$0")/../tests/mpirun.sh"
#   mpi_test_worlds <timeout_s> <binary> <np>...
# runs the binary under mpirun once per world size, in order, and fails on the first failing
# rank. The flags: CI containers run as root, and a test's ranks may outnumber the cores.
MPIRUN_FLAGS=(--allow-run-as-root --oversubscribe)

mpi_test_worlds() {
  local timeout_s="$1" bin="$2" np
  shift 2
  for np in "$@"; do
    echo "=== mpirun -np ${np} ${bin}"
    # timeout: a hang must fail the test, not stall CI.
    timeout "${timeout_s}" mpirun "${MPIRUN_FLAGS[@]}" -np "${np}" "${bin}"
  done
}
