// Gradients the trainer keeps in its own buffer, declared before the plan
// (memory::ParamSpec::grad_buffer): units reduced straight from it have no gradient storage of
// the engine's, and training is bitwise the training through the engine's own buffers.
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"

#include "base/dtype.h"
#include "base/status.h"
#include "comm/testing/on_ranks.h"
#include "comm/testing/stream_ordered.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/testing/handoff_trainer.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::HandoffRun;
using testing::MiniLlmc;
using Run = HandoffRun;

// Every rank's Run, each rank on a thread of its own. `async`: each rank's compute stream is a
// stream of `device` (with AsyncOneThreadCpuDevice, a delayed worker thread), and at a
// power-of-two world the ranks are a stream-ordered group, whose collectives and their
// follow-up run on the engine's comm stream as NCCL's do; else the in-process group and the
// calling thread.
std::vector<Run> TrainRanks(const Config& c, int world, bool declared, bool forward_order,
                            Device* device, bool async = false) {
  std::vector<Run> out(world);
  std::vector<absl::Status> st(world);
  auto rank = [&](int r, comm::Communicator* comm) {
    Device::Stream s = async ? device->CreateStream().value() : nullptr;
    absl::StatusOr<Run> run =
        testing::TrainHandoffRank(c, declared, forward_order, comm, device, 3, s);
    if (s != nullptr) {
      (void)device->Synchronize(s);
      device->DestroyStream(s);
    }
    st[r] = run.status();
    if (run.ok()) out[r] = *std::move(run);
  };
  if (async && (world & (world - 1)) == 0) {
    auto comms = comm::testing::CreateStreamOrderedGroup(world, device, {c.comm_timeout_ms});
    REQUIRE(comms.ok());
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) threads.emplace_back(rank, r, (*comms)[r].get());
    for (std::thread& t : threads) t.join();
  } else {
    comm::testing::OnRanks(world, {c.comm_timeout_ms},
                           [&](int r, comm::Communicator* comm) -> absl::Status {
                             rank(r, comm);
                             return absl::OkStatus();
                           });
  }
  for (int r = 0; r < world; ++r) REQUIRE(st[r].ToString() == "OK");
  return out;
}

TEST_CASE("Engine: gradients reduced in place in the trainer's declared buffer train bitwise "
          "as the engine's buffers, with less gradient memory",
          "[engine]") {
  for (const bool async : {false, true}) {
    // Asynchronous streams, each operation 200 us late, and (worlds 1 and 2) a stream-ordered
    // group: a missing order between the trainer's writes, the padding's zero-fill on the comm
    // stream, the reductions and the next micro-step's writes shows as a wrong result.
    auto device = async ? testing::AsyncOneThreadCpuDevice(200) : testing::OneThreadCpuDevice();
    for (int stage : {0, 1, 2, 3}) {
      for (int world : {1, 2, 3}) {
        for (int gas : {1, 2}) {
          CAPTURE(async, stage, world, gas);
          Config c = testing::TestConfig(stage, DType::kBF16, gas, /*clip=*/0.05, false);
          c.zero.reduce_bucket_size = kAutoSize;  // a unit per module (tensor)
          // Stage 0 without accumulation keeps the whole reduced unit in the trainer's buffer:
          // only units without padding are in place there.
          const bool results_there = stage == 0 && gas == 1;
          const std::vector<Run> engine = TrainRanks(c, world, false, false, device.get());
          const std::vector<Run> backward =
              TrainRanks(c, world, true, false, device.get(), async);
          const std::vector<Run> forward = TrainRanks(c, world, true, true, device.get(), async);
          for (int r = 0; r < world; ++r) {
            CHECK(backward[r].master == engine[r].master);  // bitwise: no NaN here
            CHECK(forward[r].master == engine[r].master);
            for (const Run* run : {&engine[r], &backward[r], &forward[r]}) {
              for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
                CHECK(run->report.allocated[k] == run->report.planned[k]);
              }
            }
            // The last tensors' padding would run past the buffer: they are copied. The
            // embedding's lies over wpe's and the next gradients.
            CHECK(backward[r].in_place >= 1);
            CHECK(backward[r].in_place <= 15);
            CHECK(backward[r].wte_in_place == !results_there);
            const MemoryReport& m = backward[r].report;
            CHECK(m.trainer_grad_bytes == 2128 * 2);
            CHECK(m.trainer_grad_in_place_bytes + m.trainer_grad_copied_bytes ==
                  m.trainer_grad_bytes);
            CHECK(m.engine_grad_bytes <= engine[r].report.engine_grad_bytes);
            // At world 3 fcprojw's 256 padding elements would run past the buffer's end: a
            // unit of its size class is copied, and stages 2-3 keep both of its buckets.
            if (stage <= 1 || world < 3) {
              CHECK(m.engine_grad_bytes < engine[r].report.engine_grad_bytes);
            }
            CHECK(engine[r].report.trainer_grad_bytes == 0);
            // Backward order: each unit is reduced at its own GradReady.
            std::vector<int> each(16);
            std::iota(each.begin(), each.end(), 1);
            CHECK(backward[r].reduced == each);
            CHECK(engine[r].reduced == each);
            // Registration order: the embedding's padding lies over wpe's gradient, so its
            // reduction waits; at the end every unit is reduced.
            CHECK(forward[r].reduced.front() == (results_there ? 1 : 0));
            CHECK(forward[r].reduced.back() == 16);
          }
        }
      }
    }
  }
}

