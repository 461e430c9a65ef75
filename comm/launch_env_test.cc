#include "comm/launch_env.h"

#include <catch2/catch.hpp>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace zerort {
namespace comm {
namespace {

using Env = std::map<std::string, std::string>;

absl::StatusOr<LaunchInfo> FromEnv(const Env& env) {
  return LaunchInfoFromEnv([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// What a launcher's environment must give; -1 / "" where the case does not check.
struct Expected {
  const char* source;
  int rank, world_size, local_rank, local_world_size, device;
  const char* master_addr;
  int master_port;
};

struct Case {
  const char* name;
  Env env;
  Expected want;
};

// Environments as each launcher writes them (the Slurm ones copied from a real `srun -n 2` of
// Slurm 22.05 and trimmed).
const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      {"torchrun",
       {{"RANK", "3"},
        {"WORLD_SIZE", "8"},
        {"LOCAL_RANK", "1"},
        {"LOCAL_WORLD_SIZE", "4"},
        {"MASTER_ADDR", "10.0.0.1"},
        {"MASTER_PORT", "29500"}},
       {"torchrun", 3, 8, 1, 4, 1, "10.0.0.1", 29500}},
      {"torchrun inside srun: torchrun's values win, Slurm's are its agent's",
       {{"RANK", "5"},
        {"WORLD_SIZE", "8"},
        {"LOCAL_RANK", "1"},
        {"LOCAL_WORLD_SIZE", "4"},
        {"MASTER_ADDR", "n1"},
        {"MASTER_PORT", "29500"},
        {"SLURM_JOB_ID", "77"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_LOCALID", "0"},
        {"SLURM_JOB_NODELIST", "n[1-2]"}},
       {"torchrun", 5, 8, 1, 4, 1, "n1", 29500}},
      {"torchrun in an sbatch script is not refused",
       {{"RANK", "1"},
        {"WORLD_SIZE", "2"},
        {"SLURM_JOB_ID", "9"},
        {"SLURM_NTASKS", "4"},
        {"SLURM_PROCID", "0"}},
       {"torchrun", 1, 2, 0, 0, 0, "", 0}},
      {"OpenMPI mpirun (also sets PMIX_RANK)",
       {{"OMPI_COMM_WORLD_RANK", "1"},
        {"OMPI_COMM_WORLD_SIZE", "4"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
        {"PMIX_RANK", "1"}},
       {"openmpi", 1, 4, 1, 2, 1, "", 0}},
      {"MVAPICH",
       {{"MV2_COMM_WORLD_RANK", "6"},
        {"MV2_COMM_WORLD_SIZE", "8"},
        {"MV2_COMM_WORLD_LOCAL_RANK", "2"},
        {"MV2_COMM_WORLD_LOCAL_SIZE", "4"}},
       {"mvapich", 6, 8, 2, 4, 2, "", 0}},
      {"MPICH / Intel MPI hydra",
       {{"PMI_RANK", "2"},
        {"PMI_SIZE", "3"},
        {"MPI_LOCALRANKID", "0"},
        {"MPI_LOCALNRANKS", "1"},
        {"MASTER_ADDR", "h0"},
        {"MASTER_PORT", "1234"}},
       {"mpich", 2, 3, 0, 1, 0, "h0", 1234}},
      {"srun --mpi=pmix: PMIX_RANK, the rest from Slurm",
       {{"PMIX_RANK", "1"},
        {"SLURM_JOB_ID", "1234567"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_LOCALID", "1"},
        {"SLURM_NODEID", "0"},
        {"SLURM_STEP_TASKS_PER_NODE", "2"},
        {"SLURM_STEP_NODELIST", "gpu-a[01-04,07],gpu-b9"}},
       {"pmix", 1, 2, 1, 2, 1, "gpu-a01", 24567}},
      {"mpirun inside an sbatch script: mpirun's values, no refusal, no Slurm address",
       {{"OMPI_COMM_WORLD_RANK", "3"},
        {"OMPI_COMM_WORLD_SIZE", "4"},
        {"SLURM_JOB_ID", "5"},
        {"SLURM_NTASKS", "4"},
        {"SLURM_PROCID", "0"},
        {"SLURM_JOB_NODELIST", "x[1-2]"}},
       {"openmpi", 3, 4, 0, 0, 0, "", 0}},
      {"srun -n 2, as Slurm 22.05 sets it",
       {{"SLURM_JOB_ID", "41"},
        {"SLURM_JOBID", "41"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_STEPID", "0"},
        {"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_STEP_NUM_TASKS", "2"},
        {"SLURM_LOCALID", "1"},
        {"SLURM_NODEID", "0"},
        {"SLURM_STEP_TASKS_PER_NODE", "2"},
        {"SLURM_TASKS_PER_NODE", "2"},
        {"SLURM_JOB_NODELIST", "vm"},
        {"SLURM_STEP_NODELIST", "vm"}},
       {"slurm", 1, 2, 1, 2, 1, "vm", 20041}},
      {"srun: the step's task count and nodes, not the job's; second node of 2(x2),1",
       {{"SLURM_JOB_ID", "10000"},
        {"SLURM_STEP_ID", "3"},
        {"SLURM_PROCID", "3"},
        {"SLURM_NTASKS", "8"},
        {"SLURM_STEP_NUM_TASKS", "5"},
        {"SLURM_LOCALID", "1"},
        {"SLURM_NODEID", "1"},
        {"SLURM_STEP_TASKS_PER_NODE", "2(x2),1"},
        {"SLURM_JOB_NODELIST", "a[1-9]"},
        {"SLURM_STEP_NODELIST", "a[3-5]"}},
       {"slurm", 3, 5, 1, 2, 1, "a3", 20000}},
      {"srun with ZERORT_RENDEZVOUS_PORT: it replaces the derived port",
       {{"SLURM_JOB_ID", "41"},
        {"SLURM_STEP_ID", "1"},
        {"SLURM_PROCID", "0"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_JOB_NODELIST", "vm"},
        {"ZERORT_RENDEZVOUS_PORT", "31000"}},
       {"slurm", 0, 2, 0, 0, 0, "vm", 31000}},
      {"srun with MASTER_ADDR / MASTER_PORT set: they win",
       {{"SLURM_JOB_ID", "41"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "0"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_JOB_NODELIST", "vm"},
        {"MASTER_ADDR", "other"},
        {"MASTER_PORT", "4000"}},
       {"slurm", 0, 2, 0, 0, 0, "other", 4000}},
      {"--gpus-per-task: one visible device is ordinal 0",
       {{"SLURM_JOB_ID", "41"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "3"},
        {"SLURM_NTASKS", "4"},
        {"SLURM_LOCALID", "3"},
        {"SLURM_JOB_NODELIST", "vm"},
        {"CUDA_VISIBLE_DEVICES", "3"}},
       {"slurm", 3, 4, 3, 0, 0, "vm", 20041}},
      {"srun --ntasks-per-node without a step list: SLURM_NTASKS_PER_NODE on every node",
       {{"SLURM_JOB_ID", "41"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "5"},
        {"SLURM_NTASKS", "6"},
        {"SLURM_LOCALID", "2"},
        {"SLURM_NODEID", "1"},
        {"SLURM_NTASKS_PER_NODE", "3"},
        {"SLURM_NODELIST", "b[7-8]"}},
       {"slurm", 5, 6, 2, 3, 2, "b7", 20041}},
      {"several visible devices: the local rank",
       {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"CUDA_VISIBLE_DEVICES", "2,3"}},
       {"torchrun", 1, 2, 1, 0, 1, "", 0}},
      {"an sbatch script of a one-task job is a single process",
       {{"SLURM_JOB_ID", "8"}, {"SLURM_NTASKS", "1"}, {"SLURM_PROCID", "0"}},
       {"slurm", 0, 1, 0, 0, 0, "", 0}},
  };
  return cases;
}

TEST_CASE("LaunchInfoFromEnv: launcher environments are recognised in order", "[comm]") {
  auto t = FromEnv({{"RANK", "3"},
                    {"WORLD_SIZE", "8"},
                    {"LOCAL_RANK", "1"},
                    {"MASTER_ADDR", "10.0.0.1"},
                    {"MASTER_PORT", "29500"},
                    {"OMPI_COMM_WORLD_RANK", "0"},
                    {"OMPI_COMM_WORLD_SIZE", "2"}});
  REQUIRE(t.ok());
  CHECK(t->source == "torchrun");
  CHECK(t->rank == 3);
  CHECK(t->world_size == 8);
  CHECK(t->local_rank == 1);
  CHECK(t->master_addr == "10.0.0.1");
  CHECK(t->master_port == 29500);

  auto o = FromEnv({{"OMPI_COMM_WORLD_RANK", "1"},
                    {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  REQUIRE(o.ok());
  CHECK(o->source == "openmpi");
  CHECK(o->rank == 1);
  CHECK(o->world_size == 4);
  CHECK(o->master_port == 0);

  auto s = FromEnv({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "2"}});
  REQUIRE(s.ok());
  CHECK(s->source == "slurm");
  CHECK(s->rank == 5);
  CHECK(s->local_rank == 2);

  CHECK(FromEnv({}).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("LaunchInfoFromEnv: malformed launcher variables name the variable", "[comm]") {
  auto bad = FromEnv({{"RANK", "x1"}, {"WORLD_SIZE", "2"}});
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(bad.status().message(), "RANK"));
  auto range = FromEnv({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  CHECK(range.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(range.status().message(), "WORLD_SIZE=2"));
  auto half = FromEnv({{"SLURM_PROCID", "0"}});
  CHECK(half.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(half.status().message(), "SLURM_NTASKS"));
  auto port = FromEnv({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}});
  CHECK(port.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(port.status().message(), "MASTER_PORT"));
}

TEST_CASE("LaunchInfoFromEnv: each launcher's environment", "[comm]") {
  for (const Case& c : Cases()) {
    INFO(c.name);
    auto got = FromEnv(c.env);
    REQUIRE(got.ok());
    CHECK(got->source == c.want.source);
    CHECK(got->rank == c.want.rank);
    CHECK(got->world_size == c.want.world_size);
    CHECK(got->local_rank == c.want.local_rank);
    CHECK(got->local_world_size == c.want.local_world_size);
    CHECK(got->device == c.want.device);
    CHECK(got->master_addr == c.want.master_addr);
    CHECK(got->master_port == c.want.master_port);
    CHECK_FALSE(got->master_is_torch_store);
  }
}

struct BadCase {
  const char* name;
  Env env;
  absl::StatusCode code;
  std::vector<const char*> message_has;
};

TEST_CASE("LaunchInfoFromEnv: conflicts, batch scripts and malformed values are errors", "[comm]") {
  const std::vector<BadCase> cases = {
      {"two MPI launchers disagree on the rank",
       {{"OMPI_COMM_WORLD_RANK", "0"},
        {"OMPI_COMM_WORLD_SIZE", "2"},
        {"PMI_RANK", "1"},
        {"PMI_SIZE", "2"}},
       absl::StatusCode::kInvalidArgument,
       {"OMPI_COMM_WORLD_RANK=0", "PMI_RANK=1", "disagree"}},
      {"on the size",
       {{"MV2_COMM_WORLD_RANK", "0"},
        {"MV2_COMM_WORLD_SIZE", "2"},
        {"PMI_RANK", "0"},
        {"PMI_SIZE", "3"}},
       absl::StatusCode::kInvalidArgument,
       {"MV2_COMM_WORLD_SIZE=2", "PMI_SIZE=3"}},
      {"on the local rank",
       {{"OMPI_COMM_WORLD_RANK", "0"},
        {"OMPI_COMM_WORLD_SIZE", "2"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
        {"PMI_RANK", "0"},
        {"PMI_SIZE", "2"},
        {"MPI_LOCALRANKID", "1"}},
       absl::StatusCode::kInvalidArgument,
       {"OMPI_COMM_WORLD_LOCAL_RANK=0", "MPI_LOCALRANKID=1"}},
      {"PMIX_RANK against OpenMPI's rank",
       {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"PMIX_RANK", "0"}},
       absl::StatusCode::kInvalidArgument,
       {"OMPI_COMM_WORLD_RANK=1", "PMIX_RANK=0"}},
      {"srun --mpi=pmix whose local rank differs from Slurm's",
       {{"PMIX_RANK", "1"},
        {"PMI_RANK", "1"},
        {"PMI_SIZE", "2"},
        {"MPI_LOCALRANKID", "0"},
        {"SLURM_JOB_ID", "3"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_LOCALID", "1"}},
       absl::StatusCode::kInvalidArgument,
       {"MPI_LOCALRANKID=0", "SLURM_LOCALID=1"}},
      {"sbatch script without srun",
       {{"SLURM_JOB_ID", "123"},
        {"SLURM_NTASKS", "4"},
        {"SLURM_PROCID", "0"},
        {"SLURM_LOCALID", "0"},
        {"SLURM_JOB_NODELIST", "n[1-2]"}},
       absl::StatusCode::kFailedPrecondition,
       {"srun", "SLURM_STEP_ID", "123"}},
      {"PMIX_RANK without any size",
       {{"PMIX_RANK", "0"}},
       absl::StatusCode::kInvalidArgument,
       {"PMIX_RANK=0", "no world size"}},
      {"PMIX_RANK whose Slurm step is another process's",
       {{"PMIX_RANK", "2"},
        {"SLURM_JOB_ID", "3"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "0"},
        {"SLURM_NTASKS", "4"}},
       absl::StatusCode::kInvalidArgument,
       {"PMIX_RANK=2", "no world size"}},
      {"half a launcher",
       {{"PMI_RANK", "0"}},
       absl::StatusCode::kInvalidArgument,
       {"PMI_RANK is set but PMI_SIZE is not"}},
      {"a malformed hostlist names the variable",
       {{"SLURM_JOB_ID", "3"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_PROCID", "0"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_JOB_NODELIST", "n[1-2"}},
       absl::StatusCode::kInvalidArgument,
       {"SLURM_JOB_NODELIST", "unclosed"}},
      {"local rank outside the local size",
       {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       absl::StatusCode::kInvalidArgument,
       {"LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"}},
      {"negative local rank",
       {{"MV2_COMM_WORLD_RANK", "0"},
        {"MV2_COMM_WORLD_SIZE", "1"},
        {"MV2_COMM_WORLD_LOCAL_RANK", "-1"}},
       absl::StatusCode::kInvalidArgument,
       {"MV2_COMM_WORLD_LOCAL_RANK=-1"}},
      {"rank outside the world",
       {{"PMI_RANK", "3"}, {"PMI_SIZE", "3"}},
       absl::StatusCode::kInvalidArgument,
       {"PMI_RANK=3", "PMI_SIZE=3"}},
  };
  for (const BadCase& c : cases) {
    INFO(c.name);
    auto got = FromEnv(c.env);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == c.code);
    for (const char* part : c.message_has) {
      INFO(got.status().message());
      CHECK(absl::StrContains(got.status().message(), part));
    }
  }
}

TEST_CASE("LaunchInfoFromEnv: torchrun's agent store", "[comm]") {
  Env env = {{"RANK", "0"},
             {"WORLD_SIZE", "2"},
             {"MASTER_ADDR", "127.0.0.1"},
             {"MASTER_PORT", "29500"},
             {"TORCHELASTIC_USE_AGENT_STORE", "True"},
             {"TORCHELASTIC_RUN_ID", "job7"},
             {"TORCHELASTIC_RESTART_COUNT", "2"}};
  auto got = FromEnv(env);
  REQUIRE(got.ok());
  CHECK(got->master_is_torch_store);
  CHECK(got->store_key == "zerort/rendezvous/job7/2");
  env["ZERORT_RENDEZVOUS_PORT"] = "29611";  // the way around the store
  got = FromEnv(env);
  REQUIRE(got.ok());
  CHECK_FALSE(got->master_is_torch_store);
  CHECK(got->master_port == 29611);
  env["ZERORT_RENDEZVOUS_PORT"] = "0";
  CHECK(absl::StrContains(FromEnv(env).status().message(), "ZERORT_RENDEZVOUS_PORT=0"));
  env.erase("ZERORT_RENDEZVOUS_PORT");
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  got = FromEnv(env);
  REQUIRE(got.ok());
  CHECK_FALSE(got->master_is_torch_store);
  CHECK(got->master_port == 29500);
}

TEST_CASE("ExpandSlurmHostlist: Slurm's syntax", "[comm]") {
  using V = std::vector<std::string>;
  const std::vector<std::pair<const char*, V>> cases = {
      {"vm", {"vm"}},
      {"gpu-a[01-04,07],gpu-b9", {"gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-a07", "gpu-b9"}},
      {"n[8-10]", {"n8", "n9", "n10"}},
      {"n[08-10]", {"n08", "n09", "n10"}},
      {"n[098-101]", {"n098", "n099", "n100", "n101"}},
      {"r[1-2]n[1-2]", {"r1n1", "r1n2", "r2n1", "r2n2"}},
      {"r[1-2]-n[01,3]-ib", {"r1-n01-ib", "r1-n3-ib", "r2-n01-ib", "r2-n3-ib"}},
      {"a,b[2],c", {"a", "b2", "c"}},
      {"[1-2]", {"1", "2"}},
      {"x[5]y", {"x5y"}},
  };
  for (const auto& c : cases) {
    INFO(c.first);
    auto got = ExpandSlurmHostlist(c.first);
    REQUIRE(got.ok());
    CHECK(*got == c.second);
  }
}

// Random lists built from parts, against the names those parts spell out: a bracket group is a
// list of (low, high, width) ranges, rendered zero-padded to the width and expanded in loops.
TEST_CASE("ExpandSlurmHostlist: random lists against their parts", "[comm]") {
  std::mt19937 rng(20261122);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int round = 0; round < 300; ++round) {
    std::string list;
    std::vector<std::string> want;
    const int names = pick(1, 3);
    for (int n = 0; n < names; ++n) {
      std::vector<std::string> expanded = {""};
      std::string text;
      const int groups = pick(0, 2);
      for (int g = 0; g <= groups; ++g) {
        const std::string word = std::string(1, static_cast<char>('a' + pick(0, 25))) + "-";
        text += word;
        for (std::string& e : expanded) e += word;
        if (g == groups) break;
        std::vector<std::string> values;
        text += "[";
        const int ranges = pick(1, 3);
        for (int k = 0; k < ranges; ++k) {
          const int width = pick(1, 3), low = pick(0, 12), high = low + pick(0, 4);
          char buf[16];
          std::snprintf(buf, sizeof buf, "%0*d", width, low);
          text += (k ? "," : "") + std::string(buf);
          if (high != low || pick(0, 1)) {
            text += "-" + std::to_string(high);
          }
          for (int v = low; v <= std::max(low, high); ++v) {
            std::snprintf(buf, sizeof buf, "%0*d", width, v);
            values.push_back(buf);
            if (high == low) break;
          }
        }
        text += "]";
        std::vector<std::string> next;
        for (const std::string& e : expanded) {
          for (const std::string& v : values) next.push_back(e + v);
        }
        expanded = next;
      }
      list += (n ? "," : "") + text;
      want.insert(want.end(), expanded.begin(), expanded.end());
    }
    INFO(list);
    auto got = ExpandSlurmHostlist(list);
    REQUIRE(got.ok());
    CHECK(*got == want);
  }
}

TEST_CASE("ExpandSlurmHostlist: malformed lists name the problem and position", "[comm]") {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"", "empty list"},
      {"a,,b", "empty name at position 2"},
      {"a,", "empty name at position 2"},
      {"n[1-3", "unclosed '[' at position 1"},
      {"n1-3]", "']' without '[' at position 4"},
      {"n[1-[2]]", "nested '['"},
      {"n[]", "empty brackets"},
      {"n[a-3]", "'a-3' is not a number or range"},
      {"n[1-]", "'1-' is not a number or range"},
      {"n[1,,2]", "'' is not a number or range"},
      {"n[5-3]", "range '5-3' is descending"},
      {"n[1-2-3]", "is not a number or range"},
      {"n[0-99999]", "more than 1000 names"},
      {"a[1-40]b[1-40]", "more than 1000 names"},
  };
  for (const auto& c : cases) {
    INFO(c.first);
    auto got = ExpandSlurmHostlist(c.first, 1000);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == absl::StatusCode::kInvalidArgument);
    INFO(got.status().message());
    CHECK(absl::StrContains(got.status().message(), c.second));
  }
}

TEST_CASE("ExpandSlurmTasksPerNode and SlurmPort", "[comm]") {
  auto t = ExpandSlurmTasksPerNode("2(x3),1");
  REQUIRE(t.ok());
  CHECK(*t == std::vector<int>{2, 2, 2, 1});
  auto one = ExpandSlurmTasksPerNode("4");
  REQUIRE(one.ok());
  CHECK(*one == std::vector<int>{4});
  for (const char* bad : {"", "x", "2(x", "2(x0)", "2(3)", "-1", "2(x2),", "+2"}) {
    INFO(bad);
    CHECK(ExpandSlurmTasksPerNode(bad).status().code() == absl::StatusCode::kInvalidArgument);
  }
  CHECK(SlurmPort(0) == 20000);
  CHECK(SlurmPort(41) == 20041);
  CHECK(SlurmPort(1234567) == 24567);
  CHECK(SlurmPort(4294967295u) == 27295);
  for (uint64_t id = 0; id < 30000; id += 7) {
    CHECK((SlurmPort(id) >= 20000 && SlurmPort(id) <= 29999));
  }
}

TEST_CASE("ExpandSlurmTasksPerNode: totals are bounded before anything is allocated", "[comm]") {
  // 10^4 parts, each in bounds (1 task on 2^20 nodes), 1.05e10 nodes in all: refused, not
  // expanded (that needed 42 GB and ended in bad_alloc).
  std::string huge;
  for (int k = 0; k < 10000; ++k) absl::StrAppend(&huge, k ? "," : "", "1(x1048576)");
  auto t = ExpandSlurmTasksPerNode(huge);
  CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(t.status().message(), "nodes"));
  // Exactly at the node bound is accepted, and its sum is the closed form.
  auto edge = ExpandSlurmTasksPerNode("3(x524288),5(x524288)");
  REQUIRE(edge.ok());
  REQUIRE(edge->size() == static_cast<size_t>(kMaxSlurmNodes));
  int64_t sum = 0;
  for (int n : *edge) sum += n;
  CHECK(sum == int64_t{8} * 524288);
  CHECK(!ExpandSlurmTasksPerNode("3(x524288),5(x524289)").ok());
  // Few nodes but more than INT_MAX tasks.
  CHECK(ExpandSlurmTasksPerNode("2000000000,2000000000").status().code() ==
        absl::StatusCode::kInvalidArgument);

  // Through the environment: the error names the variable, as the C ABI reports it.
  auto got = FromEnv({{"SLURM_JOB_ID", "7"},
                     {"SLURM_STEP_ID", "0"},
                     {"SLURM_PROCID", "0"},
                     {"SLURM_NTASKS", "2"},
                     {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", "0"},
                     {"SLURM_STEP_TASKS_PER_NODE", huge},
                     {"SLURM_STEP_NODELIST", "vm"}});
  CHECK(got.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(got.status().message(), "SLURM_STEP_TASKS_PER_NODE"));
}

}  // namespace
}  // namespace comm
}  // namespace zerort
