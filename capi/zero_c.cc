// The C ABI: thin wrappers that turn C arguments into engine calls and absl::Status into
// zr_status plus a thread-local message. No C++ exception may cross extern "C", so every entry
// point that can allocate runs inside Guard().
#include "capi/zero_c.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "base/status.h"
#include "capi/internal/mpi_backend.h"
#include "checkpoint/checkpoint.h"
#include "comm/agree.h"
#include "comm/inprocess.h"
#include "comm/nccl.h"
#include "comm/rendezvous.h"
#include "device/cpu_device.h"
#include "device/cuda_device.h"
#include "zero/auto_fill.h"
#include "zero/config.h"
#include "zero/engine.h"
#include "zero/report.h"

// Communicators and devices are shared with the engines created on them, so that destroying
// one before its engines (a common teardown mistake) defers the real destruction to the last
// engine instead of leaving them a dangling pointer.
struct zr_comm {
  std::shared_ptr<zerort::comm::Communicator> comm;
};

struct zr_device {
  std::shared_ptr<zerort::Device> device;
};

struct zr_checkpointer {
  // Behind a pointer so that destroy can free it (a thread and a pinned buffer) and keep the
  // handle's tombstone.
  std::unique_ptr<zerort::AsyncCheckpointer> checkpointer =
      std::make_unique<zerort::AsyncCheckpointer>();
};

struct zr_engine {
  // Declared before `engine`, hence destroyed after it.
  std::shared_ptr<zerort::comm::Communicator> comm;
  std::shared_ptr<zerort::Device> device;
  std::unique_ptr<zerort::Engine> engine;
  // Rendered once at creation: the C ABI hands out pointers into them for the engine's lifetime.
  std::string plan_json;
  std::string config_notes;
};

namespace {

static_assert(static_cast<int>(ZR_UNAUTHENTICATED) ==
                  static_cast<int>(absl::StatusCode::kUnauthenticated),
              "zr_status must mirror absl::StatusCode");
static_assert(static_cast<int>(ZR_BF16) == static_cast<int>(zerort::DType::kBF16) &&
                  static_cast<int>(ZR_F16) == static_cast<int>(zerort::DType::kF16),
              "zr_dtype must mirror zerort::DType");
static_assert(ZR_NUM_MEMORY_KINDS + 1 == zerort::memory::kNumMemoryKinds &&
                  ZR_MEMORY_NVME == static_cast<int>(zerort::memory::MemoryKind::kNvme),
              "zr_memory_kind must mirror memory::MemoryKind");
static_assert(ZR_GRAD_BUFFER_PACKED == zerort::memory::kGradBufferPacked,
              "ZR_GRAD_BUFFER_PACKED must mirror memory::kGradBufferPacked");

std::string& LastError() {
  thread_local std::string message;
  return message;
}

// Messages quote caller input (JSON keys, names) that may hold a NUL or other control bytes: a
// NUL would cut the C string short, so each becomes \xNN. Newlines separate notes and stay.
std::string EscapeControl(absl::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (const char c : message) {
    const unsigned char u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n') || u == 0x7f) {
      absl::StrAppend(&out, "\\x", absl::Hex(u, absl::kZeroPad2));
    } else {
      out.push_back(c);
    }
  }
  return out;
}

zr_status Set(const absl::Status& status) {
  if (status.ok()) {
    LastError().clear();
    return ZR_OK;
  }
  LastError() = EscapeControl(status.message());
  return static_cast<zr_status>(status.code());
}

// Runs `fn` (returning absl::Status), converting anything it throws into a status.
template <typename Fn>
zr_status Guard(Fn&& fn) {
  try {
    return Set(fn());
  } catch (const std::bad_alloc&) {
    return Set(absl::ResourceExhaustedError("out of host memory in the zerort C API"));
  } catch (const std::exception& e) {
    return Set(absl::InternalError(absl::StrCat("zerort C API: ", e.what())));
  } catch (...) {
    return Set(absl::InternalError("zerort C API: unknown exception"));
  }
}

absl::Status NotNull(const void* p, const char* function, const char* argument) {
  if (p != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(function, ": ", argument, " is NULL"));
}

// Every live handle and its kind, checked at every entry point: a use after destroy, a double
// destroy or a pointer that never was a handle becomes ZR_INVALID_ARGUMENT instead of a crash.
// Destroy keeps a handle's few dozen bytes of memory (a tombstone) so that its address is
// never reused by a later handle, and a stale pointer can never pass for a live one.
enum class HandleKind { kComm, kDevice, kEngine, kCheckpointer };

class HandleRegistry {
 public:
  void Add(const void* handle, HandleKind kind) {
    absl::MutexLock lock(&mu_);
    live_[handle] = kind;
  }
  bool Contains(const void* handle, HandleKind kind) {
    absl::MutexLock lock(&mu_);
    const auto it = live_.find(handle);
    return it != live_.end() && it->second == kind;
  }
  // False when `handle` is not a live handle of `kind` (then nothing changes).
  bool Remove(const void* handle, HandleKind kind) {
    absl::MutexLock lock(&mu_);
    const auto it = live_.find(handle);
    if (it == live_.end() || it->second != kind) return false;
    live_.erase(it);
    return true;
  }

 private:
  absl::Mutex mu_;
  std::unordered_map<const void*, HandleKind> live_ ABSL_GUARDED_BY(mu_);
};

HandleRegistry& Handles() {
  static auto* registry = new HandleRegistry();  // never destroyed: usable from exit handlers
  return *registry;
}

HandleKind KindOf(const zr_comm*) { return HandleKind::kComm; }
HandleKind KindOf(const zr_device*) { return HandleKind::kDevice; }
HandleKind KindOf(const zr_engine*) { return HandleKind::kEngine; }
HandleKind KindOf(const zr_checkpointer*) { return HandleKind::kCheckpointer; }

const char* TypeName(HandleKind kind) {
  switch (kind) {
    case HandleKind::kComm: return "zr_comm";
    case HandleKind::kDevice: return "zr_device";
    case HandleKind::kEngine: return "zr_engine";
    case HandleKind::kCheckpointer: return "zr_checkpointer";
  }
  return "handle";
}

// The argument's usual name: "engine" for a zr_engine.
const char* ArgName(HandleKind kind) { return TypeName(kind) + 3; }

std::string NotLiveMessage(const void* handle, HandleKind kind, const char* function,
                           const char* argument) {
  return absl::StrCat(function, ": ", argument, " (0x",
                      absl::Hex(reinterpret_cast<uintptr_t>(handle)), ") is not a live ",
                      TypeName(kind), ": already destroyed, or never created by zerort");
}

// `handle` is a live handle of its type: InvalidArgument naming `function` and `argument`.
template <typename T>
absl::Status Live(const T* handle, const char* function, const char* argument) {
  RETURN_IF_ERROR(NotNull(handle, function, argument));
  if (Handles().Contains(handle, KindOf(handle))) return absl::OkStatus();
  return absl::InvalidArgumentError(NotLiveMessage(handle, KindOf(handle), function, argument));
}

// For the calls that cannot return a status: whether `handle` may be used; if not, the reason
// becomes zr_last_error().
template <typename T>
bool UsableOrSetError(const T* handle, const char* function) {
  const absl::Status live = Live(handle, function, ArgName(KindOf(handle)));
  if (live.ok()) return true;
  LastError() = EscapeControl(live.message());
  return false;
}