TEST_CASE("Engine: trainer buffers in place with fp32 accumulation and reduction, and merged "
          "units",
          "[engine]") {
  auto device = testing::OneThreadCpuDevice();
  for (int stage : {0, 1, 2, 3}) {
    for (int gas : {1, 2}) {
      for (const bool merged : {false, true}) {
        CAPTURE(stage, gas, merged);
        Config c = testing::TestConfig(stage, DType::kBF16, gas, /*clip=*/0.05, false);
        c.grad_accum_dtype = c.communication_dtype = DType::kF32;
        // A written reduce_bucket_size merges small modules, last registered first: their
        // tensors then lie in the unit in the opposite order to the trainer's buffer.
        c.zero.reduce_bucket_size = merged ? 200 : kAutoSize;
        const std::vector<Run> engine = TrainRanks(c, 2, false, false, device.get());
        const std::vector<Run> handed = TrainRanks(c, 2, true, true, device.get());
        for (int r = 0; r < 2; ++r) {
          CHECK(handed[r].master == engine[r].master);
          CHECK(handed[r].in_place > 0);
          CHECK(handed[r].report.engine_grad_bytes < engine[r].report.engine_grad_bytes);
        }
      }
    }
  }
}

TEST_CASE("Engine: trainer buffers in place with optimizer offload, local accumulation and "
          "HSDP",
          "[engine]") {
  auto device = testing::OneThreadCpuDevice();
  struct Case {
    int stage, world, gas;
    bool offload, local;
    int mics;
    double ratio = 1.0;  // offload_optimizer.ratio: < 1 keeps some units on the device
  };
  for (const Case& k : std::vector<Case>{{1, 2, 1, true, false, -1},
                                         {2, 2, 2, true, false, -1},
                                         {3, 3, 2, true, false, -1},
                                         {0, 2, 3, false, true, -1},
                                         {1, 3, 2, false, true, -1},
                                         {1, 4, 1, false, false, 2},
                                         {3, 4, 2, false, false, 2},
                                         // Partial offload: kept units at stage 1 keep their
                                         // reduced gradient in the trainer's buffer (or, with
                                         // padding, in grad_reduced); offloaded ones go to host.
                                         {1, 2, 1, true, false, -1, 0.5},
                                         {2, 2, 1, true, false, -1, 0.5},
                                         {1, 2, 2, true, false, -1, 0.3}}) {
    CAPTURE(k.stage, k.world, k.gas, k.offload, k.local, k.mics, k.ratio);
    Config c = testing::TestConfig(k.stage, DType::kBF16, k.gas, /*clip=*/0.05, k.offload);
    c.zero.offload_optimizer.ratio = k.ratio;
    c.zero.reduce_bucket_size = kAutoSize;
    c.local_grad_accumulation = k.local;
    c.zero.mics_shard_size = k.mics;
    const std::vector<Run> engine = TrainRanks(c, k.world, false, false, device.get());
    const std::vector<Run> handed = TrainRanks(c, k.world, true, true, device.get());
    for (int r = 0; r < k.world; ++r) {
      CHECK(handed[r].master == engine[r].master);
      CHECK(handed[r].wte_in_place);
      CHECK(handed[r].report.engine_grad_bytes <= engine[r].report.engine_grad_bytes);
    }
  }
}

