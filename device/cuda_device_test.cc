// The CUDA device against the host reference, bit for bit.
//
// Two halves. "CudaMath" cases run everywhere: they compile the kernels' per-element arithmetic
// (device/internal/cuda_math.h) for the host and compare it with base/dtype.h, offload::CpuAdamW
// and offload::SquaredNormF32. "CudaDevice" cases need a GPU: each kernel on random inputs of
// awkward sizes against the CPU device. Without a GPU they print
// "SKIPPED: no CUDA device: <reason>" and pass.
#include "device/cuda_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "base/dtype.h"
#include "catch2/catch.hpp"
#include "memory/arena.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_kernels.h"
#include "device/testing/one_thread.h"
#include "device/internal/cuda_math.h"

namespace zerort {
namespace {

using cuda_internal::AdamWConstants;

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
// Around every boundary the kernels have: warps, 256-thread blocks, 1024-element norm blocks,
// the 1024-partial chunks of the in-order sum (2^20 + 3 elements = 1025 partials).
constexpr size_t kSizes[] = {1, 7, 31, 255, 1023, 1024, 1025, 8 * 1024 + 9, 100003,
                             (size_t{1} << 20) + 3};

// ------------------------------------------------------------------ host-side helpers

// Random values of every magnitude a gradient or weight may take, as fp32, then stored in
// `dtype` (so that the values are exactly representable there).
std::vector<char> RandomValues(DType dtype, size_t n, uint32_t seed, float lo_exp = -20,
                               float hi_exp = 4) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f), ex(lo_exp, hi_exp);
  std::vector<char> out(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) {
    float x = mant(rng) * std::exp2(std::floor(ex(rng)));
    if (rng() & 1) x = -x;
    if (rng() % 97 == 0) x = 0.0f;
    switch (dtype) {
      case DType::kF32:
        std::memcpy(out.data() + 4 * i, &x, 4);
        break;
      case DType::kBF16: {
        const uint16_t h = FloatToBf16(x);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t h = FloatToHalf(x);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
    }
  }
  return out;
}

// Arbitrary bit patterns: NaNs with payloads, infinities, subnormals, everything.
std::vector<char> RandomBits(size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> out(bytes);
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

uint32_t Bits(float f) { return FloatBits(f); }

AdamWConstants ConstantsOf(const offload::AdamWStepParams& p, float grad_scale) {
  return {p.beta1,        p.beta2, p.one_minus_beta1, p.one_minus_beta2, p.eps, -p.step_size,
          p.inv_sqrt_bias2, p.decay, grad_scale};
}

// ------------------------------------------------------------------ CudaMath (no GPU needed)

// One element through the kernels' LoadAs / StoreAs (what cuda_kernels.cu runs), host-compiled.
template <DType D>
float KernelLoad(uint16_t bits) {
  return LoadAs<D>(&bits, 0);
}
template <DType D>
uint16_t KernelStore(float f) {
  uint16_t bits = 0;
  StoreAs<D>(&bits, 0, f);
  return bits;
}

TEST_CASE("CudaMath: widening conversions equal base/dtype.h on all 65536 patterns", "[zero]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto b = static_cast<uint16_t>(h);
    REQUIRE(Bits(KernelLoad<DType::kBF16>(b)) == Bits(Bf16ToFloat(b)));
    REQUIRE(Bits(KernelLoad<DType::kF16>(b)) == Bits(HalfToFloat(b)));
  }
}

TEST_CASE("CudaMath: narrowing conversions equal base/dtype.h at every rounding boundary",
          "[zero]") {
  // For every half / bf16 pattern: the value itself, the exact midpoint to the next pattern
  // (a tie), and one fp32 ulp either side of that midpoint. Plus random fp32 bit patterns.
  std::vector<uint32_t> inputs;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t bf = h << 16;
    for (uint32_t low : {0u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) inputs.push_back(bf | low);
    const float x = HalfToFloat(static_cast<uint16_t>(h));
    const float next = HalfToFloat(static_cast<uint16_t>(h + 1));
    if (std::isfinite(x) && std::isfinite(next) && (h & 0x7fff) != 0x7bff) {
      const uint32_t mid = Bits((x + next) / 2);  // exact: halves have 11-bit significands
      for (uint32_t d : {mid - 1, mid, mid + 1}) inputs.push_back(d);
    }
    inputs.push_back(Bits(x));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) inputs.push_back(static_cast<uint32_t>(rng()));
  for (uint32_t u : inputs) {
    const float f = BitsToFloat(u);
    // Checked by hand first: a Catch2 message per input would dominate the run time.
    if (KernelStore<DType::kBF16>(f) == FloatToBf16(f) &&
        KernelStore<DType::kF16>(f) == FloatToHalf(f)) {
      continue;
    }
    INFO("fp32 bits 0x" << std::hex << u);
    REQUIRE(KernelStore<DType::kBF16>(f) == FloatToBf16(f));
    REQUIRE(KernelStore<DType::kF16>(f) == FloatToHalf(f));
  }
}

template <DType G, DType P, bool kOut>
void CheckAdamWElements(DType g, DType p, bool out) {
  if (g != G || p != P || out != kOut) return;
  const size_t n = 1037;
  const std::vector<char> grad = RandomValues(G, n, 11, -40, 6);
  std::vector<float> master(n), m(n), v(n);
  const std::vector<char> mv = RandomValues(DType::kF32, 3 * n, 12, -30, 2);
  std::memcpy(master.data(), mv.data(), 4 * n);
  std::memcpy(m.data(), mv.data() + 4 * n, 4 * n);
  std::memcpy(v.data(), mv.data() + 8 * n, 4 * n);
  for (float& x : v) x = std::fabs(x);  // a second moment is never negative
  std::vector<float> master2 = master, m2 = m, v2 = v;
  std::vector<char> out_ref(n * DTypeSize(P)), out_hd(n * DTypeSize(P));

  auto params = offload::MakeAdamWStepParams(3e-4, 0.9, 0.95, 1e-8, 0.1, 7);
  REQUIRE(params.ok());
  const float grad_scale = 1.0f / 1024;
  REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), G,
                             kOut ? out_ref.data() : nullptr, P, n},
                            *params, grad_scale, 1)
              .ok());
  const AdamWConstants c = ConstantsOf(*params, grad_scale);
  for (size_t i = 0; i < n; ++i) {
    cuda_internal::AdamWElement<G, P, kOut>(c, master2.data(), m2.data(), v2.data(), grad.data(),
                                            out_hd.data(), i);
  }
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(Bits(master2[i]) == Bits(master[i]));
    REQUIRE(Bits(m2[i]) == Bits(m[i]));
    REQUIRE(Bits(v2[i]) == Bits(v[i]));
  }
  if (kOut) REQUIRE(out_hd == out_ref);
}