// Destroy: NULL is a no-op; a handle that is not live is reported through zr_last_error() and
// left alone (a double destroy must not free twice); a live one is unregistered and `release`
// frees what it owns, leaving the tombstone.
template <typename T, typename Release>
void Destroy(T* handle, const char* function, Release release) {
  if (handle == nullptr) return;
  Guard([&]() -> absl::Status {
    if (!Handles().Remove(handle, KindOf(handle))) {
      return absl::InvalidArgumentError(
          NotLiveMessage(handle, KindOf(handle), function, ArgName(KindOf(handle))));
    }
    release(*handle);
    return absl::OkStatus();
  });
}

// Registers and hands out a new handle.
template <typename T>
T* Register(std::unique_ptr<T> handle) {
  Handles().Add(handle.get(), KindOf(handle.get()));
  return handle.release();
}

// An entry point that only forwards to one Engine method: a NULL engine is InvalidArgument
// naming `function`, and exceptions become statuses (Guard).
template <typename Call>
zr_status ForwardToEngine(zr_engine* engine, const char* function, Call&& call) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, function, "engine"));
    return call(*engine->engine);
  });
}

#define ZR_STR2(x) #x
#define ZR_STR(x) ZR_STR2(x)
constexpr char kVersionString[] =
    ZR_STR(ZR_VERSION_MAJOR) "." ZR_STR(ZR_VERSION_MINOR) "." ZR_STR(ZR_VERSION_PATCH);

// The size of each versioned struct as first published (0.1.0): a caller built against that
// header passes exactly this. Every struct is still as first published; when a field is
// appended to one, specialise this to the old size so that older callers stay accepted.
template <typename T>
constexpr size_t FirstPublishedSize() {
  return sizeof(T);
}
// Appended to in 0.2: the sizes before, up to the first appended field.
#define ZR_FIRST_PUBLISHED_UP_TO(T, first_appended)  \
  template <>                                         \
  constexpr size_t FirstPublishedSize<T>() {          \
    return offsetof(T, first_appended);               \
  }
ZR_FIRST_PUBLISHED_UP_TO(zr_param_spec, has_group)
ZR_FIRST_PUBLISHED_UP_TO(zr_engine_options, no_decay_1d)
ZR_FIRST_PUBLISHED_UP_TO(zr_step_stats, lr)
ZR_FIRST_PUBLISHED_UP_TO(zr_plan_summary, planned_nvme_bytes)
ZR_FIRST_PUBLISHED_UP_TO(zr_memory_report, planned_nvme_bytes)
#undef ZR_FIRST_PUBLISHED_UP_TO

template <typename T>
absl::Status CheckStructSize(size_t size, const char* function, const char* type) {
  if (size >= FirstPublishedSize<T>() && size <= sizeof(T)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      function, ": ", type, ".struct_size is ", size, ", not between ", FirstPublishedSize<T>(),
      " and ", sizeof(T), ": set it to sizeof(", type,
      "); a larger value means a header newer than this library (", kVersionString, ")"));
}

// The caller's struct: its first struct_size bytes over the defaults (zero) of the rest.
template <typename T>
absl::StatusOr<T> ReadSized(const T* in, const char* function, const char* type) {
  RETURN_IF_ERROR(NotNull(in, function, type));
  RETURN_IF_ERROR(CheckStructSize<T>(in->struct_size, function, type));
  T out{};
  std::memcpy(&out, in, in->struct_size);
  out.struct_size = sizeof(T);
  return out;
}

// Writes `value` into the first out->struct_size bytes of the caller's struct.
template <typename T>
absl::Status WriteSized(const T& value, T* out, const char* function, const char* type) {
  RETURN_IF_ERROR(NotNull(out, function, type));
  const size_t size = out->struct_size;
  RETURN_IF_ERROR(CheckStructSize<T>(size, function, type));
  std::memcpy(out, &value, size);
  out->struct_size = size;
  return absl::OkStatus();
}

absl::StatusOr<zerort::comm::CommOptions> MakeCommOptions(int64_t timeout_ms,
                                                          const char* function) {
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(function, ": timeout_ms ", timeout_ms,
                                                   " must be >= 0 (0 = default)"));
  }
  zerort::comm::CommOptions options;
  if (timeout_ms > 0) options.timeout_ms = timeout_ms;
  return options;
}

absl::Status PublishComm(absl::StatusOr<std::unique_ptr<zerort::comm::Communicator>> created,
                         zr_comm** out) {
  RETURN_IF_ERROR(created.status());
  auto wrapper = std::make_unique<zr_comm>();
  wrapper->comm = std::move(*created);
  *out = Register(std::move(wrapper));
  return absl::OkStatus();
}

absl::Status PublishDevice(absl::StatusOr<std::unique_ptr<zerort::Device>> created,
                           zr_device** out) {
  RETURN_IF_ERROR(created.status());
  auto wrapper = std::make_unique<zr_device>();
  wrapper->device = std::move(*created);
  *out = Register(std::move(wrapper));
  return absl::OkStatus();
}

// The parameter array, read with the caller's element size as the stride.
// `groups` receives each parameter's own group (has_group), if any.
absl::StatusOr<std::vector<zerort::memory::ParamSpec>> ReadParams(
    const zr_param_spec* params, int num_params,
    std::vector<std::optional<zerort::ParamGroup>>* groups) {
  if (num_params < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zr_engine_create: needs at least one parameter (num_params ", num_params, ")"));
  }
  if (params == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("zr_engine_create: params is NULL (num_params ",
                                                   num_params, ")"));
  }
  const size_t stride = params[0].struct_size;
  RETURN_IF_ERROR(CheckStructSize<zr_param_spec>(stride, "zr_engine_create", "zr_param_spec"));
  std::vector<zerort::memory::ParamSpec> specs(num_params);
  groups->assign(num_params, std::nullopt);
  for (int i = 0; i < num_params; ++i) {
    const auto* in = reinterpret_cast<const zr_param_spec*>(
        reinterpret_cast<const char*>(params) + static_cast<size_t>(i) * stride);
    if (in->struct_size != stride) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zr_engine_create: parameter ", i, " has struct_size ", in->struct_size,
          ", parameter 0 has ", stride, ": every element must set sizeof(zr_param_spec)"));
    }
    ASSIGN_OR_RETURN(zr_param_spec p, ReadSized(in, "zr_engine_create", "zr_param_spec"));
    if (p.name == nullptr || p.module == nullptr || p.ndim < 1 || p.shape == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zr_engine_create: parameter ", i, " (", p.name == nullptr ? "<NULL name>" : p.name,
          ") needs a name, a module, ndim >= 1 and a shape"));
    }
    specs[i].name = p.name;
    specs[i].module = p.module;
    specs[i].shape.assign(p.shape, p.shape + p.ndim);
    if (p.has_group != 0) (*groups)[i] = zerort::ParamGroup{p.weight_decay, p.lr_scale};
    // The plan refuses a negative value, naming the parameter.
    specs[i].activation_bytes_per_sample = p.activation_bytes_per_sample;
    if (p.grad_buffer != nullptr) {
      specs[i].grad_buffer = p.grad_buffer;
      // The plan refuses an offset below ZR_GRAD_BUFFER_PACKED, naming the parameter.
      specs[i].grad_buffer_offset = p.grad_buffer_offset;
    }
  }
  return specs;
}

