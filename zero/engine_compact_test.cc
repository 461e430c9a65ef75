// Compact optimizer state in the engine (docs/compact_state.md), against independent
// references:
//  - the lossless master (zerort.store_param_remainders): fp32 masters bit for bit those of the
//    fp32-master run, at stages 1-3 and worlds 1-3, on the device and with offload (cpu, nvme,
//    parameters on the host), on asynchronous streams too; bf16 parameters equal except where
//    the master is an exact tie (counted);
//  - bf16 moments and the stochastic bf16 master: bit for bit equal across stages 1-3, worlds
//    1-3 and storage modes, and to a serial reference that runs offload::CpuAdamWCompact over the
//    whole flat array (the moments too, read through a snapshot);
//  - checkpoints, which stay fp32: fp32 <-> compact round trips, resharding;
//  - the config keys' errors, and a device without the compact kernel refused at Create.
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status.h"
#include "base/testing/checks.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "memory/plan.h"
#include "offload/compact_state.h"
#include "offload/cpu_adamw_compact.h"
#include "zero/engine.h"
#include "zero/internal/test_util.h"
#include "zero/planner.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using memory::MasterForm;
using memory::ParamSpec;
using testing::GradValue;
using testing::InitValue;
using testing::SmallModel;

constexpr uint64_t kSeed = 12345;

Config WithForm(Config c, MasterForm form, bool bf16_moments) {
  c.store_param_remainders = form == MasterForm::kBf16Remainder;
  c.bf16_master_weights_and_grads = form == MasterForm::kBf16Stochastic;
  c.bf16_optimizer_states = bf16_moments;
  c.stochastic_rounding_seed = kSeed;
  return c;
}

// Every compact form of the optimizer state: a master form with bf16 or fp32 moments, all but
// the fp32 master with fp32 moments (the uncompacted state the forms are compared with).
struct Form {
  MasterForm master;
  bool bf16_moments;
};
const Form kCompactForms[] = {{MasterForm::kF32, true},
                              {MasterForm::kBf16Stochastic, false},
                              {MasterForm::kBf16Stochastic, true},
                              {MasterForm::kBf16Remainder, false},
                              {MasterForm::kBf16Remainder, true}};

// Where the state lives: the optimizer on the device or the host, NVMe, parameters on the host.
struct Mode {
  const char* name;
  int min_stage;
  std::function<void(Config*)> set;
};

void Nvme(Config* c) {
  c->zero.offload_optimizer.device = OffloadDevice::kNvme;
  c->zero.offload_optimizer.nvme_path = testing::TestTmpDir();
  c->aio.block_size = 8192;
  c->aio.queue_depth = 2;
  c->zero.offload_param.buffer_size = 1024;  // NVMe pieces of 1024 elements: units span several
}

const std::vector<Mode>& Modes() {
  static const std::vector<Mode> modes = {
      {"optimizer on the device", 1, [](Config*) {}},
      {"offload cpu", 1,
       [](Config* c) { c->zero.offload_optimizer.device = OffloadDevice::kCpu; }},
      {"offload nvme", 1, Nvme},
      {"offload cpu, parameters cpu", 3,
       [](Config* c) {
         c->zero.offload_optimizer.device = OffloadDevice::kCpu;
         c->zero.offload_param.device = OffloadDevice::kCpu;
       }},
      {"offload nvme, parameters cpu", 3,
       [](Config* c) {
         Nvme(c);
         c->zero.offload_param.device = OffloadDevice::kCpu;
       }},
      {"optimizer on the device, parameters cpu", 3,
       [](Config* c) { c->zero.offload_param.device = OffloadDevice::kCpu; }},
  };
  return modes;
}

// One rank's end state.
struct RankResult {
  std::vector<float> master;  // GatherMasterWeights, registration order
  std::vector<char> params;   // compute-dtype parameters in unit order (as TrainRank)
  // A snapshot (BeginSnapshot): this rank's owned fp32 master, m, v (plan.shard_elements each).
  std::vector<float> own_master, own_m, own_v;
  memory::Plan plan;
  MemoryReport report;
};

struct RunOptions {
  int steps = 6;
  bool rank_free = false;  // every rank writes rank 0's gradients (results world-independent)
  bool async_streams = false;
  std::function<float(int param, int64_t k)> init;  // default InitValue
  // Checkpoints: load `load` before training (from step `first`), save to `save_root` after.
  std::string load;
  bool allow_reshard = false;
  std::string save_root;
  int first = 0;
};

