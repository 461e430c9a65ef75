#include "comm/launch_env.h"

#include <cstdlib>
#include <limits>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"

namespace zerort {
namespace comm {
namespace {

using Getenv = std::function<const char*(const char*)>;

// Reads an integer variable; `present` tells whether it was set (and not empty).
absl::StatusOr<int> IntVar(const Getenv& getenv, const char* name, bool* present) {
  const char* v = getenv(name);
  *present = v != nullptr && *v != '\0';
  if (!*present) return 0;
  int out = 0;
  if (!absl::SimpleAtoi(v, &out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", v, "' is not an integer"));
  }
  return out;
}

std::string StrVar(const Getenv& getenv, const char* name) {
  const char* v = getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

// One launcher's variables; nullptr where it has none.
struct Scheme {
  const char* source;
  const char* rank;
  const char* size;
  const char* local;
  const char* local_size;
};

constexpr Scheme kTorchrun = {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
// The MPI launchers, in the order their values are reported (all must agree).
constexpr Scheme kMpi[] = {
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"},
    {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"pmix", "PMIX_RANK", nullptr, nullptr, nullptr},
};

// What one launcher's variables say; -1 (and a null name) for what it does not say.
struct Reading {
  const char* source = nullptr;
  int rank = -1, size = -1, local = -1, local_size = -1;
  const char *rank_var = nullptr, *size_var = nullptr, *local_var = nullptr,
             *local_size_var = nullptr;
};

// Reads an optional non-negative (or, with `min` 1, positive) variable into *out / *var.
absl::Status ReadField(const Getenv& getenv, const char* name, int min, int* out,
                       const char** var) {
  if (name == nullptr) return absl::OkStatus();
  bool has = false;
  ASSIGN_OR_RETURN(int v, IntVar(getenv, name, &has));
  if (!has) return absl::OkStatus();
  if (v < min) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=", v, " must be >= ", min));
  }
  *out = v;
  *var = name;
  return absl::OkStatus();
}

// nullopt when neither the rank nor the size variable of `s` is set.
absl::StatusOr<std::optional<Reading>> Read(const Getenv& getenv, const Scheme& s) {
  Reading r;
  r.source = s.source;
  RETURN_IF_ERROR(ReadField(getenv, s.rank, 0, &r.rank, &r.rank_var));
  RETURN_IF_ERROR(ReadField(getenv, s.size, 1, &r.size, &r.size_var));
  if (r.rank_var == nullptr && r.size_var == nullptr) return std::nullopt;
  if (r.rank_var == nullptr || (s.size != nullptr && r.size_var == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher environment incomplete: ", r.rank_var ? s.rank : s.size,
                     " is set but ", r.rank_var ? s.size : s.rank, " is not"));
  }
  if (r.size_var != nullptr && r.rank >= r.size) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.rank, "=", r.rank, " is outside [0, ", s.size, "=", r.size, ")"));
  }
  RETURN_IF_ERROR(ReadField(getenv, s.local, 0, &r.local, &r.local_var));
  RETURN_IF_ERROR(ReadField(getenv, s.local_size, 1, &r.local_size, &r.local_size_var));
  return std::optional<Reading>(r);
}

// Fills the fields `into` lacks from `from`; InvalidArgument naming both variables when a
// field both have differs.
absl::Status Merge(const Reading& from, Reading& into) {
  struct Field {
    int Reading::*value;
    const char* Reading::*var;
  };
  const Field fields[] = {{&Reading::rank, &Reading::rank_var},
                          {&Reading::size, &Reading::size_var},
                          {&Reading::local, &Reading::local_var},
                          {&Reading::local_size, &Reading::local_size_var}};
  for (const Field& f : fields) {
    if (from.*f.var == nullptr) continue;
    if (into.*f.var == nullptr) {
      into.*f.value = from.*f.value;
      into.*f.var = from.*f.var;
    } else if (into.*f.value != from.*f.value) {
      return absl::InvalidArgumentError(absl::StrCat(
          "launcher variables disagree: ", into.*f.var, "=", into.*f.value, " but ", from.*f.var,
          "=", from.*f.value, " (left over from another launcher? unset the stale ones)"));
    }
  }
  return absl::OkStatus();
}

// The MPI launchers' variables merged, or nullopt when none is set.
absl::StatusOr<std::optional<Reading>> ReadMpi(const Getenv& getenv) {
  std::optional<Reading> out;
  for (const Scheme& s : kMpi) {
    ASSIGN_OR_RETURN(std::optional<Reading> r, Read(getenv, s));
    if (!r) continue;
    if (!out) {
      out = r;
    } else {
      RETURN_IF_ERROR(Merge(*r, *out));
    }
  }
  return out;
}

// The first entry of the first Slurm node list that is set, or "" when none is.
absl::StatusOr<std::string> SlurmFirstHost(const Getenv& getenv) {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    const std::string list = StrVar(getenv, name);
    if (list.empty()) continue;
    auto hosts = ExpandSlurmHostlist(list, /*max_hosts=*/1 << 20);
    if (!hosts.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", hosts.status().message()));
    }
    return hosts->front();
  }
  return std::string();
}