zr_step_stats StatsOut(const zerort::StepStats& s) {
  zr_step_stats out{};
  out.boundary = s.boundary ? 1 : 0;
  out.skipped = s.skipped ? 1 : 0;
  out.step = s.step;
  out.loss_scale = s.loss_scale;
  out.grad_norm = s.grad_norm;
  out.clip_coef = s.clip_coef;
  out.comm_bytes = s.comm_bytes;
  out.reduce_ms = s.reduce_ms;
  out.optimizer_ms = s.optimizer_ms;
  out.gather_ms = s.gather_ms;
  out.offload_wait_ms = s.offload_wait_ms;
  out.total_ms = s.total_ms;
  out.lr = s.lr;
  out.weight_decay = s.weight_decay;
  return out;
}

// The planned and allocated bytes per memory kind of zr_plan_summary and zr_memory_report:
// the first ZR_NUM_MEMORY_KINDS in the arrays, NVMe in the fields appended in 0.2.0.
template <typename Out>
void FillBytes(const zerort::MemoryReport& report, Out* out) {
  for (int k = 0; k < ZR_NUM_MEMORY_KINDS; ++k) {
    out->planned_bytes[k] = report.planned[k];
    out->allocated_bytes[k] = report.allocated[k];
  }
  out->planned_nvme_bytes = report.planned[ZR_MEMORY_NVME];
  out->allocated_nvme_bytes = report.allocated[ZR_MEMORY_NVME];
}

// Runs one of the step calls and reports its stats into `stats` (may be NULL).
template <typename Fn>
zr_status RunStep(zr_engine* engine, zr_step_stats* stats, const char* function, Fn step) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, function, "engine"));
    // Checked before the step: a bad struct must not leave a step applied but unreported.
    if (stats != nullptr) {
      RETURN_IF_ERROR(CheckStructSize<zr_step_stats>(stats->struct_size, function,
                                                     "zr_step_stats"));
    }
    ASSIGN_OR_RETURN(zerort::StepStats s, step());
    if (stats == nullptr) return absl::OkStatus();
    return WriteSized(StatsOut(s), stats, function, "zr_step_stats");
  });
}

// params[0..count-1] as a span, or InvalidArgument naming the call.
absl::StatusOr<absl::Span<const int>> IndexSpan(const int* params, int count, const char* call) {
  if (count < 0 || (count > 0 && params == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": params must hold count >= 0 indices (count ", count, ")"));
  }
  return absl::Span<const int>(params, static_cast<size_t>(count));
}

}  // namespace

extern "C" {

const char* zr_last_error(void) { return LastError().c_str(); }

const char* zr_status_name(zr_status status) {
  switch (status) {
    case ZR_OK: return "OK";
    case ZR_CANCELLED: return "CANCELLED";
    case ZR_UNKNOWN: return "UNKNOWN";
    case ZR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case ZR_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case ZR_NOT_FOUND: return "NOT_FOUND";
    case ZR_ALREADY_EXISTS: return "ALREADY_EXISTS";
    case ZR_PERMISSION_DENIED: return "PERMISSION_DENIED";
    case ZR_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case ZR_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case ZR_ABORTED: return "ABORTED";
    case ZR_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case ZR_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case ZR_INTERNAL: return "INTERNAL";
    case ZR_UNAVAILABLE: return "UNAVAILABLE";
    case ZR_DATA_LOSS: return "DATA_LOSS";
    case ZR_UNAUTHENTICATED: return "UNAUTHENTICATED";
  }
  return "UNKNOWN_STATUS";
}

int zr_version(void) { return ZR_VERSION; }

const char* zr_version_string(void) { return kVersionString; }

zr_status zr_comm_group_create(int world_size, int64_t timeout_ms, zr_comm** comms) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(comms, "zr_comm_group_create", "comms"));
    if (world_size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("zr_comm_group_create: world_size ", world_size, " must be >= 1"));
    }
    ASSIGN_OR_RETURN(zerort::comm::CommOptions options,
                     MakeCommOptions(timeout_ms, "zr_comm_group_create"));
    ASSIGN_OR_RETURN(auto group, zerort::comm::CreateInProcessGroup(world_size, options));
    // Build every wrapper before publishing any, so that a failure leaves comms untouched.
    std::vector<std::unique_ptr<zr_comm>> wrapped;
    for (auto& c : group) {
      wrapped.push_back(std::make_unique<zr_comm>());
      wrapped.back()->comm = std::move(c);
    }
    for (int r = 0; r < world_size; ++r) comms[r] = Register(std::move(wrapped[r]));
    return absl::OkStatus();
  });
}

void zr_comm_destroy(zr_comm* comm) {
  Destroy(comm, "zr_comm_destroy", [](zr_comm& c) { c.comm.reset(); });
}

int zr_comm_rank(const zr_comm* comm) {
  return UsableOrSetError(comm, "zr_comm_rank") ? comm->comm->rank() : -1;
}

int zr_comm_size(const zr_comm* comm) {
  return UsableOrSetError(comm, "zr_comm_size") ? comm->comm->size() : -1;
}

zr_status zr_comm_split(zr_comm* comm, int color, int key, zr_comm** out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(comm, "zr_comm_split", "comm"));
    RETURN_IF_ERROR(NotNull(out, "zr_comm_split", "out"));
    absl::StatusOr<std::unique_ptr<zerort::comm::Communicator>> split =
        comm->comm->Split(color, key);
    if (!split.ok()) {
      return absl::Status(split.status().code(),
                          absl::StrCat("zr_comm_split(color=", color, ", key=", key,
                                       "): ", split.status().message()));
    }
    if (*split == nullptr) {  // a negative color: in no sub-group
      *out = nullptr;
      return absl::OkStatus();
    }
    auto wrapper = std::make_unique<zr_comm>();
    wrapper->comm = *std::move(split);
    *out = Register(std::move(wrapper));
    return absl::OkStatus();
  });
}

zr_status zr_mpi_init(void) {
  return Guard([&]() -> absl::Status {
    ASSIGN_OR_RETURN(const zerort::capi::MpiBackend* mpi, zerort::capi::GetMpiBackend());
    return mpi->init();
  });
}

zr_status zr_mpi_finalize(void) {
  return Guard([&]() -> absl::Status {
    ASSIGN_OR_RETURN(const zerort::capi::MpiBackend* mpi, zerort::capi::GetMpiBackend());
    return mpi->finalize();
  });
}

zr_status zr_mpi_comm_create(const void* mpi_comm, int64_t timeout_ms, zr_comm** comm) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(comm, "zr_mpi_comm_create", "comm"));
    ASSIGN_OR_RETURN(zerort::comm::CommOptions options,
                     MakeCommOptions(timeout_ms, "zr_mpi_comm_create"));
    ASSIGN_OR_RETURN(const zerort::capi::MpiBackend* mpi, zerort::capi::GetMpiBackend());
    return PublishComm(mpi->create(mpi_comm, options), comm);
  });
}

