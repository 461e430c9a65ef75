#include "offload/pipeline.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "base/testing/temp_dir.h"
#include "device/testing/one_thread.h"
#include "nvme/io.h"
#include "nvme/state.h"

namespace zerort {
namespace offload {
namespace {

using nvme::AioEngine;
using nvme::AioOptions;
using nvme::IoBuffer;
using nvme::IoOp;
using nvme::NvmeState;
using nvme::SwapDir;

struct Unit {
  std::vector<uint16_t> grad, param;  // bf16 bits
  std::vector<float> master, m, v;
};

Unit MakeUnit(int u, int64_t n) {
  Unit x;
  for (int64_t i = 0; i < n; ++i) {
    x.grad.push_back(FloatToBf16(0.01f * static_cast<float>((i * 7 + u) % 13) - 0.05f));
    x.master.push_back(0.1f * u + 0.001f * static_cast<float>(i));
    x.m.push_back(0.0001f * static_cast<float>(i % 5));
    x.v.push_back(0.00001f * static_cast<float>(i % 3));
    x.param.push_back(0);
  }
  return x;
}

TEST_CASE("OffloadPipeline: equals a plain host AdamW per unit, gathering each after upload",
          "[offload]") {
  for (bool on_host : {false, true}) {
    DYNAMIC_SECTION((on_host ? "param on host" : "param on device")) {
      // Asynchronous streams with a 200 us delay: a missing wait gives wrong values.
      auto dev = testing::AsyncOneThreadCpuDevice(200);
      const std::vector<int64_t> sizes = {40, 17, 64, 33, 8};
      std::vector<Unit> units, ref;
      std::vector<PipelineRegion> regions;
      for (size_t u = 0; u < sizes.size(); ++u) {
        units.push_back(MakeUnit(static_cast<int>(u), sizes[u]));
        ref.push_back(units.back());
      }
      // The host gradients start as garbage: the copies below (gradient offload's, enqueued on
      // the gradients' stream) must land before AdamW reads them.
      std::vector<std::vector<uint16_t>> device_grads;
      for (Unit& x : units) {
        device_grads.push_back(x.grad);
        std::fill(x.grad.begin(), x.grad.end(), FloatToBf16(1e6f));
      }
      for (Unit& x : units) {
        regions.push_back({x.grad.data(), x.master.data(), x.m.data(), x.v.data(),
                           x.param.data(), static_cast<int64_t>(x.grad.size())});
      }
      const AdamWStepParams params = MakeAdamWStepParams(1e-2, 0.9, 0.95, 1e-8, 0.1, 3).value();
      const float grad_scale = 0.5f;
      for (Unit& x : ref) {  // the reference: one CpuAdamW per unit
        AdamWArrays a{x.master.data(), x.m.data(), x.v.data(), x.grad.data(), DType::kBF16,
                      x.param.data(), DType::kBF16, x.grad.size()};
        REQUIRE(CpuAdamW(a, params, grad_scale, 1).ok());
      }
      PipelineOptions o;
      o.dtype = DType::kBF16;
      // Fewer chunks than units: chunks are reused. With the parameters on the host none is
      // needed: AdamW writes them in place.
      o.chunks = on_host ? 0 : 2;
      o.chunk_elements = on_host ? 0 : 64;
      std::vector<uint16_t> staging(o.chunks * o.chunk_elements);
      o.staging = on_host ? nullptr : reinterpret_cast<char*>(staging.data());
      o.param_on_host = on_host;
      Device::Stream grads_stream = dev->CreateStream().value();
      auto pipeline = OffloadPipeline::Create(dev.get(), regions, o, grads_stream).value();
      for (size_t u = 0; u < units.size(); ++u) {  // as backward would, before the step
        REQUIRE(dev->Copy(units[u].grad.data(), device_grads[u].data(),
                          device_grads[u].size() * 2, grads_stream).ok());
      }
      std::vector<int> gathered;
      bool params_landed = true;
      OffloadPipeline::Hooks hooks;
      hooks.before_gather = [&](Device::Event e) { return dev->WaitHost(e); };
      hooks.gather = [&](int u) {
        gathered.push_back(u);
        params_landed = params_landed && units[u].param == ref[u].param;
        return absl::OkStatus();
      };
      auto times = pipeline->Update(params, grad_scale, hooks);
      REQUIRE(times.ok());
      REQUIRE(units[0].grad == device_grads[0]);
      REQUIRE(pipeline->JoinUploads(grads_stream).ok());
      REQUIRE(dev->Synchronize(grads_stream).ok());
      REQUIRE(params_landed);
      REQUIRE(gathered == std::vector<int>({0, 1, 2, 3, 4}));
      for (size_t u = 0; u < units.size(); ++u) {
        REQUIRE(units[u].master == ref[u].master);
        REQUIRE(units[u].m == ref[u].m);
        REQUIRE(units[u].v == ref[u].v);
        REQUIRE(units[u].param == ref[u].param);
      }
      pipeline.reset();
      dev->DestroyStream(grads_stream);
    }
  }
}

// The host arrays of one pipeline (CPU offload), or the same with master, m, v in a swap file.
struct Rig {
  std::vector<Unit> units;
  std::vector<uint16_t> staging;
  std::unique_ptr<OffloadPipeline> pipeline;
};

Rig MakeRig(Device* dev, Device::Stream grads_stream, const std::vector<int64_t>& sizes,
            NvmeState* nvme) {
  Rig rig;
  std::vector<PipelineRegion> regions;
  for (size_t u = 0; u < sizes.size(); ++u) rig.units.push_back(MakeUnit(static_cast<int>(u), sizes[u]));
  for (Unit& x : rig.units) {
    const bool host = nvme == nullptr;
    regions.push_back({x.grad.data(), host ? x.master.data() : nullptr, host ? x.m.data() : nullptr,
                       host ? x.v.data() : nullptr, x.param.data(),
                       static_cast<int64_t>(x.grad.size())});
  }
  PipelineOptions o;
  o.dtype = DType::kBF16;
  o.chunks = 2;
  o.chunk_elements = 1500;
  rig.staging.resize(o.chunks * o.chunk_elements);
  o.staging = reinterpret_cast<char*>(rig.staging.data());
  o.nvme = nvme;
  rig.pipeline = OffloadPipeline::Create(dev, regions, o, grads_stream).value();
  return rig;
}

absl::Status Step(Rig* rig, Device* dev, Device::Stream s, int t) {
  const AdamWStepParams params = MakeAdamWStepParams(1e-2, 0.9, 0.95, 1e-8, 0.1, t).value();
  OffloadPipeline::Hooks hooks;
  hooks.before_gather = [&](Device::Event e) { return dev->WaitHost(e); };
  hooks.gather = [](int) { return absl::OkStatus(); };
  absl::Status st = rig->pipeline->Update(params, 0.5f, hooks).status();
  if (!st.ok()) return st;
  if (absl::Status j = rig->pipeline->JoinUploads(s); !j.ok()) return j;
  return dev->Synchronize(s);
}

// Master, m, v of every unit as NvmeState holds them (its current copy).
std::vector<Unit> LoadAll(NvmeState* nvme, const std::vector<Unit>& like) {
  std::vector<Unit> out = like;
  for (size_t u = 0; u < out.size(); ++u) {
    REQUIRE(nvme->Load(static_cast<int>(u), out[u].master.data(), out[u].m.data(),
                       out[u].v.data()).ok());
  }
  return out;
}

void RequireSameState(const std::vector<Unit>& a, const std::vector<Unit>& b, bool params) {
  for (size_t u = 0; u < a.size(); ++u) {
    REQUIRE(a[u].master == b[u].master);
    REQUIRE(a[u].m == b[u].m);
    REQUIRE(a[u].v == b[u].v);
    if (params) REQUIRE(a[u].param == b[u].param);
  }
}

TEST_CASE("OffloadPipeline: NVMe-resident state equals CPU offload bitwise, faults leave the "
          "previous step's state", "[offload][nvme]") {
  // Whole units, and pieces of 1024 elements (unit 2 then streams in two pieces).
  const int64_t piece = GENERATE(0, 1024);
  INFO("piece_elements " << piece);
  auto dev = testing::AsyncOneThreadCpuDevice(100);
  Device::Stream s = dev->CreateStream().value();
  // 1500 elements: 6000 bytes, two 4 KiB blocks per array (one padded).
  const std::vector<int64_t> sizes = {40, 17, 1500, 33, 8};
  auto dir = SwapDir::Create(testing::TestTmpDir(), "pipeline", 0).value();
  auto file = dir->CreateFile("optimizer_state", NvmeState::FileBytes(sizes, piece)).value();
  // 1: fail unit 2's write (EIO); 2: a short read of one 4 KiB block. The hook runs on both
  // I/O threads at once: exactly one read may take the short-read fault, and the offset it
  // names is written under a lock.
  std::atomic<int> armed{0};
  absl::Mutex faulted_mu;
  std::string faulted;
  AioOptions aio;
  aio.block_size = 4096;
  aio.queue_depth = 2;
  aio.thread_count = 2;
  aio.fault = [&](IoOp op, const std::string& path, int64_t offset,
                  int64_t bytes) -> std::optional<int> {
    // Unit 2 starts 6 blocks into a copy (units 0 and 1: one block per array); this is its m
    // (whole unit) or its first piece's v.
    const int64_t copy = NvmeState::FileBytes(sizes, piece) / 2;
    if (armed == 1 && op == IoOp::kWrite && offset % copy == 6 * 4096 + 8192) {
      absl::MutexLock lock(&faulted_mu);
      faulted = path + " at offset " + std::to_string(offset);
      return -EIO;
    }
    int short_read = 2;
    if (op == IoOp::kRead && armed.compare_exchange_strong(short_read, 0)) {
      absl::MutexLock lock(&faulted_mu);
      faulted = path + " at offset " + std::to_string(offset);
      return static_cast<int>(bytes / 2);
    }
    return std::nullopt;
  };
  auto io = AioEngine::Create(aio).value();
  const int64_t slot = NvmeState::SlotBytes(sizes, piece);
  CHECK(slot == (piece == 0 ? 3 * 8192 : 3 * 4096));
  auto slots = IoBuffer::Allocate(NvmeState::kSlots * slot).value();
  auto nvme = NvmeState::Create(io.get(), file.get(), sizes, piece, slots.data(), slot).value();
  CHECK(nvme->pieces().size() == (piece == 0 ? 5u : 6u));

  Rig cpu = MakeRig(dev.get(), s, sizes, nullptr);
  Rig disk = MakeRig(dev.get(), s, sizes, nvme.get());
  for (size_t u = 0; u < sizes.size(); ++u) {  // the initial state, as the engine stores it
    const Unit& x = cpu.units[u];
    REQUIRE(nvme->Store(static_cast<int>(u), x.master.data(), x.m.data(), x.v.data()).ok());
  }
  RequireSameState(LoadAll(nvme.get(), cpu.units), cpu.units, false);
  for (int t = 1; t <= 4; ++t) {
    const std::vector<Unit> before = cpu.units;
    REQUIRE(Step(&cpu, dev.get(), s, t).ok());
    if (t == 2 || t == 3) {  // the first attempt fails, names the file and the offset
      armed = t == 2 ? 1 : 2;
      const absl::Status st = Step(&disk, dev.get(), s, t);
      armed = 0;
      INFO(st.ToString());
      REQUIRE_FALSE(st.ok());
      std::string want;
      {
        absl::MutexLock lock(&faulted_mu);
        want = faulted;
      }
      CHECK(st.message().find(want) != absl::string_view::npos);
      CHECK(st.message().find(t == 2 ? "Input/output error" : "short nvme read") !=
            absl::string_view::npos);
      RequireSameState(LoadAll(nvme.get(), before), before, false);  // not half-updated
    }
    REQUIRE(Step(&disk, dev.get(), s, t).ok());  // the retry equals a fault-free step
    std::vector<Unit> got = LoadAll(nvme.get(), cpu.units);
    for (size_t u = 0; u < got.size(); ++u) got[u].param = disk.units[u].param;
    RequireSameState(got, cpu.units, true);
  }
  disk.pipeline.reset();
  cpu.pipeline.reset();
  dev->DestroyStream(s);
}

}  // namespace
}  // namespace offload
}  // namespace zerort