TEST_CASE("Engine: a declared buffer is handed over whole, from one start", "[engine]") {
  auto device = testing::OneThreadCpuDevice();
  Config c = testing::TestConfig(2, DType::kBF16, 1, 0.0, false);
  c.zero.reduce_bucket_size = kAutoSize;
  const std::vector<absl::Status> st = comm::testing::OnRanks(
      1, {c.comm_timeout_ms}, [&](int, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                         Engine::Create(c, MiniLlmc(true), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*e));
        std::vector<uint16_t> grads(2128), elsewhere(2128);
        // wte (elements 0..319) reduced in place: the engine has no buffer for it.
        absl::Status s = e->grad(0).status();
        if (!absl::StrContains(s.message(), "reduced straight from there")) return s;
        s = e->GradReady(0);
        if (!absl::StrContains(s.message(), "not handed over: SetGradBuffer first")) return s;
        RETURN_IF_ERROR(e->SetGradBuffer(0, grads.data()).status());
        // wpe from another allocation: refused, naming where it belongs.
        s = e->SetGradBuffer(1, elsewhere.data() + 320).status();
        if (!absl::StrContains(s.message(), "hand every parameter of 'grads' over from one")) {
          return absl::InternalError(s.ToString());
        }
        RETURN_IF_ERROR(e->SetGradBuffer(1, grads.data() + 320).status());
        // wte's padding (64 elements) lies over wpe and ln1w: ln1w not handed over.
        s = e->GradReady(0);
        if (!absl::StrContains(s.message(), "'ln1w''s declared gradient, which was not handed")) {
          return absl::InternalError(s.ToString());
        }
        // Moving the buffer: hand every parameter back, then over again.
        RETURN_IF_ERROR(e->SetGradBuffer(0, nullptr).status());
        RETURN_IF_ERROR(e->SetGradBuffer(1, nullptr).status());
        RETURN_IF_ERROR(e->SetGradBuffer(1, elsewhere.data() + 320).status());
        int64_t at = 0;
        for (int i = 0; i < e->num_params(); ++i) {
          if (i != 1) RETURN_IF_ERROR(e->SetGradBuffer(i, elsewhere.data() + at).status());
          at += e->plan().params[i].numel;
        }
        RETURN_IF_ERROR(e->GradReady(15));
        // Inside a micro-step a declared buffer cannot change.
        s = e->SetGradBuffer(0, elsewhere.data()).status();
        if (!absl::StrContains(s.message(), "inside a micro-step")) {
          return absl::InternalError(s.ToString());
        }
        for (int i = 14; i >= 0; --i) RETURN_IF_ERROR(e->GradReady(i));
        RETURN_IF_ERROR(e->Step().status());
        if (e->grad_copy_reason(15).find("past the last gradient declared in 'grads'") ==
            std::string::npos) {
          return absl::InternalError(e->grad_copy_reason(15));
        }
        if (!e->grad_copy_reason(0).empty()) return absl::InternalError("wte is in place");
        return absl::OkStatus();
      });
  CHECK(st[0].ToString() == "OK");
}

}  // namespace
}  // namespace zerort