zr_status zr_launch_info_from_env(zr_launch_info* info) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(info, "zr_launch_info_from_env", "info"));
    ASSIGN_OR_RETURN(zerort::comm::LaunchInfo launch, zerort::comm::LaunchInfoFromEnv());
    zr_launch_info out{};
    out.struct_size = sizeof(out);
    out.rank = launch.rank;
    out.world_size = launch.world_size;
    out.local_rank = launch.local_rank;
    out.master_port = launch.master_port;
    out.device = launch.device;
    // Static strings: the LaunchInfo dies here.
    out.source = "slurm";
    for (const char* name : {"torchrun", "openmpi", "mvapich", "mpich", "pmix"}) {
      if (launch.source == name) out.source = name;
    }
    return WriteSized(out, info, "zr_launch_info_from_env", "zr_launch_info");
  });
}

zr_status zr_nccl_comm_wrap(void* nccl_comm, int64_t timeout_ms, zr_comm** comm) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(nccl_comm, "zr_nccl_comm_wrap", "nccl_comm"));
    RETURN_IF_ERROR(NotNull(comm, "zr_nccl_comm_wrap", "comm"));
    ASSIGN_OR_RETURN(zerort::comm::CommOptions options,
                     MakeCommOptions(timeout_ms, "zr_nccl_comm_wrap"));
    return PublishComm(
        zerort::comm::CreateNcclCommunicator(static_cast<ncclComm_t>(nccl_comm), options), comm);
  });
}

zr_status zr_nccl_comm_create_from_env(int64_t timeout_ms, zr_comm** comm) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(comm, "zr_nccl_comm_create_from_env", "comm"));
    ASSIGN_OR_RETURN(zerort::comm::CommOptions options,
                     MakeCommOptions(timeout_ms, "zr_nccl_comm_create_from_env"));
    ASSIGN_OR_RETURN(zerort::comm::LaunchInfo launch, zerort::comm::LaunchInfoFromEnv());
    return PublishComm(zerort::comm::CreateNcclCommunicatorFromLaunch(launch, options), comm);
  });
}

zr_status zr_cpu_device_create(int threads, zr_device** device) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(device, "zr_cpu_device_create", "device"));
    if (threads < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("zr_cpu_device_create: threads ", threads, " must be >= 0 (0 = all cores)"));
    }
    zerort::CpuDeviceOptions device_options;
    device_options.threads = threads;
    return PublishDevice(zerort::CreateCpuDevice(device_options), device);
  });
}

zr_status zr_cuda_device_create(int ordinal, zr_device** device) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(device, "zr_cuda_device_create", "device"));
    return PublishDevice(zerort::CreateCudaDevice(ordinal), device);
  });
}

void zr_device_destroy(zr_device* device) {
  Destroy(device, "zr_device_destroy", [](zr_device& d) { d.device.reset(); });
}

zr_status zr_engine_create(const char* config_json, const zr_param_spec* params, int num_params,
                           zr_comm* comm, zr_device* device, const zr_engine_options* options,
                           zr_engine** engine) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(config_json, "zr_engine_create", "config_json"));
    RETURN_IF_ERROR(Live(comm, "zr_engine_create", "comm"));
    RETURN_IF_ERROR(Live(device, "zr_engine_create", "device"));
    RETURN_IF_ERROR(NotNull(engine, "zr_engine_create", "engine"));
    zerort::EngineOptions engine_options;
    zerort::AutoFill fill;
    if (options != nullptr) {
      ASSIGN_OR_RETURN(zr_engine_options o,
                       ReadSized(options, "zr_engine_create", "zr_engine_options"));
      engine_options.compute_stream = o.compute_stream;
      engine_options.no_decay_1d = o.no_decay_1d != 0;
      engine_options.device_timing = o.device_timing != 0;
      if (o.auto_fill_json != nullptr) {
        ASSIGN_OR_RETURN(fill, zerort::ParseAutoFill(o.auto_fill_json));
      }
    }
    ASSIGN_OR_RETURN(std::vector<zerort::memory::ParamSpec> specs,
                     ReadParams(params, num_params, &engine_options.param_groups));
    ASSIGN_OR_RETURN(zerort::Config config, zerort::ParseConfig(config_json, "config_json"));
    if (!fill.world_size) fill.world_size = comm->comm->size();
    RETURN_IF_ERROR(zerort::Annotate(zerort::ResolveAuto(fill, specs, &config), "config_json"));
    ASSIGN_OR_RETURN(std::unique_ptr<zerort::Engine> e,
                     zerort::Engine::Create(config, std::move(specs), comm->comm.get(),
                                            device->device.get(), engine_options));
    auto wrapper = std::make_unique<zr_engine>();
    wrapper->comm = comm->comm;
    wrapper->device = device->device;
    wrapper->plan_json = zerort::PlanJson(e->plan()).dump(2);
    for (const std::string& note : e->config().notes) {
      absl::StrAppend(&wrapper->config_notes, note, "\n");
    }
    wrapper->engine = std::move(e);
    *engine = Register(std::move(wrapper));
    return absl::OkStatus();
  });
}

void zr_engine_destroy(zr_engine* engine) {
  Destroy(engine, "zr_engine_destroy", [](zr_engine& e) {
    e.engine.reset();  // first: it uses the communicator and the device
    e.comm.reset();
    e.device.reset();
    std::string().swap(e.plan_json);
    std::string().swap(e.config_notes);
  });
}

zr_status zr_engine_init_params(zr_engine* engine, zr_init_fn init, void* user, int from_rank0) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_init_params", "engine"));
    // Only rank 0 calls `init` when broadcasting, so the other ranks may pass NULL.
    if (init == nullptr && (from_rank0 == 0 || engine->engine->plan().options.rank == 0)) {
      return absl::InvalidArgumentError("zr_engine_init_params: init is NULL");
    }
    auto adapter = [init, user](int index, const zerort::memory::ParamSpec& spec,
                                float* values) {
      const int64_t numel = spec.numel();
      init(user, index, spec.name.c_str(), static_cast<int>(spec.shape.size()),
           spec.shape.data(), numel, values);
    };
    return engine->engine->InitParams(adapter, from_rank0 != 0);
  });
}

zr_status zr_engine_param(zr_engine* engine, int i, void** out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_param", "engine"));
    RETURN_IF_ERROR(NotNull(out, "zr_engine_param", "out"));
    ASSIGN_OR_RETURN(*out, engine->engine->param(i));
    return absl::OkStatus();
  });
}

zr_status zr_engine_grad(zr_engine* engine, int i, void** out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_grad", "engine"));
    RETURN_IF_ERROR(NotNull(out, "zr_engine_grad", "out"));
    ASSIGN_OR_RETURN(*out, engine->engine->grad(i));
    return absl::OkStatus();
  });
}

zr_status zr_engine_grad_ready(zr_engine* engine, int i) {
  return ForwardToEngine(engine, "zr_engine_grad_ready",
                         [&](zerort::Engine& e) { return e.GradReady(i); });
}

zr_status zr_engine_grad_ready_unit(zr_engine* engine, int unit) {
  return ForwardToEngine(engine, "zr_engine_grad_ready_unit",
                         [&](zerort::Engine& e) { return e.GradReadyUnit(unit); });
}

zr_status zr_engine_set_grad_buffer(zr_engine* engine, int i, void* buffer, int* direct) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_set_grad_buffer", "engine"));
    ASSIGN_OR_RETURN(const bool d, engine->engine->SetGradBuffer(i, buffer));
    if (direct != nullptr) *direct = d ? 1 : 0;
    return absl::OkStatus();
  });
}