template <DType G>
void CheckAdamWForGrad(DType g, DType p, bool out) {
  CheckAdamWElements<G, DType::kF32, false>(g, p, out);
  CheckAdamWElements<G, DType::kF32, true>(g, p, out);
  CheckAdamWElements<G, DType::kBF16, true>(g, p, out);
  CheckAdamWElements<G, DType::kF16, true>(g, p, out);
}

TEST_CASE("CudaMath: the AdamW element equals offload::CpuAdamW bitwise", "[zero]") {
  for (DType g : kDTypes) {
    for (DType p : kDTypes) {
      for (bool out : {false, true}) {
        if (!out && p != DType::kF32) continue;
        DYNAMIC_SECTION("grad " << DTypeName(g) << " param " << DTypeName(p) << " out " << out) {
          CheckAdamWForGrad<DType::kF32>(g, p, out);
          CheckAdamWForGrad<DType::kBF16>(g, p, out);
          CheckAdamWForGrad<DType::kF16>(g, p, out);
        }
      }
    }
  }
}

// The kernels' norm, replayed on the host: 8 lanes per block, the warp's xor-shuffle tree
// (each lane adds its partner's value: lane l sees acc[l] + acc[l ^ k]), then the in-order sum.
template <DType D>
float ReplayKernelNorm(const void* x, size_t n) {
  float total = 0.0f;
  for (size_t b = 0; b * offload::kNormBlock < n; ++b) {
    const size_t begin = b * offload::kNormBlock;
    const size_t end = std::min(n, begin + offload::kNormBlock);
    float acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = cuda_internal::NormLane<D>(x, begin, end, l);
    for (int k : {1, 2, 4}) {
      float next[8];
      for (int l = 0; l < 8; ++l) next[l] = cuda_internal::Add(acc[l], acc[l ^ k]);
      std::copy(next, next + 8, acc);
    }
    total = cuda_internal::Add(total, acc[0]);
  }
  return total;
}

