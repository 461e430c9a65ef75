// Where this process sits in a job, read from the variables its launcher exports: torchrun,
// OpenMPI's mpirun, MPICH / Intel MPI (hydra's PMI), MVAPICH, PMIx, and Slurm's srun. The
// rendezvous (comm/rendezvous.h) and the NCCL bootstrap (comm/nccl.h) start from it.
//
//   ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());
//
// Precedence, innermost launcher first (a launcher started by another one describes this
// process; the outer one describes its own task, e.g. torchrun's agent under srun, or
// mpirun's daemon inside an sbatch allocation, so the outer one's values are not compared):
//   1. torchrun: RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE.
//   2. MPI launchers, which all describe the same MPI process: OMPI_COMM_WORLD_RANK / _SIZE /
//      _LOCAL_RANK / _LOCAL_SIZE (OpenMPI), MV2_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK /
//      _LOCAL_SIZE (MVAPICH), PMI_RANK / PMI_SIZE / MPI_LOCALRANKID / MPI_LOCALNRANKS (MPICH's
//      and Intel MPI's hydra, srun --mpi=pmi2), PMIX_RANK (PMIx: OpenMPI, srun --mpi=pmix).
//      Every set of these that is present must agree: two that differ are an InvalidArgument
//      naming both variables (an environment mixed from two launchers).
//   3. Slurm (srun): SLURM_PROCID / SLURM_STEP_NUM_TASKS (else SLURM_NTASKS) / SLURM_LOCALID;
//      the local size from SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID (else
//      SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE at SLURM_NODEID).
// When Slurm itself started this process (its rank and size equal the chosen ones) it also
// fills what an MPI launcher left out (PMIX_RANK alone has no size or local rank) and
// MASTER_ADDR / MASTER_PORT when they are unset: the first host of SLURM_STEP_NODELIST
// (else SLURM_JOB_NODELIST, SLURM_NODELIST) and port SlurmPort(SLURM_JOB_ID).
//
// Thread safety: every function is thread-safe (the environment is only read).
#ifndef ZERORT_COMM_LAUNCH_ENV_H_
#define ZERORT_COMM_LAUNCH_ENV_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zerort {
namespace comm {

// When set, the rendezvous port on MASTER_ADDR, in place of MASTER_PORT, of the port derived
// from Slurm's job id, and of torchrun's store (rank 0 then binds it): for two job steps at once,
// or a torch whose store protocol differs from the one spoken here.
inline constexpr char kRendezvousPortEnvVar[] = "ZERORT_RENDEZVOUS_PORT";

// Where this process sits in the job, as its launcher describes it.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // index among the ranks of this node
  int local_world_size = 0;  // ranks on this node; 0 when the launcher does not say
  // The CUDA device ordinal for this rank: 0 when CUDA_VISIBLE_DEVICES lists exactly one device
  // (Slurm's --gpus-per-task, or a per-rank wrapper, gives each rank its own), else local_rank.
  int device = 0;
  std::string master_addr;  // MASTER_ADDR (or derived from Slurm); empty when unknown
  int master_port = 0;      // MASTER_PORT (or derived from Slurm); 0 when unknown
  // "torchrun", "openmpi", "mvapich", "mpich", "pmix" or "slurm".
  std::string source;
  // torchrun with TORCHELASTIC_USE_AGENT_STORE=True: master_addr:master_port is torchrun's own
  // TCPStore, already listening. Rendezvous() then publishes rank 0's address through that
  // store under `store_key` instead of binding MASTER_PORT.
  bool master_is_torch_store = false;
  // "zerort/rendezvous/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>": a restarted job
  // does not read the address its previous attempt published.
  std::string store_key;
};

// Reads the environment as described above. NotFound when no launcher variables are set;
// InvalidArgument naming the variable when one is malformed or out of range, or naming both
// when two launchers' variables disagree; FailedPrecondition inside a Slurm batch script or
// salloc shell (SLURM_JOB_ID set, no SLURM_STEP_ID) of a job with more than one task, where
// the program was meant to be started by srun.
absl::StatusOr<LaunchInfo> LaunchInfoFromEnv();
// Same, reading variables through `getenv` (returns nullptr when unset); for tests.
absl::StatusOr<LaunchInfo> LaunchInfoFromEnv(const std::function<const char*(const char*)>& getenv);

// Expands a Slurm hostlist: comma-separated names, each with any number of bracket groups of
// comma-separated numbers and ranges ("gpu-a[01-04,07],gpu-b9" -> gpu-a01 ... gpu-a04,
// gpu-a07, gpu-b9). A range keeps the width of its lower bound ("[08-10]" -> 08, 09, 10).
// Several groups expand as nested loops, the first outermost ("r[1-2]n[1-2]" -> r1n1, r1n2,
// r2n1, r2n2). InvalidArgument naming the list and the position for unbalanced or nested
// brackets, empty names or groups, non-digits in a group, a range whose upper bound is below its
// lower, or an expansion above `max_hosts` names.
absl::StatusOr<std::vector<std::string>> ExpandSlurmHostlist(absl::string_view list,
                                                             size_t max_hosts = 1 << 16);

// Expands Slurm's tasks-per-node syntax ("2(x3),1" -> 2, 2, 2, 1). InvalidArgument when
// malformed, or (checked before allocating) when it lists more than kMaxSlurmNodes nodes or
// more than INT_MAX tasks in all.
inline constexpr int64_t kMaxSlurmNodes = int64_t{1} << 20;
absl::StatusOr<std::vector<int>> ExpandSlurmTasksPerNode(absl::string_view list);

// The rendezvous port for Slurm job `job_id` when MASTER_PORT is unset:
// 20000 + job_id % 10000, within [20000, 29999]: unprivileged, and below Linux's default
// ephemeral range (32768-60999), so no outgoing connection holds it. Two jobs on one node
// collide only when their ids are equal modulo 10000; two steps of one job running at the same
// time need MASTER_PORT or ZERORT_RENDEZVOUS_PORT.
int SlurmPort(uint64_t job_id);

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_LAUNCH_ENV_H_