// What Slurm says about this task, or nullopt outside a Slurm job step.
// FailedPrecondition in a batch script or salloc shell of a job with several tasks.
absl::StatusOr<std::optional<Reading>> ReadSlurm(const Getenv& getenv) {
  bool unused = false;
  const bool has_job = !StrVar(getenv, "SLURM_JOB_ID").empty();
  const bool has_step =
      !StrVar(getenv, "SLURM_STEP_ID").empty() || !StrVar(getenv, "SLURM_STEPID").empty();
  if (has_job && !has_step) {
    bool has_ntasks = false;
    ASSIGN_OR_RETURN(int ntasks, IntVar(getenv, "SLURM_NTASKS", &has_ntasks));
    if (has_ntasks && ntasks > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "inside Slurm job ", StrVar(getenv, "SLURM_JOB_ID"), " of SLURM_NTASKS=", ntasks,
          " tasks but not in a job step (SLURM_STEP_ID is unset: this is the batch script or an "
          "salloc shell, where no other task will ever start); launch the program with srun"));
    }
    Reading single;  // the batch script itself: one process
    single.source = "slurm";
    single.rank = 0;
    single.size = 1;
    single.rank_var = single.size_var = "SLURM_JOB_ID";
    return std::optional<Reading>(single);
  }
  const char* size_var = getenv("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  const Scheme s = {"slurm", "SLURM_PROCID", size_var, "SLURM_LOCALID", nullptr};
  ASSIGN_OR_RETURN(std::optional<Reading> r, Read(getenv, s));
  if (!r) return r;
  ASSIGN_OR_RETURN(int node, IntVar(getenv, "SLURM_NODEID", &unused));
  // SLURM_NTASKS_PER_NODE (set only by --ntasks-per-node) is one count for every node.
  for (const char* name :
       {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const std::string list = StrVar(getenv, name);
    if (list.empty()) continue;
    auto per_node = ExpandSlurmTasksPerNode(list);
    if (!per_node.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", per_node.status().message()));
    }
    const bool every_node = std::string(name) == "SLURM_NTASKS_PER_NODE";
    if (every_node && per_node->size() == 1 && node >= 0) {
      r->local_size = per_node->front();
      r->local_size_var = name;
    } else if (node >= 0 && node < static_cast<int>(per_node->size())) {
      r->local_size = (*per_node)[node];
      r->local_size_var = name;
    }
    break;
  }
  return r;
}

// MASTER_ADDR / MASTER_PORT, else (when `slurm_started_us`) derived from Slurm.
absl::Status ReadMaster(const Getenv& getenv, bool slurm_started_us, LaunchInfo& info) {
  info.master_addr = StrVar(getenv, "MASTER_ADDR");
  bool has_port = false;
  ASSIGN_OR_RETURN(info.master_port, IntVar(getenv, "MASTER_PORT", &has_port));
  if (has_port && (info.master_port < 1 || info.master_port > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("MASTER_PORT=", info.master_port, " is outside [1, 65535]"));
  }
  if (!slurm_started_us) return absl::OkStatus();
  if (info.master_addr.empty()) {
    ASSIGN_OR_RETURN(info.master_addr, SlurmFirstHost(getenv));
  }
  const std::string job = StrVar(getenv, "SLURM_JOB_ID");
  uint64_t job_id = 0;
  if (!has_port && !job.empty()) {
    if (!absl::SimpleAtoi(job, &job_id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable SLURM_JOB_ID='", job, "' is not an integer"));
    }
    info.master_port = SlurmPort(job_id);
  }
  return absl::OkStatus();
}

// torchrun's agent store: MASTER_PORT is already taken by it.
void ReadTorchStore(const Getenv& getenv, LaunchInfo& info) {
  const std::string use = absl::AsciiStrToLower(StrVar(getenv, "TORCHELASTIC_USE_AGENT_STORE"));
  info.master_is_torch_store = use == "true" || use == "1";
  std::string run = StrVar(getenv, "TORCHELASTIC_RUN_ID");
  std::string restart = StrVar(getenv, "TORCHELASTIC_RESTART_COUNT");
  info.store_key = absl::StrCat("zerort/rendezvous/", run.empty() ? "none" : run, "/",
                                restart.empty() ? "0" : restart);
}

// ZERORT_RENDEZVOUS_PORT, when set, replaces the port (and the use of torchrun's store).
absl::StatusOr<LaunchInfo> OverridePort(const Getenv& getenv, LaunchInfo info) {
  bool has = false;
  ASSIGN_OR_RETURN(int port, IntVar(getenv, kRendezvousPortEnvVar, &has));
  if (!has) return info;
  if (port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(kRendezvousPortEnvVar, "=", port, " is outside [1, 65535]"));
  }
  info.master_port = port;
  info.master_is_torch_store = false;
  return info;
}

// 0 when CUDA_VISIBLE_DEVICES names exactly one device (the rank sees only its own), else the
// local rank.
int DeviceOrdinal(const Getenv& getenv, int local_rank) {
  const std::string visible = StrVar(getenv, "CUDA_VISIBLE_DEVICES");
  if (visible.empty()) return local_rank;
  const std::vector<absl::string_view> entries =
      absl::StrSplit(visible, ',', absl::SkipWhitespace());
  return entries.size() == 1 ? 0 : local_rank;
}

// The innermost launcher's reading (see the header's precedence), Slurm's (when present) in
// *slurm. NotFound when there is none.
absl::StatusOr<Reading> Choose(const Getenv& getenv, std::optional<Reading>* slurm) {
  ASSIGN_OR_RETURN(std::optional<Reading> inner, Read(getenv, kTorchrun));
  if (!inner) {
    ASSIGN_OR_RETURN(inner, ReadMpi(getenv));
  }
  if (inner) {
    // An inner launcher: Slurm describes the task that started it (torchrun's agent, mpirun's
    // daemon, or the batch script mpirun runs in), so its problems are not ours.
    auto s = ReadSlurm(getenv);
    if (s.ok()) *slurm = *s;
    return *inner;
  }
  ASSIGN_OR_RETURN(*slurm, ReadSlurm(getenv));
  if (*slurm) return **slurm;
  return absl::NotFoundError(
      "no launcher environment: none of RANK/WORLD_SIZE (torchrun), OMPI_COMM_WORLD_RANK/SIZE, "
      "MV2_COMM_WORLD_RANK/SIZE, PMI_RANK/PMI_SIZE, PMIX_RANK, SLURM_PROCID/SLURM_NTASKS is set");
}

}  // namespace