absl::Status Backward(Engine& e, int step, int micro, bool rank_free,
                      std::vector<std::vector<char>>* host) {
  const int r = rank_free ? 0 : e.communicator()->rank();
  for (int u = e.num_units() - 1; u >= 0; --u) {
    RETURN_IF_ERROR(e.Gather(u));
    RETURN_IF_ERROR(e.Release(u));
  }
  for (int u = 0; u < e.num_units(); ++u) {
    RETURN_IF_ERROR(e.Gather(u));
    for (int i : e.plan().units[u].params) {
      ASSIGN_OR_RETURN(void* g, e.grad(i));
      const int64_t n = e.plan().params[i].numel;
      host->emplace_back(n * 2);
      for (int64_t k = 0; k < n; ++k) {
        StoreAs(DType::kBF16, host->back().data(), k, GradValue(r, step, micro, i, k));
      }
      RETURN_IF_ERROR(e.device()->Copy(g, host->back().data(), host->back().size(),
                                       e.compute_stream()));
      RETURN_IF_ERROR(e.GradReady(i));
    }
    RETURN_IF_ERROR(e.Release(u));
  }
  return absl::OkStatus();
}

absl::StatusOr<RankResult> TrainOne(const Config& config, const std::vector<ParamSpec>& specs,
                                    comm::Communicator* comm, Device* device,
                                    const RunOptions& run) {
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(config, specs, comm, device));
  auto init = run.init ? run.init : [](int i, int64_t k) { return InitValue(i, k); };
  RETURN_IF_ERROR(e->InitParams([&](int i, const ParamSpec& s, float* v) {
    for (int64_t k = 0; k < s.numel(); ++k) v[k] = init(i, k);
  }));
  if (!run.load.empty()) {
    LoadOptions lo;
    lo.allow_reshard = run.allow_reshard;
    RETURN_IF_ERROR(LoadCheckpoint(*e, run.load, lo));
  }
  std::vector<std::vector<char>> host;
  for (int step = run.first; step < run.first + run.steps; ++step) {
    for (int micro = 0; micro < config.gradient_accumulation_steps; ++micro) {
      RETURN_IF_ERROR(Backward(*e, step, micro, run.rank_free, &host));
      RETURN_IF_ERROR(e->Step().status());
      RETURN_IF_ERROR(e->device()->Synchronize(e->compute_stream()));
      host.clear();
    }
  }
  RankResult out;
  out.plan = e->plan();
  out.report = e->memory_report();
  if (!run.save_root.empty()) RETURN_IF_ERROR(SaveCheckpoint(*e, run.save_root).status());
  ASSIGN_OR_RETURN(out.master, e->GatherMasterWeights());
  const int64_t s = out.plan.shard_elements;
  out.own_master.resize(s);
  out.own_m.resize(s);
  out.own_v.resize(s);
  RETURN_IF_ERROR(e->BeginSnapshot(out.own_master.data(), out.own_m.data(), out.own_v.data(),
                                   nullptr));
  RETURN_IF_ERROR(e->WaitSnapshot());
  for (int u = 0; u < e->num_units(); ++u) {
    RETURN_IF_ERROR(e->Gather(u));
    for (int i : out.plan.units[u].params) {
      ASSIGN_OR_RETURN(void* p, e->param(i));
      const size_t bytes = static_cast<size_t>(out.plan.params[i].numel) * 2;
      const size_t at = out.params.size();
      out.params.resize(at + bytes);
      RETURN_IF_ERROR(e->device()->Copy(out.params.data() + at, p, bytes, e->compute_stream()));
      RETURN_IF_ERROR(e->device()->Synchronize(e->compute_stream()));
    }
    RETURN_IF_ERROR(e->Release(u));
  }
  return out;
}

std::vector<RankResult> Train(const Config& config, int world, const RunOptions& run,
                              const std::vector<ParamSpec>& specs = SmallModel()) {
  CpuDeviceOptions o;
  o.threads = 1;
  o.async_streams = run.async_streams;
  o.stream_delay_us = run.async_streams ? 200 : 0;
  std::unique_ptr<Device> device = CreateCpuDevice(o);
  std::vector<RankResult> out(world);
  const std::vector<absl::Status> status =
      comm::testing::OnRanks(world, {config.comm_timeout_ms}, [&](int r, comm::Communicator* c) {
        ASSIGN_OR_RETURN(out[r], TrainOne(config, specs, c, device.get(), run));
        return absl::OkStatus();
      });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << status[r].ToString());
    REQUIRE(status[r].ok());
  }
  return out;
}

