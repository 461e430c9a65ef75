#include "zero/cpu_device.h"

#include <cstring>

#include "offload/cpu_kernels.h"

namespace zerort {
namespace {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int threads) : threads_(threads) {}

  absl::string_view name() const override { return "cpu"; }

  memory::RawAllocator* allocator(memory::MemoryKind) override { return memory::HostAllocator(); }

  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream) override {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status Zero(void* dst, size_t bytes, Stream) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }

  absl::Status Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
                    Stream) override {
    offload::Cast(src, src_dtype, dst, dst_dtype, n, threads_);
    return absl::OkStatus();
  }

  absl::Status Accumulate(void* acc, const void* x, DType dtype, size_t n, Stream) override {
    switch (dtype) {
      case DType::kF32: {
        float* a = static_cast<float*>(acc);
        const float* b = static_cast<const float*>(x);
        for (size_t i = 0; i < n; ++i) a[i] += b[i];
        break;
      }
      case DType::kBF16: {
        uint16_t* a = static_cast<uint16_t*>(acc);
        const uint16_t* b = static_cast<const uint16_t*>(x);
        for (size_t i = 0; i < n; ++i) a[i] = FloatToBf16(Bf16ToFloat(a[i]) + Bf16ToFloat(b[i]));
        break;
      }
      case DType::kF16: {
        uint16_t* a = static_cast<uint16_t*>(acc);
        const uint16_t* b = static_cast<const uint16_t*>(x);
        for (size_t i = 0; i < n; ++i) a[i] = FloatToHalf(HalfToFloat(a[i]) + HalfToFloat(b[i]));
        break;
      }
    }
    return absl::OkStatus();
  }

  absl::Status SquaredNorm(const void* x, DType dtype, size_t n, float* out, Stream) override {
    *out = offload::SquaredNormF32(x, dtype, n, threads_);
    return absl::OkStatus();
  }

  absl::Status AllFinite(const void* x, DType dtype, size_t n, bool* out, Stream) override {
    *out = offload::AllFinite(x, dtype, n, threads_);
    return absl::OkStatus();
  }

  absl::Status AdamW(const offload::AdamWArrays& arrays, const offload::AdamWStepParams& params,
                     float grad_scale, Stream) override {
    return offload::CpuAdamW(arrays, params, grad_scale, threads_);
  }

  absl::Status Synchronize(Stream) override { return absl::OkStatus(); }

 private:
  const int threads_;
};

}  // namespace

std::unique_ptr<Device> CreateCpuDevice(int threads) {
  return std::make_unique<CpuDevice>(threads);
}

}  // namespace zerort