absl::StatusOr<LaunchInfo> LaunchInfoFromEnv() {
  return LaunchInfoFromEnv([](const char* name) -> const char* { return std::getenv(name); });
}

absl::StatusOr<LaunchInfo> LaunchInfoFromEnv(const Getenv& getenv) {
  std::optional<Reading> slurm;
  ASSIGN_OR_RETURN(Reading r, Choose(getenv, &slurm));
  // Slurm started this very process when it reports the same rank (and size, if known).
  const bool slurm_started_us = slurm && r.source != std::string("torchrun") &&
                                slurm->rank == r.rank &&
                                (r.size_var == nullptr || slurm->size == r.size);
  if (slurm_started_us && r.source != slurm->source) RETURN_IF_ERROR(Merge(*slurm, r));
  if (r.size_var == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        r.rank_var, "=", r.rank,
        " is set but no world size is (PMI_SIZE, OMPI_COMM_WORLD_SIZE, "
        "MV2_COMM_WORLD_SIZE, or SLURM_NTASKS from the srun that started this process)"));
  }
  if (r.rank >= r.size) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.rank_var, "=", r.rank, " is outside [0, ", r.size_var, "=", r.size, ")"));
  }
  LaunchInfo info;
  info.source = r.source;
  info.rank = r.rank;
  info.world_size = r.size;
  info.local_rank = r.local_var ? r.local : 0;
  info.local_world_size = r.local_size_var ? r.local_size : 0;
  if (info.local_world_size > 0 && info.local_rank >= info.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat(r.local_var, "=", info.local_rank,
                                                   " is outside [0, ", r.local_size_var, "=",
                                                   info.local_world_size, ")"));
  }
  info.device = DeviceOrdinal(getenv, info.local_rank);
  RETURN_IF_ERROR(ReadMaster(getenv, slurm_started_us && info.world_size > 1, info));
  if (r.source == std::string("torchrun")) ReadTorchStore(getenv, info);
  return OverridePort(getenv, std::move(info));
}

