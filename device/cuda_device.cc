#include "device/cuda_device.h"

#include <cuda.h>  // types and constants only: libcuda is reached through the runtime
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "base/cuda_status.h"
#include "base/status.h"
#include "offload/cpu_kernels.h"
#include "device/internal/cuda_compact_plan.h"
#include "device/internal/cuda_kernels.h"
#include "memory/allocation_ledger.h"
#include "memory/pinned_pool.h"

namespace zerort {
namespace {

constexpr size_t kRawAlignment = 4096;

static_assert(offload::kNormBlock == 1024, "cuda_kernels.cu hard-codes the norm block");
static_assert(offload::kNormTreeChunk == 1024, "cuda_kernels.cu hard-codes the norm tree chunk");
static_assert(offload::kNormBlock == cuda_internal::kBatchNormBlock &&
                  offload::kNormTreeChunk == cuda_internal::kBatchTreeChunk,
              "cuda_norm_batch.h must cut ranges as offload::SquaredNormF32 does");

// A failed runtime call also records itself as the thread's "last error"; clear it so that the
// next launch's cudaGetLastError() does not report it again against an innocent kernel.
cudaError_t Cleared(cudaError_t e) {
  if (e != cudaSuccess) cudaGetLastError();
  return e;
}

absl::Status CudaFailure(cudaError_t e, absl::string_view what) {
  return absl::Status(CudaErrorCode(e), absl::StrCat(what, ": ", cudaGetErrorName(e), ": ",
                                                     cudaGetErrorString(e)));
}

// The error of a launcher (its cudaGetLastError() right after the launch).
absl::Status LaunchStatus(int code, absl::string_view device, absl::string_view op, size_t n,
                          DType dtype) {
  const cudaError_t e = static_cast<cudaError_t>(code);
  if (e == cudaSuccess) return absl::OkStatus();
  return CudaFailure(e, absl::StrCat(device, ": launching ", op, " on ", n, " ", DTypeName(dtype),
                                     " elements"));
}

// The driver's virtual memory management calls (cuMemAddressReserve, cuMemCreate, cuMemMap,
// ...), reached through the runtime's cudaGetDriverEntryPointByVersion so that zerort links
// only cudart, never libcuda (the driver a process finds at run time provides them; vLLM's
// sleep mode and PyTorch's expandable segments reach them the same way). Null when the driver
// lacks them or the GPU does not support them; `why` then says which.
struct VmmDriver {
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;

  // Process-wide; `why` (when null) is the reason, for messages.
  static const VmmDriver* Get(std::string* why) {
    static std::string* const reason = new std::string();
    static const VmmDriver* const driver = [] () -> const VmmDriver* {
      // A way back to plain cudaMalloc without a rebuild, should a driver or a tool (an older
      // compute-sanitizer, a profiler) mishandle these mappings; Park is then Unimplemented.
      if (const char* v = std::getenv("ZERORT_CUDA_VMM"); v != nullptr && std::string(v) == "0") {
        *reason = "ZERORT_CUDA_VMM=0 turns the driver's virtual memory management off";
        return nullptr;
      }
      auto* d = new VmmDriver();
      bool ok = true;
      // 12000: the ABI version of each symbol we were compiled against (all stable since 10.2).
      auto load = [&ok](const char* symbol, auto* fn) {
        if (!ok) return;
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        const cudaError_t e =
            Cleared(cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found));
        if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
          *reason = absl::StrCat("the driver has no ", symbol, " (",
                                 e != cudaSuccess ? cudaGetErrorString(e) : "symbol not found",
                                 ")");
          ok = false;
          return;
        }
        *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      };
      load("cuGetErrorName", &d->error_name);
      load("cuDeviceGet", &d->device_get);
      load("cuDeviceGetAttribute", &d->device_attribute);
      load("cuMemGetAllocationGranularity", &d->granularity);
      load("cuMemAddressReserve", &d->reserve);
      load("cuMemAddressFree", &d->address_free);
      load("cuMemCreate", &d->create);
      load("cuMemRelease", &d->release);
      load("cuMemMap", &d->map);
      load("cuMemUnmap", &d->unmap);
      load("cuMemSetAccess", &d->set_access);
      if (!ok) {
        delete d;
        return nullptr;
      }
      return d;
    }();
    if (driver == nullptr && why != nullptr) *why = *reason;
    return driver;
  }

  // `failure`: the code of any error but out of memory (ResourceExhausted): reserving address
  // space or creating memory fails for want of it, whatever the driver's code.
  absl::Status Check(CUresult r, absl::string_view what,
                     absl::StatusCode failure = absl::StatusCode::kInternal) const {
    if (r == CUDA_SUCCESS) return absl::OkStatus();
    const char* name = nullptr;
    if (error_name == nullptr || error_name(r, &name) != CUDA_SUCCESS) name = "unknown";
    const absl::StatusCode code =
        r == CUDA_ERROR_OUT_OF_MEMORY ? absl::StatusCode::kResourceExhausted : failure;
    return absl::Status(code, absl::StrCat(what, ": ", name));
  }
};