TEST_CASE("CudaMath: the kernel's norm order equals SquaredNormF32 bitwise", "[zero]") {
  for (DType d : kDTypes) {
    for (size_t n : kSizes) {
      const std::vector<char> x = RandomValues(d, n, static_cast<uint32_t>(n), -12, 3);
      float replay = 0;
      switch (d) {
        case DType::kF32:
          replay = ReplayKernelNorm<DType::kF32>(x.data(), n);
          break;
        case DType::kBF16:
          replay = ReplayKernelNorm<DType::kBF16>(x.data(), n);
          break;
        case DType::kF16:
          replay = ReplayKernelNorm<DType::kF16>(x.data(), n);
          break;
      }
      INFO(DTypeName(d) << " n=" << n);
      REQUIRE(Bits(replay) == Bits(offload::SquaredNormF32(x.data(), d, n, 1)));
    }
  }
}

// ------------------------------------------------------------------ device creation

TEST_CASE("CudaDevice: creation either succeeds or says why", "[zero][gpu]") {
  const auto negative = CreateCudaDevice(-1);
  REQUIRE(negative.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(absl::StrContains(negative.status().message(), "device_ordinal=-1"));

  const auto first = CreateCudaDevice(0);
  if (first.ok()) {
    REQUIRE((*first)->name() == "cuda:0");
    const auto beyond = CreateCudaDevice(1 << 20);
    REQUIRE(beyond.status().code() == absl::StatusCode::kInvalidArgument);
  } else {
    REQUIRE(first.status().code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE(!first.status().message().empty());
  }
}

// ------------------------------------------------------------------ GPU cases

// The device, or nullptr after printing why the case is skipped.
Device* GpuOrSkip() {
  static absl::StatusOr<std::unique_ptr<Device>>* const gpu =
      new absl::StatusOr<std::unique_ptr<Device>>(CreateCudaDevice(0));
  if (gpu->ok()) return gpu->value().get();
  std::string reason(gpu->status().message());
  constexpr absl::string_view kPrefix = "no CUDA device: ";
  if (absl::StartsWith(reason, kPrefix)) reason.erase(0, kPrefix.size());
  WARN("SKIPPED: no CUDA device: " << reason);
  return nullptr;
}

// A buffer from one of the device's allocators, freed on scope exit.
memory::Allocation Alloc(Device* dev, memory::MemoryKind kind, size_t bytes) {
  auto a = memory::Allocation::Create(dev->allocator(kind), bytes);
  REQUIRE(a.ok());
  return std::move(*a);
}

std::unique_ptr<memory::Allocation> Upload(Device* dev, const std::vector<char>& host) {
  auto buf =
      std::make_unique<memory::Allocation>(Alloc(dev, memory::MemoryKind::kDevice, host.size()));
  REQUIRE(dev->Copy(buf->get(), host.data(), host.size(), nullptr).ok());
  return buf;
}

std::vector<char> Download(Device* dev, const void* src, size_t bytes) {
  std::vector<char> host(bytes);
  REQUIRE(dev->Copy(host.data(), src, bytes, nullptr).ok());
  REQUIRE(dev->Synchronize(nullptr).ok());
  return host;
}

TEST_CASE("CudaDevice: Cast equals the CPU device bitwise, NaN payloads included",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::OneThreadCpuDevice();
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      for (size_t n : kSizes) {
        INFO(DTypeName(s) << " -> " << DTypeName(d) << " n=" << n);
        const std::vector<char> src = RandomBits(n * DTypeSize(s), static_cast<uint32_t>(n));
        std::vector<char> want(n * DTypeSize(d));
        REQUIRE(cpu->Cast(src.data(), s, want.data(), d, n, nullptr).ok());
        auto dsrc = Upload(gpu, src);
        memory::Allocation ddst = Alloc(gpu, memory::MemoryKind::kDevice, want.size());
        REQUIRE(gpu->Cast(dsrc->get(), s, ddst.get(), d, n, nullptr).ok());
        REQUIRE(Download(gpu, ddst.get(), want.size()) == want);
      }
    }
  }
}