// The parameters' (unit-order) element k as its registration-order master index.
std::vector<int64_t> UnitOrderToMaster(const memory::Plan& plan) {
  std::vector<int64_t> start(plan.params.size() + 1, 0);
  for (size_t i = 0; i < plan.params.size(); ++i) start[i + 1] = start[i] + plan.params[i].numel;
  std::vector<int64_t> out;
  for (const memory::Unit& u : plan.units) {
    for (int i : u.params) {
      for (int64_t k = 0; k < plan.params[i].numel; ++k) out.push_back(start[i] + k);
    }
  }
  return out;
}

// An exact tie above an even bf16 value: the one master whose ties-away parameter differs from
// its nearest-even one (docs/compact_state.md).
bool EvenTie(float master) {
  const uint32_t u = FloatBits(master);
  return (u & 0xffffu) == 0x8000u && ((u >> 16) & 1u) == 0;
}

// Lossless run vs fp32 run: masters bit for bit; parameters equal except on exact ties, where
// the lossless one is the master's ties-away rounding. Returns the number of ties.
int CheckLossless(const std::vector<RankResult>& fp32, const std::vector<RankResult>& lossless) {
  int ties = 0;
  for (size_t r = 0; r < fp32.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(BitEqual(lossless[r].master, fp32[r].master));
    CHECK(BitEqual(lossless[r].own_master, fp32[r].own_master));
    CHECK(BitEqual(lossless[r].own_m, fp32[r].own_m));
    CHECK(BitEqual(lossless[r].own_v, fp32[r].own_v));
    const std::vector<int64_t> at = UnitOrderToMaster(fp32[r].plan);
    REQUIRE(at.size() * 2 == fp32[r].params.size());
    REQUIRE(lossless[r].params.size() == fp32[r].params.size());
    int rank_ties = 0;
    for (size_t e = 0; e < at.size(); ++e) {
      uint16_t a, b;
      std::memcpy(&a, fp32[r].params.data() + 2 * e, 2);
      std::memcpy(&b, lossless[r].params.data() + 2 * e, 2);
      const float master = fp32[r].master[at[e]];
      uint16_t hi, rem;
      offload::SplitMaster(master, &hi, &rem);
      CHECK(a == FloatToBf16(master));  // the fp32 run's copy: nearest even
      CHECK(b == hi);                   // the lossless one: the master's bf16 part
      if (EvenTie(master)) {
        ++rank_ties;
        CHECK(b == a + 1);  // one bf16 ulp larger in magnitude
      } else {
        CHECK(a == b);
      }
    }
    ties += rank_ties;
  }
  return ties;
}

TEST_CASE("Engine: the lossless master equals the fp32 master bit for bit in every layout",
          "[zero][compact]") {
  int ties = 0, runs = 0;
  for (const Mode& mode : Modes()) {
    for (int stage = mode.min_stage; stage <= 3; ++stage) {
      for (int world : {1, 2, 3}) {
        for (bool bf16_moments : {false}) {
          Config c = testing::TestConfig(stage, DType::kBF16, stage == 2 ? 2 : 1,
                                         stage == 1 ? 0.05 : 0.0, false);
          mode.set(&c);
          INFO("mode=" << mode.name << " stage=" << stage << " world=" << world);
          RunOptions run;
          const std::vector<RankResult> fp32 = Train(c, world, run);
          const std::vector<RankResult> lossless =
              Train(WithForm(c, MasterForm::kBf16Remainder, bf16_moments), world, run);
          ties += CheckLossless(fp32, lossless);
          ++runs;
          for (const RankResult& r : lossless) {
            for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
              CHECK(r.report.allocated[k] == r.report.planned[k]);
            }
          }
        }
      }
    }
  }
  // Random low halves make exact ties rare (one element in 2^17 per step): likely none here.
  WARN("lossless vs fp32 master: " << runs << " runs, " << ties
                                   << " parameters on an exact tie at the end");
}

TEST_CASE("Engine: the lossless master on asynchronous streams with delays", "[zero][compact]") {
  for (const char* name : {"offload cpu", "offload nvme", "optimizer on the device"}) {
    for (const Mode& mode : Modes()) {
      if (std::string(mode.name) != name) continue;
      for (int stage : {1, 3}) {
        Config c = testing::TestConfig(stage, DType::kBF16, 2, 0.05, false);
        mode.set(&c);
        INFO("mode=" << mode.name << " stage=" << stage);
        RunOptions run;
        run.steps = 4;
        const std::vector<RankResult> fp32 = Train(c, 2, run);
        run.async_streams = true;
        CheckLossless(fp32, Train(WithForm(c, MasterForm::kBf16Remainder, false), 2, run));
      }
    }
  }
}