zr_status zr_engine_grad_copy_reason(const zr_engine* engine, int i, const char** reason) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_grad_copy_reason", "engine"));
    RETURN_IF_ERROR(NotNull(reason, "zr_engine_grad_copy_reason", "reason"));
    if (i < 0 || i >= engine->engine->num_params()) {
      return absl::OutOfRangeError(absl::StrCat("zr_engine_grad_copy_reason(", i, "): there are ",
                                                engine->engine->num_params(), " parameters"));
    }
    *reason = engine->engine->grad_copy_reason(i).c_str();
    return absl::OkStatus();
  });
}

int zr_engine_reduced_units(const zr_engine* engine) {
  return UsableOrSetError(engine, "zr_engine_reduced_units") ? engine->engine->reduced_units() : 0;
}

zr_status zr_engine_gather(zr_engine* engine, int unit) {
  return ForwardToEngine(engine, "zr_engine_gather",
                         [&](zerort::Engine& e) { return e.Gather(unit); });
}

zr_status zr_engine_release(zr_engine* engine, int unit) {
  return ForwardToEngine(engine, "zr_engine_release",
                         [&](zerort::Engine& e) { return e.Release(unit); });
}

zr_status zr_engine_acquire(zr_engine* engine, const int* params, int count) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_acquire", "engine"));
    ASSIGN_OR_RETURN(const absl::Span<const int> set,
                     IndexSpan(params, count, "zr_engine_acquire"));
    return engine->engine->AcquireParams(set);
  });
}

zr_status zr_engine_release_params(zr_engine* engine, const int* params, int count) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_release_params", "engine"));
    ASSIGN_OR_RETURN(const absl::Span<const int> set,
                     IndexSpan(params, count, "zr_engine_release_params"));
    return engine->engine->ReleaseParams(set);
  });
}

zr_status zr_engine_step(zr_engine* engine, zr_step_stats* stats) {
  return RunStep(engine, stats, "zr_engine_step", [&] { return engine->engine->Step(); });
}

zr_status zr_engine_device_times(zr_engine* engine, zr_device_times* out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_device_times", "engine"));
    RETURN_IF_ERROR(NotNull(out, "zr_engine_device_times", "out"));
    RETURN_IF_ERROR(CheckStructSize<zr_device_times>(out->struct_size, "zr_engine_device_times",
                                                     "zr_device_times"));
    ASSIGN_OR_RETURN(const zerort::DeviceStepTimes t, engine->engine->DeviceTimes());
    const zr_device_times value{sizeof(zr_device_times), t.step,      t.norm_ms,
                                t.update_ms,             t.gather_ms, t.total_ms};
    return WriteSized(value, out, "zr_engine_device_times", "zr_device_times");
  });
}

zr_status zr_engine_set_hyperparams(zr_engine* engine, const zr_adamw_scalars* scalars) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_set_hyperparams", "engine"));
    ASSIGN_OR_RETURN(zr_adamw_scalars s,
                     ReadSized(scalars, "zr_engine_set_hyperparams", "zr_adamw_scalars"));
    return engine->engine->SetHyperparams({s.lr, s.beta1, s.beta2, s.eps, s.weight_decay});
  });
}

zr_status zr_engine_set_learning_rate(zr_engine* engine, double lr) {
  return ForwardToEngine(engine, "zr_engine_set_learning_rate",
                         [&](zerort::Engine& e) { return e.SetLearningRate(lr); });
}

zr_status zr_engine_hyperparams(const zr_engine* engine, zr_adamw_scalars* out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_hyperparams", "engine"));
    const zerort::AdamWScalars s = engine->engine->hyperparams();
    zr_adamw_scalars value{sizeof(zr_adamw_scalars), s.lr, s.beta1, s.beta2, s.eps,
                           s.weight_decay};
    return WriteSized(value, out, "zr_engine_hyperparams", "zr_adamw_scalars");
  });
}

int zr_engine_last_micro_step(const zr_engine* engine) {
  if (!UsableOrSetError(engine, "zr_engine_last_micro_step")) return 0;
  return engine->engine->last_micro_step() ? 1 : 0;
}

zr_status zr_engine_compute_grad_norm(zr_engine* engine, zr_grad_norm* out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_compute_grad_norm", "engine"));
    if (out != nullptr) {
      RETURN_IF_ERROR(CheckStructSize<zr_grad_norm>(out->struct_size,
                                                    "zr_engine_compute_grad_norm",
                                                    "zr_grad_norm"));
    }
    ASSIGN_OR_RETURN(zerort::GradNormInfo g, engine->engine->ComputeGradNorm());
    if (out == nullptr) return absl::OkStatus();
    zr_grad_norm value{sizeof(zr_grad_norm), g.norm, g.overflow ? 1 : 0, g.clip_coef,
                       g.loss_scale};
    return WriteSized(value, out, "zr_engine_compute_grad_norm", "zr_grad_norm");
  });
}

zr_status zr_engine_apply_step(zr_engine* engine, const zr_apply_options* options,
                               zr_step_stats* stats) {
  return RunStep(engine, stats, "zr_engine_apply_step",
                 [&]() -> absl::StatusOr<zerort::StepStats> {
                   zerort::ApplyOptions o;
                   if (options != nullptr) {
                     ASSIGN_OR_RETURN(zr_apply_options in, ReadSized(options,
                                                                     "zr_engine_apply_step",
                                                                     "zr_apply_options"));
                     if (in.has_clip_coef != 0) o.clip_coef = in.clip_coef;
                   }
                   return engine->engine->ApplyStep(o);
                 });
}

zr_status zr_engine_skip_step(zr_engine* engine, zr_step_stats* stats) {
  return RunStep(engine, stats, "zr_engine_skip_step", [&] { return engine->engine->SkipStep(); });
}

zr_status zr_engine_allreduce_scalars(zr_engine* engine, double* values, int n,
                                      zr_reduce_op op) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_allreduce_scalars", "engine"));
    if (n < 0 || (n > 0 && values == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zr_engine_allreduce_scalars: n=", n, " with values ", values == nullptr ? "NULL" : "set"));
    }
    // Read as the int C passed (as zr_convert does): a value outside the enum is not a valid
    // zr_reduce_op in C++, and UBSan stops a load of one.
    static_assert(sizeof(zr_reduce_op) == sizeof(int), "C passes zr_reduce_op as an int");
    int raw_op = 0;
    std::memcpy(&raw_op, &op, sizeof raw_op);
    if (raw_op != ZR_REDUCE_SUM && raw_op != ZR_REDUCE_AVG && raw_op != ZR_REDUCE_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("zr_engine_allreduce_scalars: op=", raw_op,
                       " is not ZR_REDUCE_SUM, ZR_REDUCE_AVG or ZR_REDUCE_MAX"));
    }
    static_assert(static_cast<int>(zerort::comm::ReduceOp::kAvg) == ZR_REDUCE_AVG &&
                      static_cast<int>(zerort::comm::ReduceOp::kMax) == ZR_REDUCE_MAX,
                  "zr_reduce_op mirrors comm::ReduceOp");
    return engine->engine->AllReduceScalars(absl::MakeSpan(values, n),
                                            static_cast<zerort::comm::ReduceOp>(op));
  });
}