namespace {

absl::Status HostlistError(absl::string_view list, size_t pos, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("Slurm hostlist '", list, "': ", what, " at position ", pos));
}

// One bracket group's numbers as strings, zero-padded to the width of each range's lower bound.
// `body` is the text between the brackets, starting at `pos` in `list`.
absl::StatusOr<std::vector<std::string>> ExpandGroup(absl::string_view list, size_t pos,
                                                     absl::string_view body, size_t max_hosts) {
  std::vector<std::string> out;
  if (body.empty()) return HostlistError(list, pos, "empty brackets");
  for (absl::string_view part : absl::StrSplit(body, ',')) {
    const size_t dash = part.find('-');
    const absl::string_view lo = part.substr(0, dash);
    const absl::string_view hi = dash == absl::string_view::npos ? lo : part.substr(dash + 1);
    uint64_t a = 0, b = 0;
    const bool digits = !lo.empty() && !hi.empty() && lo.size() <= 9 && hi.size() <= 9 &&
                        lo.find_first_not_of("0123456789") == absl::string_view::npos &&
                        hi.find_first_not_of("0123456789") == absl::string_view::npos;
    if (!digits || !absl::SimpleAtoi(lo, &a) || !absl::SimpleAtoi(hi, &b)) {
      return HostlistError(list, pos, absl::StrCat("'", part, "' is not a number or range"));
    }
    if (b < a) return HostlistError(list, pos, absl::StrCat("range '", part, "' is descending"));
    if (b - a >= max_hosts || out.size() + (b - a) >= max_hosts) {
      return HostlistError(list, pos, absl::StrCat("more than ", max_hosts, " names"));
    }
    for (uint64_t v = a; v <= b; ++v) {
      std::string s = absl::StrCat(v);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');
      out.push_back(std::move(s));
    }
    pos += part.size() + 1;
  }
  return out;
}