TEST_CASE("Engine: lossless parameters round exact ties away from zero, the master stays",
          "[zero][compact]") {
  // Initial values on exact ties: 1 + 2^-8 (lower neighbour 0x3f80 even), -(1 + 2^-8), and
  // 1 + 3 * 2^-8 (lower neighbour odd: nearest even rounds up too), mixed with others.
  auto init = [](int i, int64_t k) {
    switch (k % 4) {
      case 0: return 1.00390625f;
      case 1: return -1.00390625f;
      case 2: return 1.01171875f;
      default: return InitValue(i, k);
    }
  };
  for (int stage : {1, 3}) {
    Config c = testing::TestConfig(stage, DType::kBF16, 1, 0.0, false);
    RunOptions run;
    run.steps = 0;
    run.init = init;
    const std::vector<RankResult> fp32 = Train(c, 2, run);
    const std::vector<RankResult> lossless =
        Train(WithForm(c, MasterForm::kBf16Remainder, false), 2, run);
    const int ties = CheckLossless(fp32, lossless);
    // Per rank: elements k % 4 in {0, 1} of every parameter.
    int64_t planted = 0;
    for (const ParamSpec& s : SmallModel()) planted += (s.numel() + 3) / 4 + (s.numel() + 2) / 4;
    CHECK(ties == 2 * planted);
  }
}

// The serial reference: offload::CpuAdamWCompact over the whole flat array, in the order of
// memory::Unit::index_offset (units as the plan makes them; padding left out), with the
// gradients every rank writes (rank 0's) averaged over `gas` micro-steps in bf16 as the
// engine accumulates. Returns the masters in registration order; m and v by flat index.
struct Serial {
  std::vector<float> master;  // registration order
  std::vector<float> m, v;    // flat index order, fp32
  std::vector<int64_t> index_of_param;  // flat index of each parameter's element 0
};

Serial SerialCompact(const Config& config, int steps, MasterForm form, bool bf16_moments) {
  const std::vector<ParamSpec> specs = SmallModel();
  const memory::Plan plan =
      memory::MakePlan(specs, PlanOptionsFromConfig(specs, config, 1, 0).value()).value();
  int64_t n = 0;
  for (const memory::Unit& u : plan.units) n = std::max(n, u.index_offset + u.numel);
  Serial out;
  out.index_of_param.resize(specs.size());
  for (const memory::Unit& u : plan.units) {
    for (int i : u.params) {
      out.index_of_param[i] = u.index_offset + plan.params[i].offset_in_unit;
    }
  }
  std::vector<float> master(n, 0.0f);
  std::vector<uint16_t> param(n, 0), rem(n, 0), grad(n, 0);
  const DType mdt = bf16_moments ? DType::kBF16 : DType::kF32;
  std::vector<char> m(n * DTypeSize(mdt), 0), v(n * DTypeSize(mdt), 0);
  for (size_t i = 0; i < specs.size(); ++i) {
    for (int64_t k = 0; k < specs[i].numel(); ++k) {
      const int64_t x = out.index_of_param[i] + k;
      const float w = InitValue(static_cast<int>(i), k);
      master[x] = w;
      if (form == MasterForm::kBf16Remainder) {
        offload::SplitMaster(w, &param[x], &rem[x]);
      } else {
        param[x] = FloatToBf16(w);
      }
    }
  }
  const int gas = config.gradient_accumulation_steps;
  const OptimizerConfig& o = config.optimizer;
  for (int t = 1; t <= steps; ++t) {
    std::fill(grad.begin(), grad.end(), 0);
    for (size_t i = 0; i < specs.size(); ++i) {
      for (int64_t k = 0; k < specs[i].numel(); ++k) {
        float acc = 0;
        for (int micro = 0; micro < gas; ++micro) {
          const float g = Bf16ToFloat(
              FloatToBf16(GradValue(0, t - 1, micro, static_cast<int>(i), k)));
          acc = micro == 0 ? g : Bf16ToFloat(FloatToBf16(acc + g));
        }
        grad[out.index_of_param[i] + k] = FloatToBf16(acc);
      }
    }
    offload::CompactAdamWArrays a;
    a.master_form = static_cast<offload::MasterForm>(form);
    if (form == MasterForm::kF32) a.master = master.data();
    if (form == MasterForm::kBf16Remainder) a.remainder = rem.data();
    a.param = param.data();
    a.m = m.data();
    a.v = v.data();
    a.moment_dtype = mdt;
    a.grad = grad.data();
    a.grad_dtype = DType::kBF16;
    a.n = static_cast<size_t>(n);
    a.rounding = {kSeed, static_cast<uint64_t>(t), 0};
    const offload::AdamWStepParams p =
        offload::MakeAdamWStepParams(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, t).value();
    REQUIRE(offload::CpuAdamWCompact(a, p, static_cast<float>(1.0 / gas), 1).ok());
  }
  out.m.resize(n);
  out.v.resize(n);
  for (int64_t x = 0; x < n; ++x) {
    out.m[x] = LoadAs(mdt, m.data(), x);
    out.v[x] = LoadAs(mdt, v.data(), x);
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    for (int64_t k = 0; k < specs[i].numel(); ++k) {
      const int64_t x = out.index_of_param[i] + k;
      out.master.push_back(form == MasterForm::kF32              ? master[x]
                           : form == MasterForm::kBf16Remainder ? offload::JoinMaster(param[x], rem[x])
                                                                : Bf16ToFloat(param[x]));
    }
  }
  return out;
}