TEST_CASE("CudaDevice: Accumulate equals the CPU device bitwise", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::OneThreadCpuDevice();
  for (DType d : kDTypes) {
    for (size_t n : kSizes) {
      INFO(DTypeName(d) << " n=" << n);
      std::vector<char> acc = RandomValues(d, n, 100 + static_cast<uint32_t>(n), -14, 4);
      const std::vector<char> x = RandomValues(d, n, 200 + static_cast<uint32_t>(n), -14, 4);
      auto dacc = Upload(gpu, acc);
      auto dx = Upload(gpu, x);
      REQUIRE(cpu->Accumulate(acc.data(), x.data(), d, n, nullptr).ok());
      REQUIRE(gpu->Accumulate(dacc->get(), dx->get(), d, n, nullptr).ok());
      REQUIRE(Download(gpu, dacc->get(), acc.size()) == acc);
    }
  }
}

TEST_CASE("CudaDevice: SquaredNorm equals SquaredNormF32 bitwise", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  // Over 1024 blocks: the in-order sum then stages several chunks.
  std::vector<size_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.push_back(3000 * 1024 + 17);
  for (DType d : kDTypes) {
    for (size_t n : sizes) {
      INFO(DTypeName(d) << " n=" << n);
      const std::vector<char> x = RandomValues(d, n, 300 + static_cast<uint32_t>(n), -12, 3);
      auto dx = Upload(gpu, x);
      float got = -1;
      REQUIRE(gpu->SquaredNorm(dx->get(), d, n, &got, nullptr).ok());
      REQUIRE(gpu->Synchronize(nullptr).ok());
      REQUIRE(Bits(got) == Bits(offload::SquaredNormF32(x.data(), d, n, 1)));
    }
  }
  // A pinned destination: the copy is truly asynchronous, valid after Synchronize.
  memory::Allocation out = Alloc(gpu, memory::MemoryKind::kPinnedHost, sizeof(float));
  const std::vector<char> x = RandomValues(DType::kBF16, 77777, 5);
  auto dx = Upload(gpu, x);
  REQUIRE(gpu->SquaredNorm(dx->get(), DType::kBF16, 77777, out.as<float>(), nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
  REQUIRE(Bits(*out.as<float>()) ==
          Bits(offload::SquaredNormF32(x.data(), DType::kBF16, 77777, 1)));
}

TEST_CASE("CudaDevice: AllFinite finds one Inf or NaN anywhere", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  for (DType d : kDTypes) {
    for (size_t n : kSizes) {
      std::vector<char> x = RandomValues(d, n, 400 + static_cast<uint32_t>(n));
      auto dx = Upload(gpu, x);
      bool finite = false;
      REQUIRE(gpu->AllFinite(dx->get(), d, n, &finite, nullptr).ok());
      REQUIRE(gpu->Synchronize(nullptr).ok());
      REQUIRE(finite == offload::AllFinite(x.data(), d, n, 1));
      REQUIRE(finite);
      for (size_t pos : {size_t{0}, n / 2, n - 1}) {
        for (float bad : {std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()}) {
          INFO(DTypeName(d) << " n=" << n << " pos=" << pos << " value=" << bad);
          std::vector<char> y = x;
          if (d == DType::kF32) {
            std::memcpy(y.data() + 4 * pos, &bad, 4);
          } else {
            const uint16_t h = d == DType::kBF16 ? FloatToBf16(bad) : FloatToHalf(bad);
            std::memcpy(y.data() + 2 * pos, &h, 2);
          }
          auto dy = Upload(gpu, y);
          bool f = true;
          REQUIRE(gpu->AllFinite(dy->get(), d, n, &f, nullptr).ok());
          REQUIRE(gpu->Synchronize(nullptr).ok());
          REQUIRE(f == offload::AllFinite(y.data(), d, n, 1));
          REQUIRE(!f);
        }
      }
    }
  }
}

// Runs `steps` AdamW steps on the GPU and with CpuAdamW from the same state; compares every
// array bitwise after each step.
void CheckAdamWSteps(Device* gpu, DType g, DType p, bool out, bool alias_master, size_t n) {
  INFO("grad " << DTypeName(g) << " param " << DTypeName(p) << " out " << out << " alias "
               << alias_master << " n=" << n);
  const std::vector<char> init = RandomValues(DType::kF32, 3 * n, 21 + static_cast<uint32_t>(n),
                                              -12, 1);
  std::vector<float> master(n), m(n), v(n);
  std::memcpy(master.data(), init.data(), 4 * n);
  std::memcpy(m.data(), init.data() + 4 * n, 4 * n);
  std::memcpy(v.data(), init.data() + 8 * n, 4 * n);
  for (float& x : v) x = std::fabs(x);
  std::vector<char> param(n * DTypeSize(p));
  auto dmaster = Upload(gpu, std::vector<char>(init.begin(), init.begin() + 4 * n));
  auto dm = Upload(gpu, std::vector<char>(init.begin() + 4 * n, init.begin() + 8 * n));
  std::vector<char> vbytes(4 * n);
  std::memcpy(vbytes.data(), v.data(), 4 * n);
  auto dv = Upload(gpu, vbytes);
  memory::Allocation dparam = Alloc(gpu, memory::MemoryKind::kDevice, param.size());
  memory::Allocation dgrad = Alloc(gpu, memory::MemoryKind::kDevice, n * DTypeSize(g));
  for (int step = 1; step <= 3; ++step) {
    const std::vector<char> grad = RandomValues(g, n, 1000 * step + static_cast<uint32_t>(n),
                                                -30, 8);
    REQUIRE(gpu->Copy(dgrad.get(), grad.data(), grad.size(), nullptr).ok());
    auto params = offload::MakeAdamWStepParams(1e-3 * step, 0.9, 0.999, 1e-8, 0.01, step);
    REQUIRE(params.ok());
    const float grad_scale = 1.0f / static_cast<float>(1 << (4 * step));
    void* cpu_out = out ? (alias_master ? static_cast<void*>(master.data()) : param.data())
                        : nullptr;
    void* gpu_out = out ? (alias_master ? dmaster->get() : dparam.get()) : nullptr;
    REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), g, cpu_out, p, n},
                              *params, grad_scale, 1)
                .ok());
    REQUIRE(gpu->AdamW({dmaster->as<float>(), dm->as<float>(), dv->as<float>(), dgrad.get(), g,
                        gpu_out, p, n},
                       *params, grad_scale, nullptr)
                .ok());
    INFO("step " << step);
    auto bytes_of = [&](const std::vector<float>& f) {
      std::vector<char> b(4 * f.size());
      std::memcpy(b.data(), f.data(), b.size());
      return b;
    };
    REQUIRE(Download(gpu, dmaster->get(), 4 * n) == bytes_of(master));
    REQUIRE(Download(gpu, dm->get(), 4 * n) == bytes_of(m));
    REQUIRE(Download(gpu, dv->get(), 4 * n) == bytes_of(v));
    if (out && !alias_master) REQUIRE(Download(gpu, dparam.get(), param.size()) == param);
  }
}