zr_status zr_engine_allgather_scalars(zr_engine* engine, const double* values, int n, double* out,
                                      int64_t capacity) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_allgather_scalars", "engine"));
    if (n < 0 || (n > 0 && (values == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError(
          absl::StrCat("zr_engine_allgather_scalars: n=", n, " with values ",
                       values == nullptr ? "NULL" : "set", " and out ",
                       out == nullptr ? "NULL" : "set"));
    }
    // Checked before the collective so that every rank fails alike when all pass the same size.
    const int64_t needed = static_cast<int64_t>(n) * engine->engine->communicator()->size();
    if (capacity < needed) {
      return absl::OutOfRangeError(absl::StrCat("zr_engine_allgather_scalars: capacity ",
                                                capacity, " < ", needed, " (n x world size)"));
    }
    ASSIGN_OR_RETURN(std::vector<double> all,
                     engine->engine->AllGatherScalars(absl::MakeConstSpan(values, n)));
    if (!all.empty()) std::memcpy(out, all.data(), all.size() * sizeof(double));
    return absl::OkStatus();
  });
}

zr_status zr_engine_barrier(zr_engine* engine) {
  return ForwardToEngine(engine, "zr_engine_barrier",
                         [&](zerort::Engine& e) { return e.Barrier(); });
}

zr_status zr_comm_allreduce_scalars(zr_comm* comm, double* values, int n, zr_reduce_op op) {
  return Guard([&]() -> absl::Status {
    const char* fn = "zr_comm_allreduce_scalars";
    RETURN_IF_ERROR(Live(comm, fn, "comm"));
    if (n < 0 || (n > 0 && values == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": n=", n, " with values ", values == nullptr ? "NULL" : "set"));
    }
    int raw_op = 0;  // read as the int C passed, as zr_engine_allreduce_scalars does
    std::memcpy(&raw_op, &op, sizeof raw_op);
    if (raw_op != ZR_REDUCE_SUM && raw_op != ZR_REDUCE_AVG && raw_op != ZR_REDUCE_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          fn, ": op=", raw_op, " is not ZR_REDUCE_SUM, ZR_REDUCE_AVG or ZR_REDUCE_MAX"));
    }
    // Values travel as their bits (comm/agree.h), so the reduction below sees exactly each
    // rank's doubles; the counts first, so that a mismatch fails every rank alike.
    zerort::comm::DirectHostExchange exchange(comm->comm.get());
    ASSIGN_OR_RETURN(std::vector<uint64_t> counts,
                     zerort::comm::AllGatherU64(exchange, {static_cast<uint64_t>(n)}));
    for (int r = 0; r < exchange.size(); ++r) {
      if (counts[r] != counts[0]) {
        return absl::InvalidArgumentError(absl::StrCat(fn, ": rank ", r, " passed n=",
                                                       counts[r], ", rank 0 n=", counts[0]));
      }
    }
    std::vector<uint64_t> mine(n);
    if (n > 0) std::memcpy(mine.data(), values, n * sizeof(double));
    ASSIGN_OR_RETURN(std::vector<uint64_t> all, zerort::comm::AllGatherU64(exchange, mine));
    for (int k = 0; k < n; ++k) {
      double acc = 0;
      for (int r = 0; r < exchange.size(); ++r) {  // rank order: the same bits on every rank
        double x;
        std::memcpy(&x, &all[static_cast<size_t>(r) * n + k], sizeof x);
        if (r == 0) {
          acc = x;
        } else if (raw_op == ZR_REDUCE_MAX) {
          if (std::isnan(x) || x > acc) acc = x;
        } else {
          acc += x;
        }
      }
      values[k] = raw_op == ZR_REDUCE_AVG ? acc / exchange.size() : acc;
    }
    return absl::OkStatus();
  });
}

zr_status zr_engine_gather_master_weights(zr_engine* engine, float* out, int64_t capacity) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_gather_master_weights", "engine"));
    RETURN_IF_ERROR(NotNull(out, "zr_engine_gather_master_weights", "out"));
    const int64_t needed = engine->engine->plan().num_elements;
    // Checked before the collective so that every rank fails alike when all pass the same size.
    if (capacity < needed) {
      return absl::OutOfRangeError(absl::StrCat("zr_engine_gather_master_weights: capacity ",
                                                capacity, " < ", needed, " elements"));
    }
    ASSIGN_OR_RETURN(std::vector<float> master, engine->engine->GatherMasterWeights());
    std::memcpy(out, master.data(), master.size() * sizeof(float));
    return absl::OkStatus();
  });
}

zr_status zr_engine_plan_summary(const zr_engine* engine, zr_plan_summary* out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_plan_summary", "engine"));
    const zerort::memory::Plan& plan = engine->engine->plan();
    const zerort::MemoryReport report = engine->engine->memory_report();
    zr_plan_summary summary{};
    summary.stage = plan.options.stage;
    summary.world_size = plan.options.world_size;
    summary.rank = plan.options.rank;
    summary.compute_dtype = static_cast<zr_dtype>(plan.options.compute_dtype);
    summary.num_params = engine->engine->num_params();
    summary.num_units = engine->engine->num_units();
    summary.num_elements = plan.num_elements;
    summary.padded_elements = plan.padded_elements;
    summary.shard_elements = plan.shard_elements;
    summary.model_state_bytes = plan.model_state_bytes;
    summary.comm_bytes_per_step = plan.comm_bytes_per_step;
    FillBytes(report, &summary);
    return WriteSized(summary, out, "zr_engine_plan_summary", "zr_plan_summary");
  });
}

zr_status zr_engine_memory_report(const zr_engine* engine, zr_memory_report* out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_memory_report", "engine"));
    const zerort::MemoryReport report = engine->engine->memory_report();
    zr_memory_report r{};
    FillBytes(report, &r);
    r.activation_bytes_per_sample = report.activation_bytes_per_sample;
    r.micro_batch = report.micro_batch;
    r.activation_bytes = report.activation_bytes;
    r.device_budget_bytes = report.device_budget_bytes;
    r.trainer_grad_bytes = report.trainer_grad_bytes;
    r.trainer_grad_in_place_bytes = report.trainer_grad_in_place_bytes;
    r.trainer_grad_copied_bytes = report.trainer_grad_copied_bytes;
    r.engine_grad_bytes = report.engine_grad_bytes;
    return WriteSized(r, out, "zr_engine_memory_report", "zr_memory_report");
  });
}

zr_status zr_engine_plan_json(const zr_engine* engine, const char** json) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_plan_json", "engine"));
    RETURN_IF_ERROR(NotNull(json, "zr_engine_plan_json", "json"));
    *json = engine->plan_json.c_str();
    return absl::OkStatus();
  });
}

zr_status zr_engine_config_notes(const zr_engine* engine, const char** notes) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_config_notes", "engine"));
    RETURN_IF_ERROR(NotNull(notes, "zr_engine_config_notes", "notes"));
    *notes = engine->config_notes.c_str();
    return absl::OkStatus();
  });
}

zr_status zr_engine_unit_of(const zr_engine* engine, int i, int* unit) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_unit_of", "engine"));
    RETURN_IF_ERROR(NotNull(unit, "zr_engine_unit_of", "unit"));
    if (i < 0 || i >= engine->engine->num_params()) {
      return absl::OutOfRangeError(absl::StrCat("zr_engine_unit_of: parameter index ", i,
                                                " outside [0, ",
                                                engine->engine->num_params(), ")"));
    }
    *unit = engine->engine->unit_of(i);
    return absl::OkStatus();
  });
}

zr_dtype zr_engine_compute_dtype(const zr_engine* engine) {
  if (!UsableOrSetError(engine, "zr_engine_compute_dtype")) return ZR_F32;
  return static_cast<zr_dtype>(engine->engine->plan().options.compute_dtype);
}

