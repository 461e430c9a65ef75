#include "offload/pipeline.h"

#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "device/cpu_device.h"

namespace zerort {
namespace offload {
namespace {

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
      CpuDeviceOptions options;
      options.threads = 1;
      options.async_streams = true;
      options.stream_delay_us = 200;
      auto dev = CreateCpuDevice(options);
      const std::vector<int64_t> sizes = {40, 17, 64, 33, 8};
      std::vector<Unit> units, ref;
      std::vector<PipelineRegion> regions;
      for (size_t u = 0; u < sizes.size(); ++u) {
        units.push_back(MakeUnit(static_cast<int>(u), sizes[u]));
        ref.push_back(units.back());
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
      o.chunks = 2;  // fewer than the units: chunks are reused
      o.chunk_elements = 2 * 64;
      std::vector<uint16_t> staging(o.chunks * o.chunk_elements);
      o.staging = reinterpret_cast<char*>(staging.data());
      o.param_on_host = on_host;
      Device::Stream grads_stream = dev->CreateStream().value();
      auto pipeline = OffloadPipeline::Create(dev.get(), regions, o, grads_stream).value();
      REQUIRE(pipeline->GradFinal(0).ok());  // as backward would, before the step
      REQUIRE(pipeline->GradFinal(2).ok());  // not the next of the prefix: ignored
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
      REQUIRE(pipeline->AbandonDownloads().ok());
      pipeline.reset();
      dev->DestroyStream(grads_stream);
    }
  }
}

}  // namespace
}  // namespace offload
}  // namespace zerort