// kDevice memory behind memory::RawAllocator, counted (usage()).
//
// With the driver's virtual memory management (every GPU of compute capability 8.0 on Linux
// has it), each allocation is an address range reserved with cuMemAddressReserve and backed by
// one physical allocation (cuMemCreate + cuMemMap + cuMemSetAccess), both rounded up to the
// allocation granularity (2 MiB on current GPUs). Decommit unmaps and releases the physical
// allocation and keeps the range; Recommit creates a new one and maps it at the same address:
// every pointer into the allocation is valid again (Engine::Park). The runtime treats these
// ranges as device memory of this GPU (cudaPointerGetAttributes, cudaMemcpyAsync, kernels,
// NCCL).
//
// Without it, cudaMalloc: the runtime gives at least 256-byte alignment; RawAllocator promises
// 4096, so a misaligned block is retried with 4096 bytes of slack and remembered to free the
// original pointer. Decommit is then Unimplemented, naming why.
class CudaAllocator final : public memory::RawAllocator {
 public:
  CudaAllocator(int ordinal, const VmmDriver* vmm, std::string no_vmm_reason)
      : ordinal_(ordinal),
        name_(absl::StrCat("cuda:", ordinal)),
        vmm_(vmm),
        no_vmm_reason_(std::move(no_vmm_reason)) {}