TEST_CASE("CudaDevice: AdamW over per-range constants equals CpuAdamW's ranges bitwise",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 10007;
  const size_t cuts[] = {0, 5, 5, 3000, 3001, n};
  std::vector<offload::AdamWRange> ranges;
  for (int k = 0; k < 5; ++k) {
    auto p = offload::MakeAdamWStepParams(1e-3 * (k + 1), 0.9, 0.95, 1e-8, 0.1 * (k % 2), 1);
    REQUIRE(p.ok());
    ranges.push_back({cuts[k], cuts[k + 1], *p});
  }
  const std::vector<char> init = RandomValues(DType::kF32, 2 * n, 5, -12, 1);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  std::memcpy(master.data(), init.data(), 4 * n);
  const std::vector<char> grad = RandomValues(DType::kBF16, n, 6, -30, 8);
  std::vector<char> param(2 * n);
  auto dmaster = Upload(gpu, std::vector<char>(init.begin(), init.begin() + 4 * n));
  auto dm = Upload(gpu, std::vector<char>(4 * n, 0));
  auto dv = Upload(gpu, std::vector<char>(4 * n, 0));
  auto dgrad = Upload(gpu, grad);
  memory::Allocation dparam = Alloc(gpu, memory::MemoryKind::kDevice, param.size());
  REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), DType::kBF16,
                             param.data(), DType::kBF16, n},
                            ranges, 0.5f, 1)
              .ok());
  REQUIRE(gpu->AdamWRanges({dmaster->as<float>(), dm->as<float>(), dv->as<float>(),
                            dgrad->get(), DType::kBF16, dparam.get(), DType::kBF16, n},
                           ranges, 0.5f, nullptr)
              .ok());
  std::vector<char> want(4 * n);
  std::memcpy(want.data(), master.data(), want.size());
  CHECK(Download(gpu, dmaster->get(), 4 * n) == want);
  CHECK(Download(gpu, dparam.get(), param.size()) == param);
}