// Every rank's snapshot m and v against the reference's, element by element of the units.
void CheckMoments(const std::vector<RankResult>& run, const Serial& ref) {
  for (size_t r = 0; r < run.size(); ++r) {
    const memory::Plan& plan = run[r].plan;
    const int64_t group = memory::ShardGroupSize(plan.options);
    for (const memory::Unit& u : plan.units) {
      for (int64_t j = 0; j < u.shard; ++j) {
        const int64_t in_unit = (static_cast<int64_t>(r) % group) * u.shard + j;
        if (in_unit >= u.numel) continue;  // padding: no reference element
        const int64_t x = u.index_offset + in_unit;
        INFO("rank " << r << " unit " << u.name << " element " << in_unit);
        REQUIRE(FloatBits(run[r].own_m[u.shard_offset + j]) == FloatBits(ref.m[x]));
        REQUIRE(FloatBits(run[r].own_v[u.shard_offset + j]) == FloatBits(ref.v[x]));
      }
    }
  }
}

TEST_CASE("Engine: bf16 moments and the stochastic master equal the serial CpuAdamWCompact "
          "at every stage, world size and storage mode",
          "[zero][compact]") {
  for (const Form& f : kCompactForms) {
    for (int gas : {1, 2}) {
      Config base = WithForm(testing::TestConfig(1, DType::kBF16, gas, 0.0, false), f.master,
                             f.bf16_moments);
      const int steps = 5;
      const Serial ref = SerialCompact(base, steps, f.master, f.bf16_moments);
      for (const Mode& mode : Modes()) {
        for (int stage = std::max(1, mode.min_stage); stage <= 3; ++stage) {
          for (int world : {1, 2, 3}) {
            // The full matrix for one form; a cut of it for the others.
            if (gas == 2 && world == 2) continue;
            Config c = base;
            c.zero.stage = stage;
            mode.set(&c);
            INFO("master=" << memory::MasterFormName(f.master) << " bf16 moments="
                           << f.bf16_moments << " gas=" << gas << " mode=" << mode.name
                           << " stage=" << stage << " world=" << world);
            RunOptions run;
            run.steps = steps;
            run.rank_free = true;
            const std::vector<RankResult> got = Train(c, world, run);
            for (const RankResult& r : got) {
              REQUIRE(r.master.size() == ref.master.size());
              for (size_t e = 0; e < ref.master.size(); ++e) {
                INFO("element " << e << ": " << r.master[e] << " vs " << ref.master[e]);
                REQUIRE(FloatBits(r.master[e]) == FloatBits(ref.master[e]));
              }
              for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
                CHECK(r.report.allocated[k] == r.report.planned[k]);
              }
            }
            CheckMoments(got, ref);
          }
        }
      }
    }
  }
}

// Partial optimizer offload (zero_optimization.offload_optimizer.ratio 0.5): the units kept on
// the device hold the form as without offload (a compact master in the parameter shard), the
// offloaded ones as with offload (a compact master's bf16 copy in host memory or the NVMe file,
// or the host parameter shard itself with offload_param "cpu"), in the same step.
const std::vector<Mode>& PartialModes() {
  static const std::vector<Mode> modes = {
      {"offload cpu, ratio 0.5", 1,
       [](Config* c) {
         c->zero.offload_optimizer.device = OffloadDevice::kCpu;
         c->zero.offload_optimizer.ratio = 0.5;
       }},
      {"offload nvme, ratio 0.5", 1,
       [](Config* c) {
         Nvme(c);
         c->zero.offload_optimizer.ratio = 0.5;
       }},
      {"offload cpu, parameters cpu, ratio 0.5", 3,
       [](Config* c) {
         c->zero.offload_optimizer.device = OffloadDevice::kCpu;
         c->zero.offload_optimizer.ratio = 0.5;
         c->zero.offload_param.device = OffloadDevice::kCpu;
       }},
  };
  return modes;
}