  ~CudaAllocator() override {
    // Allocations must be freed first (RawAllocator's contract); ranges left are returned so
    // that a leak does not keep physical memory.
    absl::MutexLock lock(&mu_);
    ledger_.ForEach([this](void* p, Ledger::Entry& a) {
      if (a.extra.vmm) FreeVmm(p, a);
    });
  }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    if (cudaError_t e = Cleared(cudaSetDevice(ordinal_)); e != cudaSuccess) {
      return CudaFailure(e, absl::StrCat(name_, ": cudaSetDevice"));
    }
    if (vmm_ != nullptr) return AllocateVmm(bytes);
    ASSIGN_OR_RETURN(void* p, Raw(bytes));
    void* raw = nullptr;
    if (reinterpret_cast<uintptr_t>(p) % kRawAlignment != 0) {
      Release(p);
      ASSIGN_OR_RETURN(raw, Raw(bytes + kRawAlignment));
      p = reinterpret_cast<void*>(
          memory::AlignUp(reinterpret_cast<uintptr_t>(raw), kRawAlignment));
    }
    absl::MutexLock lock(&mu_);
    Live a;
    a.raw = raw;
    ledger_.Add(p, bytes, a);
    return p;
  }

  void Free(void* p, size_t) override {
    if (p == nullptr) return;
    std::optional<Ledger::Entry> a;
    {
      absl::MutexLock lock(&mu_);
      a = ledger_.Remove(p);
    }
    if (!a.has_value()) return;  // not ours: RawAllocator's REQUIRES
    cudaSetDevice(ordinal_);
    if (a->extra.vmm) {
      FreeVmm(p, *a);
    } else {
      Release(a->extra.raw != nullptr ? a->extra.raw : p);
    }
  }

  absl::Status Decommit(void* p, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Ledger::Entry * a, Find(p, bytes, /*committed=*/true, "Decommit"));
    RETURN_IF_ERROR(UseLocked());
    // Unmap first: the range stays reserved, so no other allocation can take the addresses.
    const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(p);
    RETURN_IF_ERROR(vmm_->Check(vmm_->unmap(va, a->bytes),
                                absl::StrCat(name_, ": cuMemUnmap of ", a->bytes, " bytes")));
    RETURN_IF_ERROR(vmm_->Check(vmm_->release(a->extra.handle),
                                absl::StrCat(name_, ": cuMemRelease of ", a->bytes, " bytes")));
    a->extra.handle = 0;
    ledger_.Decommitted(a);
    return absl::OkStatus();
  }

  absl::Status Recommit(void* p, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Ledger::Entry * a, Find(p, bytes, /*committed=*/false, "Recommit"));
    RETURN_IF_ERROR(UseLocked());
    ASSIGN_OR_RETURN(a->extra.handle, MapAt(reinterpret_cast<CUdeviceptr>(p), a->bytes));
    ledger_.Recommitted(a);
    return absl::OkStatus();
  }

  std::optional<memory::AllocatorUsage> usage() const override {
    absl::MutexLock lock(&mu_);
    return ledger_.usage();
  }

  absl::string_view name() const override { return name_; }

 private:
  // What Free and Recommit need beyond the ledger's counts.
  struct Live {
    bool vmm = false;
    CUmemGenericAllocationHandle handle = 0;  // VMM: the physical allocation while committed
    void* raw = nullptr;    // cudaMalloc: the runtime's pointer of a realigned block, or null
  };
  using Ledger = memory::AllocationLedger<Live>;

  absl::Status UseLocked() const {
    if (cudaError_t e = Cleared(cudaSetDevice(ordinal_)); e != cudaSuccess) {
      return CudaFailure(e, absl::StrCat(name_, ": cudaSetDevice"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Ledger::Entry*> Find(void* p, size_t bytes, bool committed, const char* op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (vmm_ == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          name_, ": ", op, ": device memory comes from cudaMalloc, which cannot release memory "
          "while keeping its addresses (no virtual memory management: ", no_vmm_reason_, ")"));
    }
    // Every allocation is a VMM one while vmm_ is set (Allocate).
    return ledger_.Find(name_, op, p, bytes, Rounded(bytes), committed);
  }

  CUmemAllocationProp Prop() const {
    CUmemAllocationProp prop;
    std::memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal_;
    return prop;
  }

  // The allocation granularity of this GPU, asked once.
  size_t Granularity() const {
    absl::call_once(granularity_once_, [this] {
      const CUmemAllocationProp prop = Prop();
      size_t g = 0;
      if (vmm_->granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
          g == 0) {
        g = size_t{2} << 20;  // what every current GPU reports
      }
      granularity_ = g;
    });
    return granularity_;
  }

  size_t Rounded(size_t bytes) const { return memory::AlignUp(bytes, Granularity()); }

  // A new physical allocation of `bytes`, mapped read-write at `va` for this GPU. On failure
  // nothing stays mapped or allocated.
  absl::StatusOr<CUmemGenericAllocationHandle> MapAt(CUdeviceptr va, size_t bytes) const {
    const CUmemAllocationProp prop = Prop();
    CUmemGenericAllocationHandle handle = 0;
    RETURN_IF_ERROR(vmm_->Check(vmm_->create(&handle, bytes, &prop, 0),
                                absl::StrCat(name_, ": cuMemCreate of ", bytes, " bytes"),
                                absl::StatusCode::kResourceExhausted));
    absl::Status s = vmm_->Check(vmm_->map(va, bytes, 0, handle, 0),
                                 absl::StrCat(name_, ": cuMemMap of ", bytes, " bytes"));
    if (s.ok()) {
      CUmemAccessDesc access;
      std::memset(&access, 0, sizeof access);
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      s = vmm_->Check(vmm_->set_access(va, bytes, &access, 1),
                      absl::StrCat(name_, ": cuMemSetAccess of ", bytes, " bytes"));
      if (!s.ok()) vmm_->unmap(va, bytes);
    }
    if (!s.ok()) {
      vmm_->release(handle);
      return s;
    }
    return handle;
  }

  absl::StatusOr<void*> AllocateVmm(size_t bytes) {
    const size_t size = Rounded(bytes);
    CUdeviceptr va = 0;
    RETURN_IF_ERROR(vmm_->Check(vmm_->reserve(&va, size, Granularity(), 0, 0),
                                absl::StrCat(name_, ": cuMemAddressReserve of ", size,
                                             " bytes (allocating ", bytes, ")"),
                                absl::StatusCode::kResourceExhausted));
    absl::StatusOr<CUmemGenericAllocationHandle> handle = MapAt(va, size);
    if (!handle.ok()) {
      vmm_->address_free(va, size);
      return absl::Status(handle.status().code(), absl::StrCat(handle.status().message(),
                                                               " (allocating ", bytes, ")"));
    }
    void* p = reinterpret_cast<void*>(va);
    absl::MutexLock lock(&mu_);
    Live a;
    a.vmm = true;
    a.handle = *handle;
    ledger_.Add(p, size, a);
    return p;
  }

  // Cannot report (Free's contract): a failure means the context is already broken.
  void FreeVmm(void* p, const Ledger::Entry& a) const {
    const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(p);
    if (a.committed) {
      vmm_->unmap(va, a.bytes);
      vmm_->release(a.extra.handle);
    }
    vmm_->address_free(va, a.bytes);
  }

  absl::StatusOr<void*> Raw(size_t bytes) {
    void* p = nullptr;
    const cudaError_t e = Cleared(cudaMalloc(&p, bytes));
    if (e != cudaSuccess) {
      return CudaFailure(e, absl::StrCat(name_, ": allocating ", bytes, " bytes"));
    }
    return p;
  }

  // Free cannot report errors (RawAllocator's contract); a failure here means the context is
  // already broken, and the next call that can report will.
  void Release(void* p) { Cleared(cudaFree(p)); }

  const int ordinal_;
  const std::string name_;
  const VmmDriver* const vmm_;  // null: cudaMalloc
  const std::string no_vmm_reason_;
  mutable absl::once_flag granularity_once_;
  mutable size_t granularity_ = 0;
  mutable absl::Mutex mu_;
  Ledger ledger_ ABSL_GUARDED_BY(mu_);
};

// cudaHostRegister behind memory::Locker, for the pinned slab cache. Portable: the pages are
// pinned for every device and context of the process, so one cache serves every CUDA device;
// Mapped: device-accessible (at the same address under UVA), as cudaHostAlloc memory was.
class CudaHostRegisterLocker final : public memory::Locker {
 public:
  absl::Status Lock(void* p, size_t bytes) override {
    RETURN_IF_CUDA_ERROR(
        Cleared(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped)),
        "(cudaHostRegister of ", bytes, " bytes)");
    return absl::OkStatus();
  }
  // Cannot report (Locker's contract); a failure means the context is already broken.
  void Unlock(void* p, size_t) override { Cleared(cudaHostUnregister(p)); }
  absl::string_view name() const override { return "cudaHostRegister"; }
};

