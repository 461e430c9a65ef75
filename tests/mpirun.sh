# Shared by the MPI sh_tests (a sh_library they depend on), which source it:
#   source "$(dirname "$0")/../tests/mpirun.sh"
#   mpi_test_worlds <timeout_s> <binary> <np>...   # once per world size; fails on the first
#   mpi_run <timeout_s> <mpirun args...>            # one mpirun, isolated as below
#
# Isolation, so that MPI jobs running at once on one machine (Bazel runs tests in parallel, and
# its sandboxes give every job the same small PIDs, from which OpenMPI derives its job ids and
# shared-memory names) never meet. Each mpirun gets a fresh private directory (short, under
# /tmp: PMIx puts Unix sockets in it, whose paths may not exceed 107 bytes) holding
#  - TMPDIR and OpenMPI's session directory (orte_tmpdir_base);
#  - PMIx's server and system temporary directories, and PMIx's key-value store as a plain
#    hash (gds=hash) instead of the shared-memory "dstore", which failed with "PMIX ERROR ...
#    dstore" when two jobs started at once;
#  - the vader BTL's shared-memory backing files (btl_vader_backing_directory), which default
#    to /dev/shm under names two jobs could share: measured, two concurrent jobs then crashed
#    in mca_btl_vader_poll_handle_frag and in MPI_Finalize.
# mpi_yield_when_idle: ranks may outnumber cores (--oversubscribe), so OpenMPI's own blocking
# waits yield the core (our polled waits in comm/mpi.cc sleep too).
# --allow-run-as-root: CI containers run as root.
# timeout: a hang must fail the test, not stall CI. The directory is removed when mpirun returns.
MPIRUN_FLAGS=(--allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1)

mpi_run() {
  local timeout_s="$1" dir rc
  shift
  dir=$(mktemp -d /tmp/zrmpi.XXXXXX) || return 1
  timeout "${timeout_s}" env TMPDIR="${dir}" \
    OMPI_MCA_orte_tmpdir_base="${dir}" \
    OMPI_MCA_btl_vader_backing_directory="${dir}" \
    PMIX_MCA_gds=hash \
    PMIX_SERVER_TMPDIR="${dir}" \
    PMIX_SYSTEM_TMPDIR="${dir}" \
    mpirun "${MPIRUN_FLAGS[@]}" "$@" && rc=0 || rc=$?
  rm -rf "${dir}"
  return ${rc}
}

mpi_test_worlds() {
  local timeout_s="$1" bin="$2" np
  shift 2
  for np in "$@"; do
    echo "=== mpirun -np ${np} ${bin}"
    mpi_run "${timeout_s}" -np "${np}" "${bin}" || return $?
  done
}