// Expands one name of the list (no top-level commas), starting at `pos` in `list`, onto `out`.
absl::Status ExpandName(absl::string_view list, size_t pos, absl::string_view name,
                        size_t max_hosts, std::vector<std::string>& out) {
  if (name.empty()) return HostlistError(list, pos, "empty name");
  std::vector<std::string> prefixes = {""};
  size_t i = 0;
  while (i < name.size()) {
    const size_t open = name.find('[', i);
    const absl::string_view text =
        name.substr(i, open == absl::string_view::npos ? name.npos : open - i);
    if (text.find(']') != absl::string_view::npos) {
      return HostlistError(list, pos + i + text.find(']'), "']' without '['");
    }
    for (std::string& p : prefixes) absl::StrAppend(&p, text);
    if (open == absl::string_view::npos) break;
    const size_t close = name.find(']', open);
    if (close == absl::string_view::npos) return HostlistError(list, pos + open, "unclosed '['");
    const absl::string_view body = name.substr(open + 1, close - open - 1);
    if (body.find('[') != absl::string_view::npos) {
      return HostlistError(list, pos + open + 1 + body.find('['), "nested '['");
    }
    ASSIGN_OR_RETURN(std::vector<std::string> values,
                     ExpandGroup(list, pos + open + 1, body, max_hosts));
    if (prefixes.size() * values.size() + out.size() > max_hosts) {
      return HostlistError(list, pos + open, absl::StrCat("more than ", max_hosts, " names"));
    }
    std::vector<std::string> next;
    for (const std::string& p : prefixes) {
      for (const std::string& v : values) next.push_back(p + v);
    }
    prefixes = std::move(next);
    i = close + 1;
  }
  for (std::string& p : prefixes) out.push_back(std::move(p));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandSlurmHostlist(absl::string_view list,
                                                             size_t max_hosts) {
  std::vector<std::string> out;
  if (list.empty()) return HostlistError(list, 0, "empty list");
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    const char c = i < list.size() ? list[i] : ',';
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c != ',' || (depth > 0 && i < list.size())) continue;
    RETURN_IF_ERROR(ExpandName(list, start, list.substr(start, i - start), max_hosts, out));
    start = i + 1;
    depth = 0;
  }
  return out;
}

absl::StatusOr<std::vector<int>> ExpandSlurmTasksPerNode(absl::string_view list) {
  std::vector<int> out;
  int64_t nodes = 0, total = 0;  // each part is bounded, so these sums cannot overflow first
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    int tasks = 0, repeat = 1;
    const size_t paren = part.find("(x");
    const absl::string_view count = part.substr(0, paren);
    bool ok = absl::SimpleAtoi(count, &tasks) && tasks >= 0;
    if (ok && paren != absl::string_view::npos) {
      ok = part.back() == ')' &&
           absl::SimpleAtoi(part.substr(paren + 2, part.size() - paren - 3), &repeat) &&
           repeat >= 1 && repeat <= (1 << 20);
    }
    if (!ok || count.find_first_not_of("0123456789") != absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("Slurm tasks-per-node list '", list, "': '", part, "' is not N or N(xM)"));
    }
    // Bounded before anything is allocated: parts each in bounds can still add up to more
    // nodes than memory holds (10^4 parts of 1(x2^20) once ended in bad_alloc).
    nodes += repeat;
    total += static_cast<int64_t>(tasks) * repeat;
    if (nodes > kMaxSlurmNodes || total > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Slurm tasks-per-node list of ", list.size(), " bytes adds up to more than ",
          kMaxSlurmNodes, " nodes or ", std::numeric_limits<int>::max(), " tasks (at '",
          part, "')"));
    }
    out.insert(out.end(), repeat, tasks);
  }
  return out;
}

int SlurmPort(uint64_t job_id) { return 20000 + static_cast<int>(job_id % 10000); }

}  // namespace comm
}  // namespace zerort