// Both parts hold units, and every planned byte was allocated (each part's compact arrays).
void CheckSplit(const std::vector<RankResult>& run) {
  for (const RankResult& r : run) {
    REQUIRE(r.plan.device_state_elements > 0);
    REQUIRE(r.plan.offloaded_state_elements > 0);
    for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
      CHECK(r.report.allocated[k] == r.report.planned[k]);
    }
  }
}

TEST_CASE("Engine: partial offload (ratio 0.5) with each compact form equals the serial "
          "CpuAdamWCompact, and the lossless master the fp32 master, bit for bit",
          "[zero][compact][offload]") {
  for (const Form& f : kCompactForms) {
    Config base = WithForm(testing::TestConfig(1, DType::kBF16, 1, 0.0, false), f.master,
                           f.bf16_moments);
    const int steps = 4;
    const Serial ref = SerialCompact(base, steps, f.master, f.bf16_moments);
    for (const Mode& mode : PartialModes()) {
      for (int stage = mode.min_stage; stage <= 3; ++stage) {
        for (int world : {1, 2, 3}) {
          Config c = base;
          c.zero.stage = stage;
          mode.set(&c);
          INFO("master=" << memory::MasterFormName(f.master) << " bf16 moments="
                         << f.bf16_moments << " mode=" << mode.name << " stage=" << stage
                         << " world=" << world);
          RunOptions run;
          run.steps = steps;
          run.rank_free = true;
          const std::vector<RankResult> got = Train(c, world, run);
          CheckSplit(got);
          for (const RankResult& r : got) {
            REQUIRE(r.master.size() == ref.master.size());
            for (size_t e = 0; e < ref.master.size(); ++e) {
              INFO("element " << e << ": " << r.master[e] << " vs " << ref.master[e]);
              REQUIRE(FloatBits(r.master[e]) == FloatBits(ref.master[e]));
            }
          }
          CheckMoments(got, ref);
        }
      }
    }
  }
  // The lossless master against the fp32 master in the same split, rank-dependent gradients,
  // GAS 2 at stage 2; and against the lossless master without offload.
  for (const Mode& mode : PartialModes()) {
    for (int stage = mode.min_stage; stage <= 3; ++stage) {
      Config c = testing::TestConfig(stage, DType::kBF16, stage == 2 ? 2 : 1, 0.0, false);
      const Config plain = c;
      mode.set(&c);
      INFO("mode=" << mode.name << " stage=" << stage);
      RunOptions run;
      run.steps = 4;
      const std::vector<RankResult> fp32 = Train(c, 2, run);
      const std::vector<RankResult> lossless =
          Train(WithForm(c, MasterForm::kBf16Remainder, false), 2, run);
      CheckSplit(lossless);
      CheckLossless(fp32, lossless);
      const std::vector<RankResult> none =
          Train(WithForm(plain, MasterForm::kBf16Remainder, false), 2, run);
      for (size_t r = 0; r < none.size(); ++r) {
        CHECK(BitEqual(lossless[r].master, none[r].master));
        CHECK(lossless[r].params == none[r].params);
      }
    }
  }
}

TEST_CASE("Engine: partial offload with the stochastic master on asynchronous streams",
          "[zero][compact][offload]") {
  for (const Mode& mode : PartialModes()) {
    if (mode.min_stage > 1) continue;
    Config c = WithForm(testing::TestConfig(2, DType::kBF16, 2, 0.0, false),
                        MasterForm::kBf16Stochastic, true);
    const Config plain = c;
    mode.set(&c);
    INFO("mode=" << mode.name);
    RunOptions run;
    run.steps = 3;
    const std::vector<RankResult> none = Train(plain, 2, run);
    run.async_streams = true;
    const std::vector<RankResult> split = Train(c, 2, run);
    CheckSplit(split);
    for (size_t r = 0; r < none.size(); ++r) {
      CHECK(BitEqual(split[r].master, none[r].master));
      CHECK(split[r].params == none[r].params);
      CHECK(BitEqual(split[r].own_m, none[r].own_m));
      CHECK(BitEqual(split[r].own_v, none[r].own_v));
    }
  }
}