// Every CUDA device's kPinnedHost allocator: the process-wide cache of registered host slabs
// (memory/pinned_pool.h), so that re-creating an engine reuses them. kRequire: kernels and
// asynchronous copies need the memory registered, so a refusal is an error, as a failed
// cudaHostAlloc was. Never destroyed: unregistering at exit would race the runtime's teardown.
memory::PinnedSlabCache* CudaPinnedSlabs() {
  static memory::PinnedSlabCache* const cache = [] {
    memory::PinnedSlabCacheOptions o;
    o.locker = new CudaHostRegisterLocker();
    o.locking = memory::Locking::kRequire;
    o.name = "cuda pinned host (cudaHostRegister)";
    return new memory::PinnedSlabCache(std::move(o));
  }();
  return cache;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, bool pageable_access, const VmmDriver* vmm, std::string no_vmm_reason)
      : ordinal_(ordinal),
        name_(absl::StrCat("cuda:", ordinal)),
        pageable_access_(pageable_access),
        device_alloc_(ordinal, vmm, std::move(no_vmm_reason)) {}

  absl::string_view name() const override { return name_; }
  bool device_memory() const override { return true; }

  memory::RawAllocator* allocator(memory::MemoryKind kind) override {
    switch (kind) {
      case memory::MemoryKind::kDevice:
        return &device_alloc_;
      case memory::MemoryKind::kPinnedHost:
        return CudaPinnedSlabs();
      case memory::MemoryKind::kPageableHost:
      case memory::MemoryKind::kNvme:  // files, not memory: nothing allocates there
        break;
    }
    return memory::HostAllocator();
  }

  // The default pool keeps what SquaredNorm and AllFinite freed (CreateCudaDevice sets its
  // release threshold to the maximum); trimming returns what no stream still uses.
  absl::Status ReleaseCachedMemory() override {
    RETURN_IF_ERROR(Use());
    cudaMemPool_t pool;
    RETURN_IF_CUDA_ERROR(Cleared(cudaDeviceGetDefaultMemPool(&pool, ordinal_)), "(", name_, ")");
    RETURN_IF_CUDA_ERROR(Cleared(cudaMemPoolTrimTo(pool, 0)), "(", name_,
                         ": ReleaseCachedMemory)");
    return absl::OkStatus();
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream stream) override {
    if (bytes == 0 || dst == src) return absl::OkStatus();
    RETURN_IF_ERROR(Use());
    // cudaMemcpyDefault: UVA tells the runtime which side each pointer is on, so one call
    // serves device<->device, host<->device and host<->host.
    RETURN_IF_CUDA_ERROR(
        Cleared(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, AsStream(stream))),
        "(", name_, ": Copy of ", bytes, " bytes)");
    return absl::OkStatus();
  }

  absl::Status Zero(void* dst, size_t bytes, Stream stream) override {
    if (bytes == 0) return absl::OkStatus();
    RETURN_IF_ERROR(Use());
    ASSIGN_OR_RETURN(cudaMemoryType type, TypeOf(dst, "Zero"));
    if (type == cudaMemoryTypeDevice || type == cudaMemoryTypeManaged) {
      RETURN_IF_CUDA_ERROR(Cleared(cudaMemsetAsync(dst, 0, bytes, AsStream(stream))), "(",
                           name_, ": Zero of ", bytes, " bytes)");
      return absl::OkStatus();
    }
    // Host memory (pinned or not): cudaMemset is only defined for device memory. Keep stream
    // order by draining the stream first; the engine zeroes host buffers only at setup.
    RETURN_IF_CUDA_ERROR(Cleared(cudaStreamSynchronize(AsStream(stream))), "(", name_,
                         ": Zero of ", bytes, " host bytes)");
    std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }

  absl::Status Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
                    Stream stream) override {
    if (n == 0) return absl::OkStatus();
    if (src_dtype == dst_dtype) return Copy(dst, src, n * DTypeSize(src_dtype), stream);
    RETURN_IF_ERROR(Use());
    RETURN_IF_ERROR(CheckAccessible(src, "Cast", "src"));
    RETURN_IF_ERROR(CheckAccessible(dst, "Cast", "dst"));
    return LaunchStatus(cuda_internal::LaunchCast(src, src_dtype, dst, dst_dtype, n, stream),
                        name_, absl::StrCat("Cast to ", DTypeName(dst_dtype)), n, src_dtype);
  }

  absl::Status Accumulate(void* acc, const void* x, DType dtype, size_t n,
                          Stream stream) override {
    if (n == 0) return absl::OkStatus();
    RETURN_IF_ERROR(Use());
    RETURN_IF_ERROR(CheckAccessible(acc, "Accumulate", "acc"));
    RETURN_IF_ERROR(CheckAccessible(x, "Accumulate", "x"));
    return LaunchStatus(cuda_internal::LaunchAccumulate(acc, x, dtype, n, stream), name_,
                        "Accumulate", n, dtype);
  }

  absl::Status Scale(void* x, DType dtype, size_t n, float factor, Stream stream) override {
    if (n == 0) return absl::OkStatus();
    RETURN_IF_ERROR(Use());
    RETURN_IF_ERROR(CheckAccessible(x, "Scale", "x"));
    return LaunchStatus(cuda_internal::LaunchScale(x, dtype, n, factor, stream), name_, "Scale",
                        n, dtype);
  }

  absl::Status SquaredNorm(const void* x, DType dtype, size_t n, float* out,
                           Stream stream) override {
    if (n == 0) {
      *out = 0.0f;
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(Use());
    RETURN_IF_ERROR(CheckAccessible(x, "SquaredNorm", "x"));
    const cudaStream_t s = AsStream(stream);
    const size_t floats = cuda_internal::NormScratch(n);
    // (floats + 1) fp32: the block partials and the tree levels above them (about n / 1023),
    // then the total. Stream-ordered allocation from the device's pool (kept cached, see
    // CreateCudaDevice), so concurrent calls on other streams never share scratch and no call
    // waits for another.
    void* scratch = nullptr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaMallocAsync(&scratch, (floats + 1) * sizeof(float), s)),
                         "(", name_, ": SquaredNorm scratch for ", n, " elements)");
    float* levels = static_cast<float*>(scratch);
    float* total = levels + floats;
    absl::Status status =
        LaunchStatus(cuda_internal::LaunchSquaredNorm(x, dtype, n, levels, total, stream), name_,
                     "SquaredNorm", n, dtype);
    if (status.ok()) {
      const cudaError_t e =
          Cleared(cudaMemcpyAsync(out, total, sizeof(float), cudaMemcpyDefault, s));
      if (e != cudaSuccess) status = CudaFailure(e, absl::StrCat(name_, ": SquaredNorm result"));
    }
    Cleared(cudaFreeAsync(scratch, s));
    return status;
  }

  absl::Status SquaredNormsAndFinite(absl::Span<const NormRange> ranges, float* sumsq,
                                     bool* finite, Stream stream) override {
    const size_t k = ranges.size();
    if (k == 0) return absl::OkStatus();
    RETURN_IF_ERROR(Use());
    std::vector<cuda_internal::NormRangeSpec> specs(k);
    for (size_t i = 0; i < k; ++i) {
      const NormRange& r = ranges[i];
      if (r.n > 0) {
        RETURN_IF_ERROR(CheckAccessible(r.x, "SquaredNormsAndFinite", absl::StrCat("range ", i)));
      }
      specs[i] = {r.x, r.dtype, r.n};
    }
    const int count = static_cast<int>(k);
    const size_t floats = cuda_internal::NormBatchScratch(specs.data(), count);
    // One stream-ordered allocation (as SquaredNorm's): the flags (16-byte rounded), the
    // results, then the partials and tree levels.
    const size_t flag_bytes = (k + 15) / 16 * 16;
    const cudaStream_t s = AsStream(stream);
    void* scratch = nullptr;
    RETURN_IF_CUDA_ERROR(
        Cleared(cudaMallocAsync(&scratch, flag_bytes + (k + floats) * sizeof(float), s)), "(",
        name_, ": SquaredNormsAndFinite scratch for ", k, " ranges)");
    auto* flags = static_cast<unsigned char*>(scratch);
    auto* results = reinterpret_cast<float*>(flags + flag_bytes);
    absl::Status status = absl::OkStatus();
    auto fail = [&](cudaError_t e, absl::string_view what) {
      if (status.ok() && e != cudaSuccess) {
        status = CudaFailure(e, absl::StrCat(name_, ": SquaredNormsAndFinite ", what));
      }
    };
    fail(Cleared(cudaMemsetAsync(flags, 1, k, s)), "flags");
    fail(Cleared(cudaMemsetAsync(results, 0, k * sizeof(float), s)), "results");
    if (status.ok()) {
      const cuda_internal::NormBatchPlan plan =
          cuda_internal::PlanNormBatches(specs.data(), count, results + k, results, flags);
      fail(static_cast<cudaError_t>(cuda_internal::LaunchNormBatches(plan, stream)),
           absl::StrCat("launches for ", k, " ranges"));
    }
    if (status.ok()) {
      fail(Cleared(cudaMemcpyAsync(sumsq, results, k * sizeof(float), cudaMemcpyDefault, s)),
           "results");
      fail(Cleared(cudaMemcpyAsync(finite, flags, k, cudaMemcpyDefault, s)), "flags");
    }
    Cleared(cudaFreeAsync(scratch, s));
    return status;
  }

  absl::Status AllFinite(const void* x, DType dtype, size_t n, bool* out,
                         Stream stream) override {
    if (n == 0) {
      *out = true;
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(Use());
    RETURN_IF_ERROR(CheckAccessible(x, "AllFinite", "x"));
    const cudaStream_t s = AsStream(stream);
    // One byte: 1 = finite so far; the kernel clears it. Copied into *out as a bool (0 or 1).
    void* flag = nullptr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaMallocAsync(&flag, 1, s)), "(", name_,
                         ": AllFinite flag)");
    absl::Status status;
    if (cudaError_t e = Cleared(cudaMemsetAsync(flag, 1, 1, s)); e != cudaSuccess) {
      status = CudaFailure(e, absl::StrCat(name_, ": AllFinite flag"));
    }
    if (status.ok()) {
      status = LaunchStatus(cuda_internal::LaunchAllFinite(
                                x, dtype, n, static_cast<unsigned char*>(flag), stream),
                            name_, "AllFinite", n, dtype);
    }
    if (status.ok()) {
      static_assert(sizeof(bool) == 1, "AllFinite copies one byte into a bool");
      const cudaError_t e = Cleared(cudaMemcpyAsync(out, flag, 1, cudaMemcpyDefault, s));
      if (e != cudaSuccess) status = CudaFailure(e, absl::StrCat(name_, ": AllFinite result"));
    }
    Cleared(cudaFreeAsync(flag, s));
    return status;
  }

  absl::Status AdamWRanges(const offload::AdamWArrays& a,
                           absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                           Stream stream) override {
    RETURN_IF_ERROR(offload::CheckAdamWRanges(ranges, a.n, "AdamW"));
    if (a.n == 0) return absl::OkStatus();
    if (a.master == nullptr || a.m == nullptr || a.v == nullptr || a.grad == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, ": AdamW: null array for n=", a.n, " (master=", a.master != nullptr,
          " m=", a.m != nullptr, " v=", a.v != nullptr, " grad=", a.grad != nullptr, ")"));
    }
    RETURN_IF_ERROR(Use());
    RETURN_IF_ERROR(CheckAccessible(a.master, "AdamW", "master"));
    RETURN_IF_ERROR(CheckAccessible(a.m, "AdamW", "m"));
    RETURN_IF_ERROR(CheckAccessible(a.v, "AdamW", "v"));
    RETURN_IF_ERROR(CheckAccessible(a.grad, "AdamW", "grad"));
    if (a.param_out != nullptr) RETURN_IF_ERROR(CheckAccessible(a.param_out, "AdamW", "param"));
    // One launch per range, on offset pointers: the constants travel by value in the launch,
    // so no table has to be copied to the device first.
    const size_t gsize = DTypeSize(a.grad_dtype), psize = DTypeSize(a.param_dtype);
    for (const offload::AdamWRange& r : ranges) {
      if (r.end == r.begin) continue;
      const cuda_internal::AdamWConstants c =
          cuda_internal::AdamWConstantsOf(r.params, grad_scale);
      void* out = a.param_out == nullptr
                      ? nullptr
                      : static_cast<char*>(a.param_out) + r.begin * psize;
      const size_t n = r.end - r.begin;
      RETURN_IF_ERROR(LaunchStatus(
          cuda_internal::LaunchAdamW(c, a.master + r.begin, a.m + r.begin, a.v + r.begin,
                                     static_cast<const char*>(a.grad) + r.begin * gsize,
                                     a.grad_dtype, out, a.param_dtype, n, stream),
          name_, "AdamW", n, a.grad_dtype));
    }
    return absl::OkStatus();
  }

  // The ranges and the stochastic form's 2^32 index blocks become launches as in
  // cuda_compact_plan.h; each launch takes its constants and key by value, so nothing is copied
  // to the device first and `ranges` need not outlive the call.
  absl::Status CompactAdamWRanges(const offload::CompactAdamWArrays& a,
                                  absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                                  Stream stream) override {
    const std::string who = absl::StrCat(name_, ": CompactAdamW");
    RETURN_IF_ERROR(offload::CheckCompactAdamW(a, ranges, who.c_str()));
    if (a.n == 0) return absl::OkStatus();
    RETURN_IF_ERROR(Use());
    const std::pair<const void*, const char*> arrays[] = {
        {a.master, "master"}, {a.param, "param"}, {a.remainder, "remainder"},
        {a.m, "m"},           {a.v, "v"},         {a.grad, "grad"}};
    for (const auto& [p, what] : arrays) {
      if (p != nullptr) RETURN_IF_ERROR(CheckAccessible(p, "CompactAdamW", what));
    }
    size_t failed_n = 0;
    const int e = cuda_internal::ForEachCompactLaunch(
        a, ranges, grad_scale,
        [&](const cuda_internal::AdamWConstants& c, const cuda_internal::CompactAdamWArgs& piece) {
          failed_n = piece.n;
          return cuda_internal::LaunchCompactAdamW(c, piece, stream);
        });
    return LaunchStatus(e, name_,
                        absl::StrCat("CompactAdamW (", offload::MasterFormName(a.master_form),
                                     " master, ", DTypeName(a.moment_dtype), " moments)"),
                        failed_n, a.grad_dtype);
  }

  absl::Status Synchronize(Stream stream) override {
    RETURN_IF_ERROR(Use());
    RETURN_IF_CUDA_ERROR(Cleared(cudaStreamSynchronize(AsStream(stream))), "(", name_, ")");
    return absl::OkStatus();
  }

  // Non-blocking: the engine orders its streams with events, never through the legacy default
  // stream's implicit synchronization.
  absl::StatusOr<Stream> CreateStream() override {
    RETURN_IF_ERROR(Use());
    cudaStream_t s = nullptr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)), "(",
                         name_, ": CreateStream)");
    return static_cast<Stream>(s);
  }

  void DestroyStream(Stream stream) override {
    if (stream != nullptr && Use().ok()) Cleared(cudaStreamDestroy(AsStream(stream)));
  }

  // Timing off: timed events cost a device-side timestamp write on every record.
  absl::StatusOr<Event> CreateEvent() override {
    RETURN_IF_ERROR(Use());
    cudaEvent_t e = nullptr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)), "(",
                         name_, ": CreateEvent)");
    return static_cast<Event>(e);
  }

  void DestroyEvent(Event event) override {
    if (event != nullptr && Use().ok()) Cleared(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  }

  absl::StatusOr<Event> CreateTimingEvent() override {
    RETURN_IF_ERROR(Use());
    cudaEvent_t e = nullptr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaEventCreate(&e)), "(", name_, ": CreateTimingEvent)");
    return static_cast<Event>(e);
  }

  absl::StatusOr<double> ElapsedMs(Event start, Event end) override {
    RETURN_IF_ERROR(Use());
    float ms = 0;
    const cudaError_t e = Cleared(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                                                       static_cast<cudaEvent_t>(end)));
    if (e == cudaErrorNotReady || e == cudaErrorInvalidResourceHandle) {
      // Not yet completed, or never recorded (the runtime's answers for the two cases).
      return absl::FailedPreconditionError(
          absl::StrCat(name_, ": ElapsedMs: an event has not completed or was never recorded (",
                       cudaGetErrorString(e), ")"));
    }
    RETURN_IF_CUDA_ERROR(e, "(", name_, ": ElapsedMs)");
    return static_cast<double>(ms);
  }

  absl::Status Record(Event event, Stream stream) override {
    RETURN_IF_ERROR(Use());
    RETURN_IF_CUDA_ERROR(
        Cleared(cudaEventRecord(static_cast<cudaEvent_t>(event), AsStream(stream))), "(", name_,
        ": Record)");
    return absl::OkStatus();
  }

  absl::Status Wait(Stream stream, Event event) override {
    RETURN_IF_ERROR(Use());
    RETURN_IF_CUDA_ERROR(
        Cleared(cudaStreamWaitEvent(AsStream(stream), static_cast<cudaEvent_t>(event), 0)), "(",
        name_, ": Wait)");
    return absl::OkStatus();
  }

  absl::Status WaitHost(Event event) override {
    RETURN_IF_ERROR(Use());
    RETURN_IF_CUDA_ERROR(Cleared(cudaEventSynchronize(static_cast<cudaEvent_t>(event))), "(",
                         name_, ": WaitHost)");
    return absl::OkStatus();
  }

 private:
  static cudaStream_t AsStream(Stream s) { return static_cast<cudaStream_t>(s); }

  // The current device is per host thread, and the engine's ranks may run on any thread.
  absl::Status Use() const {
    RETURN_IF_CUDA_ERROR(Cleared(cudaSetDevice(ordinal_)), "(", name_, ")");
    return absl::OkStatus();
  }

  absl::StatusOr<cudaMemoryType> TypeOf(const void* p, absl::string_view op) const {
    cudaPointerAttributes attr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaPointerGetAttributes(&attr, p)), "(", name_, ": ", op, ")");
    return attr.type;
  }

  absl::Status CheckAccessible(const void* p, absl::string_view op,
                               absl::string_view what) const {
    cudaPointerAttributes attr;
    RETURN_IF_CUDA_ERROR(Cleared(cudaPointerGetAttributes(&attr, p)), "(", name_, ": ", op, " ",
                         what, ")");
    if (attr.type == cudaMemoryTypeUnregistered && !pageable_access_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s: %s=%p is pageable host memory, which this GPU cannot access; use device or "
          "pinned memory (the device's kDevice / kPinnedHost allocators)",
          name_, op, what, p));
    }
    if (attr.type == cudaMemoryTypeDevice && attr.device != ordinal_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s: %s=%p is memory of cuda:%d, not of this device", name_, op, what, p,
          attr.device));
    }
    return absl::OkStatus();
  }

  const int ordinal_;
  const std::string name_;
  const bool pageable_access_;  // the GPU can dereference ordinary host pages (HMM / ATS)
  CudaAllocator device_alloc_;
};

}  // namespace