double zr_engine_loss_scale(const zr_engine* engine) {
  return UsableOrSetError(engine, "zr_engine_loss_scale") ? engine->engine->loss_scale() : 0.0;
}

int64_t zr_engine_step_count(const zr_engine* engine) {
  return UsableOrSetError(engine, "zr_engine_step_count") ? engine->engine->step() : -1;
}

zr_status zr_engine_save_checkpoint(zr_engine* engine, const char* root) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_save_checkpoint", "engine"));
    RETURN_IF_ERROR(NotNull(root, "zr_engine_save_checkpoint", "root"));
    return zerort::SaveCheckpoint(*engine->engine, root).status();
  });
}

zr_status zr_engine_load_checkpoint(zr_engine* engine, const char* path, int allow_reshard) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_load_checkpoint", "engine"));
    RETURN_IF_ERROR(NotNull(path, "zr_engine_load_checkpoint", "path"));
    zerort::LoadOptions options;
    options.allow_reshard = allow_reshard != 0;
    return zerort::LoadCheckpoint(*engine->engine, path, options);
  });
}

zr_status zr_checkpointer_create(zr_checkpointer** out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(out, "zr_checkpointer_create", "out"));
    *out = Register(std::make_unique<zr_checkpointer>());
    return absl::OkStatus();
  });
}

void zr_checkpointer_destroy(zr_checkpointer* checkpointer) {
  Destroy(checkpointer, "zr_checkpointer_destroy",
          [](zr_checkpointer& c) { c.checkpointer.reset(); });
}

zr_status zr_checkpointer_start(zr_checkpointer* checkpointer, zr_engine* engine,
                                const char* root) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(checkpointer, "zr_checkpointer_start", "checkpointer"));
    RETURN_IF_ERROR(Live(engine, "zr_checkpointer_start", "engine"));
    RETURN_IF_ERROR(NotNull(root, "zr_checkpointer_start", "root"));
    return checkpointer->checkpointer->Start(*engine->engine, root);
  });
}

zr_status zr_checkpointer_finish(zr_checkpointer* checkpointer, zr_engine* engine) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(checkpointer, "zr_checkpointer_finish", "checkpointer"));
    // NULL: the engine may already be destroyed, which is safe with a save in flight (the
    // checkpointer never touches it after Start; Engine::SnapshotWaiter).
    const zerort::Engine* saving = checkpointer->checkpointer->saving();
    if (engine != nullptr && saving != nullptr && saving != engine->engine.get()) {
      return absl::InvalidArgumentError(
          "zr_checkpointer_finish: engine is not the one the save in flight was started on");
    }
    return checkpointer->checkpointer->Finish().status();
  });
}

zr_status zr_convert(const void* src, zr_dtype src_dtype, void* dst, zr_dtype dst_dtype,
                     int64_t n) {
  return Guard([&]() -> absl::Status {
    // Checked before anything is written: an unknown dtype used to leave zeros in dst. Read
    // as the int C passed: a value outside the enum is not a valid zr_dtype in C++.
    static_assert(sizeof(zr_dtype) == sizeof(int), "C passes zr_dtype as an int");
    const std::pair<const zr_dtype*, const char*> dtypes[] = {{&src_dtype, "src_dtype"},
                                                              {&dst_dtype, "dst_dtype"}};
    for (const auto& [dtype, name] : dtypes) {
      int raw = 0;
      std::memcpy(&raw, dtype, sizeof raw);
      if (raw != ZR_F32 && raw != ZR_BF16 && raw != ZR_F16) {
        return absl::InvalidArgumentError(absl::StrCat(
            "zr_convert: ", name, " ", raw, " is not ZR_F32, ZR_BF16 or ZR_F16"));
      }
    }
    if (n < 0 || (n > 0 && (src == nullptr || dst == nullptr))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zr_convert: n ", n, " with src ", src == nullptr ? "NULL" : "set", " and dst ",
          dst == nullptr ? "NULL" : "set"));
    }
    // Through fp32, element by element, so equal-sized in-place conversion is safe.
    for (int64_t i = 0; i < n; ++i) {
      float f = 0;
      switch (src_dtype) {
        case ZR_F32: f = static_cast<const float*>(src)[i]; break;
        case ZR_BF16: f = zerort::Bf16ToFloat(static_cast<const uint16_t*>(src)[i]); break;
        case ZR_F16: f = zerort::HalfToFloat(static_cast<const uint16_t*>(src)[i]); break;
      }
      switch (dst_dtype) {
        case ZR_F32: static_cast<float*>(dst)[i] = f; break;
        case ZR_BF16: static_cast<uint16_t*>(dst)[i] = zerort::FloatToBf16(f); break;
        case ZR_F16: static_cast<uint16_t*>(dst)[i] = zerort::FloatToHalf(f); break;
      }
    }
    return absl::OkStatus();
  });
}

// ---- Fine-tuning: frozen parameters and accumulation without communication ----

zr_status zr_engine_is_frozen(const zr_engine* engine, int i, int* frozen) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_is_frozen", "engine"));
    RETURN_IF_ERROR(NotNull(frozen, "zr_engine_is_frozen", "frozen"));
    if (i < 0 || i >= engine->engine->num_params()) {
      return absl::OutOfRangeError(absl::StrCat("zr_engine_is_frozen(", i, "): there are ",
                                                engine->engine->num_params(), " parameters"));
    }
    *frozen = engine->engine->frozen(i) ? 1 : 0;
    return absl::OkStatus();
  });
}

zr_status zr_engine_set_frozen(zr_engine* engine, int i, int frozen) {
  return ForwardToEngine(engine, "zr_engine_set_frozen",
                         [&](zerort::Engine& e) { return e.SetFrozen(i, frozen != 0); });
}

zr_status zr_engine_set_gradient_sync(zr_engine* engine, int sync) {
  return ForwardToEngine(engine, "zr_engine_set_gradient_sync",
                         [&](zerort::Engine& e) { return e.SetGradientSync(sync != 0); });
}

// ---- Parking ----

zr_status zr_engine_park(zr_engine* engine) {
  return ForwardToEngine(engine, "zr_engine_park", [](zerort::Engine& e) { return e.Park(); });
}

zr_status zr_engine_unpark(zr_engine* engine) {
  return ForwardToEngine(engine, "zr_engine_unpark",
                         [](zerort::Engine& e) { return e.Unpark(); });
}

int zr_engine_parked(const zr_engine* engine) {
  if (!UsableOrSetError(engine, "zr_engine_parked")) return 0;
  return engine->engine->parked() ? 1 : 0;
}

zr_status zr_engine_parked_bytes(const zr_engine* engine, int64_t* device_bytes,
                                 int64_t* host_bytes) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_parked_bytes", "engine"));
    if (device_bytes != nullptr) *device_bytes = engine->engine->parked_device_bytes();
    if (host_bytes != nullptr) *host_bytes = engine->engine->parked_host_bytes();
    return absl::OkStatus();
  });
}