TEST_CASE("Engine: stage 0 runs the compact forms on the device too", "[zero][compact]") {
  for (MasterForm form : {MasterForm::kBf16Remainder, MasterForm::kBf16Stochastic}) {
    Config c = WithForm(testing::TestConfig(0, DType::kBF16, 1, 0.0, false), form, true);
    const Serial ref = SerialCompact(c, 4, form, true);
    RunOptions run;
    run.steps = 4;
    run.rank_free = true;
    for (int world : {1, 2}) {
      const std::vector<RankResult> got = Train(c, world, run);
      for (const RankResult& r : got) CHECK(BitEqual(r.master, ref.master));
      CheckMoments(got, ref);
    }
  }
}

TEST_CASE("Engine: checkpoints stay fp32: fp32 <-> compact round trips and resharding",
          "[zero][compact][checkpoint]") {
  const int first = 3, rest = 3;
  for (int stage : {1, 3}) {
    const Config fp32 = testing::TestConfig(stage, DType::kBF16, 1, 0.0, false);
    const Config lossless = WithForm(fp32, MasterForm::kBf16Remainder, false);
    INFO("stage " << stage);
    RunOptions all;
    all.steps = first + rest;
    const std::vector<RankResult> straight = Train(fp32, 2, all);
    // fp32 -> lossless and lossless -> fp32: the masters go on bit for bit.
    for (bool from_fp32 : {true, false}) {
      INFO((from_fp32 ? "fp32 checkpoint, lossless run" : "lossless checkpoint, fp32 run"));
      const std::string dir = testing::TempDir("compact_ckpt_");
      RunOptions save;
      save.steps = first;
      save.save_root = dir;
      Train(from_fp32 ? fp32 : lossless, 2, save);
      RunOptions resume;
      resume.first = first;
      resume.steps = rest;
      resume.load = dir;
      const std::vector<RankResult> resumed = Train(from_fp32 ? lossless : fp32, 2, resume);
      for (int r = 0; r < 2; ++r) CHECK(BitEqual(resumed[r].master, straight[r].master));
    }
    // The lossy forms resume from their own checkpoints exactly (bf16 values widen and round
    // back unchanged), here resharded from 2 ranks to 3 (gradients the same on every rank).
    for (MasterForm form : {MasterForm::kBf16Stochastic, MasterForm::kF32}) {
      const Config c = WithForm(fp32, form, true);
      RunOptions whole;
      whole.steps = first + rest;
      whole.rank_free = true;
      const std::vector<RankResult> uninterrupted = Train(c, 3, whole);
      const std::string dir = testing::TempDir("compact_ckpt_");
      RunOptions save;
      save.steps = first;
      save.rank_free = true;
      save.save_root = dir;
      Train(c, 2, save);
      RunOptions resume;
      resume.first = first;
      resume.steps = rest;
      resume.rank_free = true;
      resume.load = dir;
      resume.allow_reshard = true;
      const std::vector<RankResult> resumed = Train(c, 3, resume);
      for (int r = 0; r < 3; ++r) {
        INFO("master " << memory::MasterFormName(form) << ", rank " << r);
        CHECK(BitEqual(resumed[r].master, uninterrupted[r].master));
        CHECK(BitEqual(resumed[r].own_m, uninterrupted[r].own_m));
        CHECK(BitEqual(resumed[r].own_v, uninterrupted[r].own_v));
      }
    }
    // An fp32 checkpoint into the stochastic form: the master is rounded to nearest on load.
    {
      const std::string dir = testing::TempDir("compact_ckpt_");
      RunOptions save;
      save.steps = first;
      save.save_root = dir;
      const std::vector<RankResult> saved = Train(fp32, 2, save);
      RunOptions load;
      load.steps = 0;
      load.load = dir;
      load.first = first;
      const std::vector<RankResult> loaded =
          Train(WithForm(fp32, MasterForm::kBf16Stochastic, true), 2, load);
      for (int r = 0; r < 2; ++r) {
        REQUIRE(loaded[r].master.size() == saved[r].master.size());
        for (size_t e = 0; e < saved[r].master.size(); ++e) {
          CHECK(FloatBits(loaded[r].master[e]) ==
                FloatBits(Bf16ToFloat(FloatToBf16(saved[r].master[e]))));
        }
        for (size_t e = 0; e < saved[r].own_m.size(); ++e) {
          CHECK(FloatBits(loaded[r].own_m[e]) ==
                FloatBits(Bf16ToFloat(FloatToBf16(saved[r].own_m[e]))));
        }
      }
    }
  }
}