comm::InProcessBufferOps CudaInProcessBufferOps(int ordinal) {
  static_assert(static_cast<int>(comm::ReduceOp::kSum) == 0 &&
                    static_cast<int>(comm::ReduceOp::kAvg) == 1 &&
                    static_cast<int>(comm::ReduceOp::kMax) == 2,
                "LaunchReduceRankOrder numbers ops as comm::ReduceOp does");
  comm::InProcessBufferOps ops;
  ops.device_memory = true;
  ops.copy = [ordinal](void* dst, const void* src, size_t bytes) -> absl::Status {
    RETURN_IF_CUDA_ERROR(Cleared(cudaSetDevice(ordinal)), "(in-process copy)");
    RETURN_IF_CUDA_ERROR(Cleared(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                                 cudaStreamPerThread)),
                         "(in-process copy of ", bytes, " bytes)");
    RETURN_IF_CUDA_ERROR(Cleared(cudaStreamSynchronize(cudaStreamPerThread)),
                         "(in-process copy)");
    return absl::OkStatus();
  };
  ops.reduce = [ordinal](const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                         comm::ReduceOp op) -> absl::Status {
    if (n > cuda_internal::kMaxReduceSources) {
      return absl::InvalidArgumentError(absl::StrCat(
          "in-process reduction over ", n, " ranks on one GPU: at most ",
          cuda_internal::kMaxReduceSources, " are supported"));
    }
    RETURN_IF_CUDA_ERROR(Cleared(cudaSetDevice(ordinal)), "(in-process reduce)");
    RETURN_IF_CUDA_ERROR(
        Cleared(static_cast<cudaError_t>(cuda_internal::LaunchReduceRankOrder(
            srcs, n, dst, count, dtype, static_cast<int>(op), cudaStreamPerThread))),
        "(in-process reduce of ", count, " ", DTypeName(dtype), " over ", n, " ranks)");
    RETURN_IF_CUDA_ERROR(Cleared(cudaStreamSynchronize(cudaStreamPerThread)),
                         "(in-process reduce)");
    return absl::OkStatus();
  };
  return ops;
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int device_ordinal) {
  if (device_ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateCudaDevice: device_ordinal=", device_ordinal, " must be >= 0"));
  }
  int count = 0;
  if (cudaError_t e = Cleared(cudaGetDeviceCount(&count)); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device: cudaGetDeviceCount failed: ", cudaGetErrorName(e), ": ",
        cudaGetErrorString(e)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("no CUDA device: the driver reports 0 devices");
  }
  if (device_ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CreateCudaDevice: device_ordinal=",
                                                   device_ordinal, " but only ", count,
                                                   " CUDA device(s) are visible"));
  }
  const std::string name = absl::StrCat("cuda:", device_ordinal);
  RETURN_IF_CUDA_ERROR(Cleared(cudaSetDevice(device_ordinal)), "(", name, ")");
  cudaDeviceProp props;
  RETURN_IF_CUDA_ERROR(Cleared(cudaGetDeviceProperties(&props, device_ordinal)), "(", name, ")");
  if (props.major < 8) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, " (", props.name, ") has compute capability ", props.major, ".",
                     props.minor, "; zerort's kernels are built for 8.0 and newer"));
  }
  int pools = 0, pageable = 0;
  RETURN_IF_CUDA_ERROR(
      Cleared(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_ordinal)),
      "(", name, ")");
  if (!pools) {
    return absl::FailedPreconditionError(absl::StrCat(
        name, " (", props.name, ") has no stream-ordered allocator (cudaMallocAsync)"));
  }
  RETURN_IF_CUDA_ERROR(
      Cleared(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device_ordinal)),
      "(", name, ")");
  // SquaredNorm and AllFinite take a few bytes of scratch per call; by default the pool returns
  // freed memory to the driver at every synchronization, which would make each call a real
  // allocation. Keep what it has.
  cudaMemPool_t pool;
  RETURN_IF_CUDA_ERROR(Cleared(cudaDeviceGetDefaultMemPool(&pool, device_ordinal)), "(", name,
                       ")");
  uint64_t keep = UINT64_MAX;
  RETURN_IF_CUDA_ERROR(
      Cleared(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep)), "(", name,
      ")");
  // Device memory that Engine::Park can release: the driver's virtual memory management,
  // where the driver and the GPU have it (CudaAllocator).
  std::string no_vmm;
  const VmmDriver* vmm = VmmDriver::Get(&no_vmm);
  if (vmm != nullptr) {
    CUdevice cu_device = 0;
    int supported = 0;
    if (vmm->device_get(&cu_device, device_ordinal) != CUDA_SUCCESS ||
        vmm->device_attribute(&supported,
                              CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                              cu_device) != CUDA_SUCCESS ||
        supported == 0) {
      no_vmm = absl::StrCat(name, " (", props.name, ") does not support it");
      vmm = nullptr;
    }
  }
  return std::unique_ptr<Device>(
      new CudaDevice(device_ordinal, pageable != 0, vmm, std::move(no_vmm)));
}

}  // namespace zerort