zr_status zr_device_memory(const zr_device* device, int64_t* resident_bytes,
                           int64_t* reserved_bytes) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(device, "zr_device_memory", "device"));
    const std::optional<zerort::memory::AllocatorUsage> usage =
        device->device->allocator(zerort::memory::MemoryKind::kDevice)->usage();
    if (!usage.has_value()) {
      return absl::UnimplementedError(absl::StrCat("zr_device_memory: device '",
                                                   device->device->name(),
                                                   "' does not count its memory"));
    }
    if (resident_bytes != nullptr) *resident_bytes = static_cast<int64_t>(usage->resident_bytes);
    if (reserved_bytes != nullptr) *reserved_bytes = static_cast<int64_t>(usage->reserved_bytes);
    return absl::OkStatus();
  });
}

}  // extern "C"

// ---- Weights as safetensors, and parameter groups ----
// Included here, with the section that uses them, so that sections appended by others stay apart.
#include <algorithm>

#include "checkpoint/weights.h"

namespace {

absl::StatusOr<zerort::WeightsExportOptions> ExportOptions(zr_dtype dtype,
                                                           int64_t max_shard_bytes) {
  zerort::WeightsExportOptions options;
  if (dtype != ZR_F32 && dtype != ZR_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights export dtype ", static_cast<int>(dtype), ": use ZR_F32 or ZR_BF16"));
  }
  options.dtype = static_cast<zerort::DType>(dtype);
  options.max_shard_bytes = max_shard_bytes;
  return options;
}

// The rules of a name map given as text; NULL or "": none.
absl::StatusOr<zerort::WeightsNameMap> NameMap(const char* text, const char* call) {
  if (text == nullptr || *text == '\0') return zerort::WeightsNameMap();
  return zerort::WeightsNameMap::Parse(text, absl::StrCat(call, ": name_map"));
}

// The names, each followed by '\n', NUL-terminated and cut to `capacity` bytes.
void CopyNames(const std::vector<std::string>& names, char* out, int64_t capacity) {
  if (out == nullptr || capacity <= 0) return;
  std::string all;
  for (const std::string& n : names) absl::StrAppend(&all, n, "\n");
  const size_t n = std::min(all.size(), static_cast<size_t>(capacity - 1));
  std::memcpy(out, all.data(), n);
  out[n] = '\0';
}

}  // namespace

extern "C" {

zr_status zr_engine_export_weights(zr_engine* engine, const char* out, zr_dtype dtype,
                                   int64_t max_shard_bytes) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_export_weights", "engine"));
    RETURN_IF_ERROR(NotNull(out, "zr_engine_export_weights", "out"));
    ASSIGN_OR_RETURN(zerort::WeightsExportOptions options, ExportOptions(dtype, max_shard_bytes));
    return zerort::ExportWeights(*engine->engine, out, options).status();
  });
}

zr_status zr_checkpoint_export_weights(const char* checkpoint, const char* out, zr_dtype dtype,
                                       int64_t max_shard_bytes) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(NotNull(checkpoint, "zr_checkpoint_export_weights", "checkpoint"));
    RETURN_IF_ERROR(NotNull(out, "zr_checkpoint_export_weights", "out"));
    ASSIGN_OR_RETURN(zerort::WeightsExportOptions options, ExportOptions(dtype, max_shard_bytes));
    return zerort::ExportCheckpointWeights(checkpoint, out, options).status();
  });
}

zr_status zr_engine_import_weights(zr_engine* engine, const char* path, int allow_extra,
                                   char* ignored, int64_t capacity, int64_t* ignored_count) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_import_weights", "engine"));
    RETURN_IF_ERROR(NotNull(path, "zr_engine_import_weights", "path"));
    zerort::WeightsImportOptions options;
    options.allow_extra = allow_extra != 0;
    ASSIGN_OR_RETURN(zerort::WeightsImportReport report,
                     zerort::ImportWeights(*engine->engine, path, options));
    CopyNames(report.ignored, ignored, capacity);
    if (ignored_count != nullptr) *ignored_count = static_cast<int64_t>(report.ignored.size());
    return absl::OkStatus();
  });
}

zr_status zr_engine_import_weights_mapped(zr_engine* engine, const char* path,
                                          const char* name_map, int allow_extra, char* ignored,
                                          int64_t capacity, int64_t* ignored_count) {
  return Guard([&]() -> absl::Status {
    constexpr char kCall[] = "zr_engine_import_weights_mapped";
    RETURN_IF_ERROR(Live(engine, kCall, "engine"));
    RETURN_IF_ERROR(NotNull(path, kCall, "path"));
    zerort::WeightsImportOptions options;
    options.allow_extra = allow_extra != 0;
    ASSIGN_OR_RETURN(options.names, NameMap(name_map, kCall));
    ASSIGN_OR_RETURN(zerort::WeightsImportReport report,
                     zerort::ImportWeights(*engine->engine, path, options));
    CopyNames(report.ignored, ignored, capacity);
    if (ignored_count != nullptr) *ignored_count = static_cast<int64_t>(report.ignored.size());
    return absl::OkStatus();
  });
}

zr_status zr_engine_export_weights_mapped(zr_engine* engine, const char* out, zr_dtype dtype,
                                          int64_t max_shard_bytes, const char* name_map) {
  return Guard([&]() -> absl::Status {
    constexpr char kCall[] = "zr_engine_export_weights_mapped";
    RETURN_IF_ERROR(Live(engine, kCall, "engine"));
    RETURN_IF_ERROR(NotNull(out, kCall, "out"));
    ASSIGN_OR_RETURN(zerort::WeightsExportOptions options, ExportOptions(dtype, max_shard_bytes));
    ASSIGN_OR_RETURN(options.names, NameMap(name_map, kCall));
    return zerort::ExportWeights(*engine->engine, out, options).status();
  });
}

zr_status zr_checkpoint_export_weights_mapped(const char* checkpoint, const char* out,
                                              zr_dtype dtype, int64_t max_shard_bytes,
                                              const char* name_map) {
  return Guard([&]() -> absl::Status {
    constexpr char kCall[] = "zr_checkpoint_export_weights_mapped";
    RETURN_IF_ERROR(NotNull(checkpoint, kCall, "checkpoint"));
    RETURN_IF_ERROR(NotNull(out, kCall, "out"));
    ASSIGN_OR_RETURN(zerort::WeightsExportOptions options, ExportOptions(dtype, max_shard_bytes));
    ASSIGN_OR_RETURN(options.names, NameMap(name_map, kCall));
    return zerort::ExportCheckpointWeights(checkpoint, out, options).status();
  });
}

zr_status zr_engine_param_group(const zr_engine* engine, int i, zr_param_group_info* out) {
  return Guard([&]() -> absl::Status {
    RETURN_IF_ERROR(Live(engine, "zr_engine_param_group", "engine"));
    if (i < 0 || i >= engine->engine->num_params()) {
      return absl::OutOfRangeError(absl::StrCat("zr_engine_param_group: parameter index ", i,
                                                " outside [0, ",
                                                engine->engine->num_params(), ")"));
    }
    const zerort::AdamWScalars step = engine->engine->hyperparams();
    const std::optional<zerort::ParamGroup> group = engine->engine->param_group(i);
    zr_param_group_info info{};
    info.struct_size = sizeof info;
    info.has_group = group.has_value() ? 1 : 0;
    info.weight_decay = group ? group->weight_decay : step.weight_decay;
    info.lr_scale = group ? group->lr_scale : 1.0;
    info.lr = step.lr * info.lr_scale;
    return WriteSized(info, out, "zr_engine_param_group", "zr_param_group_info");
  });
}

}  // extern "C"