TEST_CASE("CudaDevice: AdamW equals CpuAdamW bitwise over three steps", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  for (size_t n : {size_t{1}, size_t{1023}, size_t{100003}}) {
    for (DType g : kDTypes) {
      CheckAdamWSteps(gpu, g, DType::kF32, /*out=*/false, false, n);
      for (DType p : kDTypes) CheckAdamWSteps(gpu, g, p, /*out=*/true, false, n);
    }
    CheckAdamWSteps(gpu, DType::kF32, DType::kF32, /*out=*/true, /*alias_master=*/true, n);
  }
}

TEST_CASE("CudaDevice: allocators, Copy and Zero across device, pinned and pageable memory",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  REQUIRE(gpu->allocator(memory::MemoryKind::kPageableHost) == memory::HostAllocator());
  for (memory::MemoryKind kind : {memory::MemoryKind::kDevice, memory::MemoryKind::kPinnedHost,
                                  memory::MemoryKind::kPageableHost}) {
    for (size_t bytes : {size_t{1}, size_t{4095}, size_t{1} << 20, (size_t{1} << 24) + 13}) {
      INFO("kind " << static_cast<int>(kind) << " bytes " << bytes);
      memory::Allocation a = Alloc(gpu, kind, bytes);
      memory::Allocation b = Alloc(gpu, memory::MemoryKind::kDevice, bytes);
      REQUIRE(reinterpret_cast<uintptr_t>(a.get()) % 4096 == 0);
      const std::vector<char> pattern = RandomBits(bytes, static_cast<uint32_t>(bytes));
      REQUIRE(gpu->Copy(a.get(), pattern.data(), bytes, nullptr).ok());
      REQUIRE(gpu->Copy(b.get(), a.get(), bytes, nullptr).ok());
      REQUIRE(Download(gpu, b.get(), bytes) == pattern);
      REQUIRE(gpu->Zero(a.get(), bytes, nullptr).ok());
      REQUIRE(Download(gpu, a.get(), bytes) == std::vector<char>(bytes, 0));
    }
  }
  REQUIRE(gpu->allocator(memory::MemoryKind::kDevice)->Allocate(0).value() == nullptr);
  // More than any GPU has: ResourceExhausted, and the device keeps working afterwards.
  const auto huge = gpu->allocator(memory::MemoryKind::kDevice)->Allocate(size_t{1} << 50);
  REQUIRE(huge.status().code() == absl::StatusCode::kResourceExhausted);
  memory::Allocation c = Alloc(gpu, memory::MemoryKind::kDevice, 4096);
  REQUIRE(gpu->Zero(c.get(), 4096, nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
}

TEST_CASE("CudaDevice: kernels accept pinned memory and refuse inaccessible pageable memory",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 5000;
  const std::vector<char> x = RandomValues(DType::kF32, n, 9);
  memory::Allocation pinned = Alloc(gpu, memory::MemoryKind::kPinnedHost, 4 * n);
  std::memcpy(pinned.get(), x.data(), 4 * n);
  float got = -1;
  REQUIRE(gpu->SquaredNorm(pinned.get(), DType::kF32, n, &got, nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
  REQUIRE(Bits(got) == Bits(offload::SquaredNormF32(x.data(), DType::kF32, n, 1)));

  int pageable = 0;
  REQUIRE(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0) == cudaSuccess);
  const absl::Status s = gpu->SquaredNorm(x.data(), DType::kF32, n, &got, nullptr);
  if (pageable) {
    REQUIRE(s.ok());
  } else {
    REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(absl::StrContains(s.message(), "SquaredNorm"));
  }
  REQUIRE(gpu->Synchronize(nullptr).ok());
}

TEST_CASE("CudaDevice: two threads on two streams each get the CPU result", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 300007;
  // Buffers come from the main thread: Catch2's assertions are not thread-safe.
  memory::Allocation dx0 = Alloc(gpu, memory::MemoryKind::kDevice, 2 * n);
  memory::Allocation dx1 = Alloc(gpu, memory::MemoryKind::kDevice, 2 * n);
  memory::Allocation dy0 = Alloc(gpu, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation dy1 = Alloc(gpu, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation* dx[2] = {&dx0, &dx1};
  memory::Allocation* dy[2] = {&dy0, &dy1};
  auto work = [&](int t, cudaStream_t stream, float* norm, bool* ok) {
    const std::vector<char> x = RandomValues(DType::kBF16, n, 77 + t);
    *ok = gpu->Copy(dx[t]->get(), x.data(), x.size(), stream).ok() &&
          gpu->Cast(dx[t]->get(), DType::kBF16, dy[t]->get(), DType::kF32, n, stream).ok() &&
          gpu->SquaredNorm(dy[t]->get(), DType::kF32, n, norm, stream).ok() &&
          gpu->Synchronize(stream).ok();
  };
  cudaStream_t streams[2];
  for (cudaStream_t& s : streams) REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  float norms[2] = {-1, -1};
  bool oks[2] = {false, false};
  std::thread a(work, 0, streams[0], &norms[0], &oks[0]);
  std::thread b(work, 1, streams[1], &norms[1], &oks[1]);
  a.join();
  b.join();
  for (cudaStream_t s : streams) REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  for (int t = 0; t < 2; ++t) {
    REQUIRE(oks[t]);
    const std::vector<char> x = RandomValues(DType::kBF16, n, 77 + t);
    std::vector<float> widened(n);
    offload::Cast(x.data(), DType::kBF16, widened.data(), DType::kF32, n, 1);
    REQUIRE(Bits(norms[t]) == Bits(offload::SquaredNormF32(widened.data(), DType::kF32, n, 1)));
  }
}

}  // namespace
}  // namespace zerort