TEST_CASE("Engine: compact state keys are refused where they cannot work, naming the key",
          "[zero][compact]") {
  auto device = CreateCpuDevice();
  auto create = [&](const Config& c) -> absl::Status {
    std::vector<absl::Status> s =
        comm::testing::OnRanks(1, {20000}, [&](int, comm::Communicator* comm) {
          return Engine::Create(c, SmallModel(), comm, device.get()).status();
        });
    return s[0];
  };
  struct Case {
    const char* key;
    std::function<void(Config*)> set;
  };
  const Case cases[] = {
      {"bf16.bf16_optimizer_states", [](Config* c) { c->bf16_optimizer_states = true; }},
      {"bf16.bf16_master_weights_and_grads",
       [](Config* c) { c->bf16_master_weights_and_grads = true; }},
      {"zerort.store_param_remainders", [](Config* c) { c->store_param_remainders = true; }},
  };
  for (const Case& k : cases) {
    for (DType dtype : {DType::kF32, DType::kF16}) {
      Config c = testing::TestConfig(2, dtype, 1, 0.0, false);
      k.set(&c);
      const absl::Status s = create(c);
      INFO(s.ToString());
      CHECK(s.code() == absl::StatusCode::kInvalidArgument);
      CHECK(s.message().find(k.key) != absl::string_view::npos);
      CHECK(s.message().find("bf16") != absl::string_view::npos);
    }
  }
  // Both master forms at once.
  Config both = testing::TestConfig(2, DType::kBF16, 1, 0.0, false);
  both.store_param_remainders = both.bf16_master_weights_and_grads = true;
  const absl::Status s = create(both);
  CHECK(s.message().find("bf16.bf16_master_weights_and_grads") != absl::string_view::npos);
  CHECK(s.message().find("zerort.store_param_remainders") != absl::string_view::npos);
  // A compact master with the parameters on NVMe.
  Config nvme = WithForm(testing::TestConfig(3, DType::kBF16, 1, 0.0, false),
                         MasterForm::kBf16Stochastic, false);
  nvme.zero.offload_param.device = OffloadDevice::kNvme;
  nvme.zero.offload_param.nvme_path = testing::TestTmpDir();
  const absl::Status n = create(nvme);
  CHECK(n.message().find("bf16.bf16_master_weights_and_grads") != absl::string_view::npos);
  CHECK(n.message().find("nvme") != absl::string_view::npos);
}

// The CPU device's kernels, without its compact AdamW: Device's default, Unimplemented.
class NoCompactDevice final : public zero_internal::ForwardingDevice {
 public:
  explicit NoCompactDevice(Device* inner) : ForwardingDevice(inner) {}
  absl::string_view name() const override { return "no-compact"; }
  absl::Status CompactAdamWRanges(const offload::CompactAdamWArrays& arrays,
                                  absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                                  Stream s) override {
    return Device::CompactAdamWRanges(arrays, ranges, grad_scale, s);  // Unimplemented
  }
};

TEST_CASE("Engine: a device without the compact kernel fails at Create, naming itself",
          "[zero][compact]") {
  auto cpu = CreateCpuDevice();
  NoCompactDevice dev(cpu.get());
  // Offload at ratio 0.5 keeps some units on the device, which then runs their AdamW.
  for (double ratio : {-1.0, 1.0, 0.5}) {
    const bool offload = ratio >= 0;
    Config c = WithForm(testing::TestConfig(2, DType::kBF16, 1, 0.0, offload),
                        MasterForm::kBf16Remainder, true);
    if (offload) c.zero.offload_optimizer.ratio = ratio;
    const std::vector<absl::Status> s =
        comm::testing::OnRanks(1, {20000}, [&](int, comm::Communicator* comm) {
          return Engine::Create(c, SmallModel(), comm, &dev).status();
        });
    INFO("ratio " << ratio << ": " << s[0].ToString());
    if (ratio == 0.5) {
      CHECK(s[0].code() == absl::StatusCode::kUnimplemented);
      CHECK(s[0].message().find("no-compact") != absl::string_view::npos);
      CHECK(s[0].message().find("offload_optimizer.ratio") != absl::string_view::npos);
    } else if (offload) {
      CHECK(s[0].ok());  // the host AdamW runs every form
    } else {
      CHECK(s[0].code() == absl::StatusCode::kUnimplemented);
      CHECK(s[0].message().find("no-compact") != absl::string_view::npos);
      CHECK(s[0].message().find("compact") != absl::string_view::npos);
    }
  }
}

}  // namespace
}  // namespace zerort
