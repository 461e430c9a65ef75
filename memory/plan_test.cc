#include "memory/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "memory/testing/llmc_tensors.h"

namespace zerort {
namespace memory {
namespace {

// A random model: `modules` modules of 1..4 parameters with 1..3 dimensions.
std::vector<ParamSpec> RandomModel(std::mt19937& rng, int modules, int max_dim) {
  std::vector<ParamSpec> specs;
  std::uniform_int_distribution<int> nparams(1, 4), ndims(1, 3), dim(1, max_dim);
  for (int m = 0; m < modules; ++m) {
    const int np = nparams(rng);
    for (int p = 0; p < np; ++p) {
      ParamSpec s;
      s.module = "m" + std::to_string(m);
      s.name = s.module + ".p" + std::to_string(p);
      const int nd = ndims(rng);
      for (int d = 0; d < nd; ++d) s.shape.push_back(dim(rng));
      specs.push_back(s);
    }
  }
  return specs;
}

// The control exchange each rank sends per step over the world (plan.h,
// comm_control_bytes_per_step): (world - 1) copies of its norm-table row, units + 1 fp32 (stages
// 1-3), and of AgreeBeforeUpdate's six 64-bit words.
int64_t ControlBytes(int64_t world, int64_t units, int stage) {
  return (world - 1) * ((stage >= 1 ? (units + 1) * 4 : 0) + 6 * 8);
}

int64_t TotalElements(const std::vector<ParamSpec>& specs) {
  int64_t total = 0;
  for (const ParamSpec& s : specs) {
    const int64_t n = s.numel();
    total += n;
  }
  return total;
}

// The ZeRO paper's model-state bytes per rank, written independently of the planner:
// mixed precision keeps 2 (params) + 2 (grads) + 12 (master, m, v) bytes per element;
// fp32 training keeps 4 + 4 + 8 (no master copy).
int64_t ClosedForm(int stage, bool mixed, int64_t E, int64_t N) {
  const int64_t p = mixed ? 2 : 4, g = mixed ? 2 : 4, o = mixed ? 12 : 8;
  switch (stage) {
    case 0: return (p + g + o) * E;
    case 1: return (p + g) * E + o * E / N;
    case 2: return p * E + (g + o) * E / N;
    default: return (p + g + o) * E / N;
  }
}

TEST_CASE("Planner: every element has exactly one owner and shards are equal and aligned",
          "[memory]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    const auto specs = RandomModel(rng, 1 + trial % 9, 1 + trial % 20 * 3);
    PlanOptions o;
    o.stage = trial % 4;
    o.world_size = 1 + trial % 11;
    o.shard_alignment = 1 + trial % 5 * 16;
    o.unit_target_elements = 1 + trial * 13;
    o.persistence_threshold = 0;
    auto plan = MakePlan(specs, o);
    REQUIRE(plan.ok());
    // Count, for every element of every unit, how many ranks own it.
    std::vector<std::vector<int>> owners(plan->units.size());
    for (size_t u = 0; u < plan->units.size(); ++u) owners[u].assign(plan->units[u].padded, 0);
    for (int r = 0; r < o.world_size; ++r) {
      o.rank = r;
      auto pr = MakePlan(specs, o);
      REQUIRE(pr.ok());
      REQUIRE(pr->units.size() == plan->units.size());
      int64_t shard_offset = 0;
      for (size_t u = 0; u < pr->units.size(); ++u) {
        const Unit& unit = pr->units[u];
        CHECK(unit.shard * o.world_size == unit.padded);
        CHECK(unit.shard % o.shard_alignment == 0);
        CHECK(unit.padded - unit.numel < o.world_size * o.shard_alignment);
        CHECK(unit.shard_offset == shard_offset);
        shard_offset += unit.shard;
        for (int64_t e = r * unit.shard; e < (r + 1) * unit.shard; ++e) ++owners[u][e];
      }
      CHECK(pr->shard_elements * o.world_size == pr->padded_elements);
    }
    for (const auto& unit_owners : owners) {
      CHECK(std::all_of(unit_owners.begin(), unit_owners.end(), [](int n) { return n == 1; }));
    }
    // Parameters: inside their unit, not overlapping, aligned, covering P.
    int64_t covered = 0;
    for (const Unit& unit : plan->units) {
      int64_t end = 0;
      for (int i : unit.params) {
        const ParamLayout& p = plan->params[i];
        CHECK(p.unit == &unit - plan->units.data());
        CHECK(p.offset_in_unit >= end);
        CHECK(p.offset_in_unit % o.param_alignment == 0);
        CHECK(p.flat_offset == unit.flat_offset + p.offset_in_unit);
        end = p.offset_in_unit + p.numel;
        covered += p.numel;
      }
      CHECK(end == unit.numel);
    }
    CHECK(covered == TotalElements(specs));
    CHECK(plan->num_elements == covered);
  }
}

TEST_CASE("Planner: model-state bytes equal the closed forms for mixed-precision Adam",
          "[memory]") {
  const std::vector<int64_t> sizes = {1, 7, 1000, 65537, 1000003, 123456789};
  for (int64_t P : sizes) {
    for (int N : {1, 2, 3, 8, 64, 1024}) {
      for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
        for (int stage = 0; stage <= 3; ++stage) {
          // Twelve equal-ish layers (P not divisible by 12 or N in general).
          std::vector<ParamSpec> specs;
          const int layers = P >= 12 ? 12 : 1;
          for (int l = 0; l < layers; ++l) {
            const int64_t n = P / layers + (l == layers - 1 ? P % layers : 0);
            specs.push_back({"l" + std::to_string(l) + ".w", {n}, "l" + std::to_string(l)});
          }
          PlanOptions o;
          o.stage = stage;
          o.world_size = N;
          o.compute_dtype = dtype;
          o.persistence_threshold = 0;
          o.unit_target_elements = std::max<int64_t>(1, P / 5);
          auto plan = MakePlan(specs, o);
          REQUIRE(plan.ok());
          const int64_t E = plan->padded_elements;
          INFO("P=" << P << " N=" << N << " stage=" << stage << " dtype=" << DTypeName(dtype));
          CHECK(plan->num_elements == P);
          CHECK(E >= P);
          // Padding is bounded by one world*alignment per unit plus parameter alignment gaps.
          CHECK(E - P < static_cast<int64_t>(plan->units.size()) * N * o.shard_alignment +
                            static_cast<int64_t>(specs.size()) * o.param_alignment);
          CHECK(plan->model_state_bytes == ClosedForm(stage, dtype != DType::kF32, E, N));
          // Nothing offloaded: model state and working buffers all live on the device.
          CHECK(plan->pinned_host_bytes() == 0);
          CHECK(plan->host_bytes() == 0);
          CHECK(plan->device_bytes() >= plan->model_state_bytes);
        }
      }
    }
  }
}

TEST_CASE("Planner: a world larger than the parameter count still gives every rank a shard",
          "[memory]") {
  std::vector<ParamSpec> specs = {{"a", {3}, "m"}, {"b", {2}, "n"}};
  PlanOptions o;
  o.stage = 3;
  o.world_size = 64;
  o.shard_alignment = 1;
  o.persistence_threshold = 0;
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  CHECK(plan->shard_elements >= 1);
  CHECK(plan->padded_elements == plan->shard_elements * 64);
}

TEST_CASE("Planner: units follow modules in reverse registration order", "[memory]") {
  std::vector<ParamSpec> specs = {
      {"emb", {100}, "embed"}, {"l0.w", {50}, "l0"}, {"l0.b", {5}, "l0"},
      {"l1.w", {50}, "l1"},    {"head", {400}, "head"}};
  PlanOptions o;
  o.param_alignment = 1;
  o.shard_alignment = 1;
  o.unit_target_elements = 120;
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  // head (400) exceeds the target and stands alone; l1 + l0 merge (105); embed alone.
  REQUIRE(plan->units.size() == 3);
  CHECK(plan->units[0].name == "head");
  CHECK(plan->units[1].name == "l1..l0");
  CHECK(plan->units[1].numel == 105);
  CHECK(plan->units[2].name == "embed");
  CHECK(plan->params[4].unit == 0);
  CHECK(plan->params[0].unit == 2);

  // unit_per_module: every module one unit, small ones not merged, large ones not split,
  // whatever the target; a module's parameters stay together even when registered apart.
  specs.push_back({"l0.c", {7}, "l0"});
  o.unit_per_module = true;
  for (int64_t target : {1, 120, 1000000}) {
    o.unit_target_elements = target;
    auto per_module = MakePlan(specs, o);
    REQUIRE(per_module.ok());
    REQUIRE(per_module->units.size() == 4);
    CHECK(per_module->units[0].name == "head");
    CHECK(per_module->units[1].name == "l1");
    CHECK(per_module->units[2].name == "l0");
    CHECK(per_module->units[2].params == std::vector<int>{1, 2, 5});
    CHECK(per_module->units[2].numel == 62);
    CHECK(per_module->units[3].name == "embed");
  }
}

TEST_CASE("Planner: working buffers per stage", "[memory]") {
  std::vector<ParamSpec> specs;
  for (int l = 0; l < 10; ++l) {
    specs.push_back({"l" + std::to_string(l), {1000 * (l + 1)}, "l" + std::to_string(l)});
  }
  PlanOptions o;
  o.world_size = 4;
  o.shard_alignment = 1;
  o.param_alignment = 1;
  o.unit_target_elements = 1;  // one unit per layer
  o.persistence_threshold = 2000;
  o.prefetch_elements = 15000;
  o.gradient_accumulation_steps = 3;

  o.stage = 0;
  auto p0 = MakePlan(specs, o);
  REQUIRE(p0.ok());
  REQUIRE(p0->Find(BufferClass::kGradAccumulator) != nullptr);
  CHECK(p0->Find(BufferClass::kGradAccumulator)->elements == p0->padded_elements);
  CHECK(p0->Find(BufferClass::kGradBucket) == nullptr);

  o.stage = 2;
  auto p2 = MakePlan(specs, o);
  REQUIRE(p2.ok());
  CHECK(p2->Find(BufferClass::kGradAccumulator) == nullptr);
  REQUIRE(p2->Find(BufferClass::kGradBucket) != nullptr);
  CHECK(p2->Find(BufferClass::kGradBucket)->elements == 2 * 10000);

  o.stage = 3;
  auto p3 = MakePlan(specs, o);
  REQUIRE(p3.ok());
  // Units of 1000 and 2000 elements are persistent; the largest gathered unit is 10000, so
  // the prefetch window of 15000 needs 2 slots beside the one in use.
  int persistent = 0;
  for (const Unit& u : p3->units) persistent += u.persistent;
  CHECK(persistent == 2);
  CHECK(p3->gather_slots == 3);
  CHECK(p3->Find(BufferClass::kPersistentParams)->elements == 3000);
  o.max_live_elements = 25000;
  auto p3_capped = MakePlan(specs, o);
  REQUIRE(p3_capped.ok());
  CHECK(p3_capped->gather_slots == 2);
}

TEST_CASE("Planner: one huge unit gets a bucket and a gather slot of its own", "[memory]") {
  // An embedding of H elements and L layers of S elements each, one unit per module, as GPT-2
  // shaped: the buckets and slots of the layers are sized by a layer, not by the embedding.
  constexpr int64_t H = 40000, S = 3000, L = 6;
  std::vector<ParamSpec> specs = {{"embed.w", {H}, "embed"}};
  for (int l = 0; l < L; ++l) {
    specs.push_back({"l" + std::to_string(l) + ".w", {S}, "l" + std::to_string(l)});
  }
  PlanOptions o;
  o.world_size = 2;
  o.compute_dtype = DType::kF32;
  o.unit_target_elements = 1;  // one unit per module
  o.persistence_threshold = 0;
  o.prefetch_elements = 7000;
  const int64_t align = o.world_size * o.shard_alignment;
  const int64_t h = (H + align - 1) / align * align, s = (S + align - 1) / align * align;

  o.stage = 2;
  auto p2 = MakePlan(specs, o);
  REQUIRE(p2.ok());
  const Buffer* buckets = p2->Find(BufferClass::kGradBucket);
  REQUIRE(buckets != nullptr);
  // grad_bucket_count (2) layer buckets beside one of the embedding's, instead of 2 of it.
  CHECK(buckets->slot_elements == std::vector<int64_t>{s, s, h});
  CHECK(buckets->count == 3);
  CHECK(buckets->bytes == (2 * s + h) * 4);
  CHECK(p2->max_unit_elements == h);

  o.stage = 3;
  auto p3 = MakePlan(specs, o);
  REQUIRE(p3.ok());
  // Per class, 1 + ceil(prefetch / its unit) slots, at most its units: 1 + ceil(7000 / s) of
  // a layer, and 1 for the one embedding (1 + ceil(7000 / h) = 2, but there is one unit).
  const int64_t layer_slots = 1 + (o.prefetch_elements + s - 1) / s;
  REQUIRE(layer_slots == 4);
  const Buffer* gather = p3->Find(BufferClass::kGatherBuffer);
  REQUIRE(gather != nullptr);
  std::vector<int64_t> expected(layer_slots, s);
  expected.push_back(h);
  CHECK(gather->slot_elements == expected);
  CHECK(p3->gather_slots == layer_slots + 1);
  CHECK(gather->bytes == (layer_slots * s + h) * 4);
  // Against one class (every slot of the embedding's size: 2 slots, 2 buckets).
  CHECK(gather->bytes + p3->Find(BufferClass::kGradBucket)->bytes < (2 * h + 2 * h) * 4);

  // Each unit uses the smallest class that holds it.
  CHECK(SlotClassElements(gather->slot_elements, s) == s);
  CHECK(SlotClassElements(gather->slot_elements, 1) == s);
  CHECK(SlotClassElements(gather->slot_elements, s + 1) == h);
  CHECK(SlotClassElements(gather->slot_elements, h + 1) == 0);

  // Equal units, or a large unit that two classes would not make cheaper, keep one class.
  std::vector<ParamSpec> equal;
  for (int l = 0; l < L; ++l) {
    equal.push_back({"l" + std::to_string(l) + ".w", {S}, "l" + std::to_string(l)});
  }
  auto flat = MakePlan(equal, o);
  REQUIRE(flat.ok());
  CHECK(flat->Find(BufferClass::kGatherBuffer)->slot_elements.empty());
  CHECK(flat->Find(BufferClass::kGradBucket)->slot_elements.empty());
  CHECK(flat->Find(BufferClass::kGradBucket)->elements == 2 * s);
  // Two of the largest size fill both buckets of the large class: a third class of one
  // smaller unit would only add a bucket.
  const std::vector<ParamSpec> three = {{"a", {S}, "a"}, {"b", {S}, "b"}, {"c", {S - 500}, "c"}};
  o.stage = 2;
  auto p = MakePlan(three, o);
  REQUIRE(p.ok());
  CHECK(p->Find(BufferClass::kGradBucket)->slot_elements.empty());
  CHECK(p->Find(BufferClass::kGradBucket)->elements == 2 * s);
}

TEST_CASE("Planner: offload moves optimizer state to host memory", "[memory]") {
  std::vector<ParamSpec> specs = {{"w", {1 << 20}, "m"}};
  PlanOptions o;
  o.stage = 2;
  o.world_size = 4;
  o.offload_optimizer = true;
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  CHECK(plan->Find(BufferClass::kMaster)->kind == MemoryKind::kPinnedHost);
  CHECK(plan->Find(BufferClass::kOffloadStaging)->count == 4);
  // master, m, v and the bf16 reduced gradient shard (gradient offload) with its norm
  // partials and flags (8 bytes a unit), and the chunks.
  CHECK(plan->pinned_host_bytes() == 14 * plan->shard_elements +
                                         8 * static_cast<int64_t>(plan->units.size()) +
                                         plan->Find(BufferClass::kOffloadStaging)->bytes);
  CHECK(plan->model_state_bytes == ClosedForm(2, true, plan->padded_elements, 4));
  o.pin_memory = false;
  auto pageable = MakePlan(specs, o);
  REQUIRE(pageable.ok());
  CHECK(pageable->Find(BufferClass::kMaster)->kind == MemoryKind::kPageableHost);
}

// Bytes of the buffers of class `cls` in memory kind `kind`.
int64_t BytesOf(const Plan& plan, BufferClass cls, MemoryKind kind) {
  int64_t bytes = 0;
  for (const Buffer& b : plan.buffers) {
    if (b.cls == cls && b.kind == kind) bytes += b.bytes;
  }
  return bytes;
}

// The options of the offload tests' cases: rank 1 of 4, units of about 20000 elements, units
// under 1000 elements persistent; no offload yet.
PlanOptions OffloadCaseOptions(int stage, DType dtype, bool fp32_accum, int gas) {
  PlanOptions o;
  o.stage = stage;
  o.world_size = 4;
  o.rank = 1;
  o.compute_dtype = dtype;
  o.fp32_grad_accum = fp32_accum;
  o.gradient_accumulation_steps = gas;
  o.unit_target_elements = 20000;
  o.persistence_threshold = 1000;
  return o;
}

TEST_CASE("Plan: gradient offload keeps the reduced shard in host memory, the device only "
          "the reduction buffers", "[memory]") {
  std::mt19937 rng(26);
  const std::vector<ParamSpec> specs = RandomModel(rng, 12, 300);
  for (int stage = 1; stage <= 3; ++stage) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (bool fp32_accum : {false, true}) {
        for (int gas : {1, 2}) {
          if (fp32_accum && dtype == DType::kF32) continue;
          INFO("stage " << stage << " " << DTypeName(dtype) << " fp32_accum " << fp32_accum
                        << " gas " << gas);
          PlanOptions o = OffloadCaseOptions(stage, dtype, fp32_accum, gas);
          auto on_device = MakePlan(specs, o);
          o.offload_optimizer = true;
          auto offloaded = MakePlan(specs, o);
          REQUIRE(on_device.ok());
          REQUIRE(offloaded.ok());
          const int64_t S = offloaded->shard_elements;
          const int64_t gb = fp32_accum ? 4 : static_cast<int64_t>(DTypeSize(dtype));
          const int64_t shard_bytes = S * gb;
          // Where the reduced shard was on the device: grad_shard (stages 2-3), or the stage-1
          // accumulator when one was needed (accumulation, or fp32 results).
          const BufferClass reduced_cls =
              stage == 1 ? BufferClass::kGradAccumulator : BufferClass::kGrads;
          const int64_t was_on_device = BytesOf(*on_device, reduced_cls, MemoryKind::kDevice);
          CHECK(was_on_device == (stage >= 2 || gas > 1 || fp32_accum ? shard_bytes : 0));
          // Now in host memory, whole, also at stage 1 without accumulation.
          CHECK(BytesOf(*offloaded, reduced_cls, MemoryKind::kDevice) == 0);
          CHECK(BytesOf(*offloaded, reduced_cls, MemoryKind::kPinnedHost) == shard_bytes);
          // The device writes each unit's norm partial and flag into pinned memory.
          REQUIRE(offloaded->Find(BufferClass::kNormPartials) != nullptr);
          CHECK(offloaded->Find(BufferClass::kNormPartials)->kind == MemoryKind::kPinnedHost);
          CHECK(offloaded->Find(BufferClass::kNormPartials)->bytes ==
                8 * static_cast<int64_t>(offloaded->units.size()));
          CHECK(on_device->Find(BufferClass::kNormPartials) == nullptr);
          // With accumulation, one unit's shard on the device to add in.
          const Buffer* stage_buf = offloaded->Find(BufferClass::kGradAccumStage);
          if (gas == 1) {
            CHECK(stage_buf == nullptr);
          } else {
            REQUIRE(stage_buf != nullptr);
            CHECK(stage_buf->kind == MemoryKind::kDevice);
            int64_t largest = 0;
            for (const Unit& u : offloaded->units) largest = std::max(largest, u.shard);
            CHECK(stage_buf->bytes == largest * gb);
          }
          // The device drops exactly the optimizer state and the reduced shard; what remains
          // is the reduction buffers (buckets / full gradients, wire), parameters, norm table.
          int64_t optimizer_on_device = 0;
          for (BufferClass c : {BufferClass::kMaster, BufferClass::kExpAvg, BufferClass::kExpAvgSq}) {
            optimizer_on_device += BytesOf(*on_device, c, MemoryKind::kDevice);
          }
          CHECK(offloaded->device_bytes() ==
                on_device->device_bytes() - optimizer_on_device - was_on_device +
                    (stage_buf == nullptr ? 0 : stage_buf->bytes));
          // Host transfers: the shard down per micro-step, the sum up per later micro-step,
          // the compute-dtype parameters up once.
          CHECK(offloaded->host_transfer_bytes_per_step ==
                (2 * gas - 1) * shard_bytes + S * static_cast<int64_t>(DTypeSize(dtype)));
        }
      }
    }
  }
  // The staging chunks carry parameter shards only, and none when AdamW writes them in host
  // memory (offload_param "cpu").
  PlanOptions o;
  o.stage = 3;
  o.world_size = 4;
  o.offload_optimizer = true;
  o.unit_target_elements = 20000;
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  const Buffer* staging = plan->Find(BufferClass::kOffloadStaging);
  REQUIRE(staging != nullptr);
  CHECK(staging->bytes == staging->count * (plan->max_unit_elements / 4) * 2);
  o.offload_param = true;
  plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  CHECK(plan->Find(BufferClass::kOffloadStaging) == nullptr);
}

// The units a ratio keeps on the device, computed here apart from the planner: trainable
// units in layout order, each kept while the kept shards stay within floor((1 - ratio) x St).
std::vector<bool> KeptUnits(const Plan& plan, double ratio) {
  const int64_t St = plan.trainable_shard_elements;
  const int64_t limit = static_cast<int64_t>(std::floor((1 - ratio) * static_cast<double>(St)));
  std::vector<bool> kept(plan.units.size(), false);
  int64_t sum = 0;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    if (plan.units[u].frozen || sum + plan.units[u].shard > limit) continue;
    kept[u] = true;
    sum += plan.units[u].shard;
  }
  return kept;
}

TEST_CASE("Plan: offload_optimizer_ratio keeps whole units' state on the device; every part's "
          "bytes equal a closed form", "[memory]") {
  std::mt19937 rng(126);
  const std::vector<ParamSpec> specs = RandomModel(rng, 14, 300);
  for (int stage = 1; stage <= 3; ++stage) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (bool fp32_accum : {false, true}) {
        for (int gas : {1, 2}) {
          for (bool nvme : {false, true}) {
            if (fp32_accum && dtype == DType::kF32) continue;
            PlanOptions o = OffloadCaseOptions(stage, dtype, fp32_accum, gas);
            auto none = MakePlan(specs, o);
            o.offload_optimizer = true;
            o.offload_optimizer_nvme = nvme;
            auto full = MakePlan(specs, o);
            REQUIRE(none.ok());
            REQUIRE(full.ok());
            REQUIRE(full->units.size() > 4);
            const bool mixed = dtype != DType::kF32;
            const int64_t St = full->trainable_shard_elements;
            const int64_t cb = static_cast<int64_t>(DTypeSize(dtype));
            const int64_t gb = fp32_accum ? 4 : cb;
            // Bytes per element of each part: master (device: mixed precision only; offloaded:
            // always), m, v, and the reduced gradient it keeps apart (stages 2-3: the shard;
            // stage 1: the accumulator, always when offloaded, else only when accumulating or
            // in fp32).
            const int64_t device_grad = stage >= 2 || gas > 1 || fp32_accum ? gb : 0;
            const int64_t per_device = (mixed ? 12 : 8) + device_grad;
            const int64_t per_offloaded = 12 + gb;
            for (double ratio : {0.0, 0.3, 0.5, 0.7, 0.999, 1.0}) {
              INFO("stage " << stage << " " << DTypeName(dtype) << " fp32_accum " << fp32_accum
                            << " gas " << gas << (nvme ? " nvme" : " cpu") << " ratio "
                            << ratio);
              o.offload_optimizer_ratio = ratio;
              auto plan = MakePlan(specs, o);
              REQUIRE(plan.ok());
              const std::vector<bool> kept = KeptUnits(*plan, ratio);
              int64_t Sd = 0, largest_offloaded = 0, nvme_copy = 0, largest_piece = 0;
              for (size_t u = 0; u < plan->units.size(); ++u) {
                const Unit& unit = plan->units[u];
                CHECK(unit.offloaded == !kept[u]);
                if (kept[u]) {
                  CHECK(unit.state_offset == Sd);  // the kept part is dense, in unit order
                  Sd += unit.shard;
                } else {
                  CHECK(unit.state_offset == unit.shard_offset - Sd);
                  largest_offloaded = std::max(largest_offloaded, unit.padded);
                  const int64_t array = (unit.shard * 4 + 4095) / 4096 * 4096;
                  nvme_copy += 3 * array;
                  largest_piece = std::max(largest_piece, 3 * array);
                }
              }
              const int64_t Sh = St - Sd;
              CHECK(plan->device_state_elements == Sd);
              CHECK(plan->offloaded_state_elements == Sh);
              CHECK(Sd <= static_cast<int64_t>((1 - ratio) * St));
              CHECK(plan->offload_ratio_achieved() >= ratio);
              CHECK(plan->offload_ratio_achieved() == static_cast<double>(Sh) / St);
              CHECK(plan->device_state_bytes == per_device * Sd);
              CHECK(plan->offloaded_state_bytes == per_offloaded * Sh);
              // Device memory: the plan without offload, less the offloaded units' part, plus
              // gradient offload's accumulation stage (one offloaded unit's shard).
              const int64_t stage_buf = gas > 1 ? largest_offloaded / 4 * gb : 0;
              CHECK(plan->device_bytes() ==
                    none->device_bytes() - per_device * Sh + stage_buf);
              // Host memory: the offloaded part (in files with nvme, through three slots), the
              // staging chunks for its parameter shards, the norm partials.
              const int64_t chunks = 4 * (largest_offloaded / 4) * cb;
              const int64_t partials = Sh > 0 ? 8 * static_cast<int64_t>(plan->units.size()) : 0;
              const int64_t in_host = nvme ? gb * Sh : per_offloaded * Sh;
              CHECK(plan->pinned_host_bytes() ==
                    in_host + chunks + partials + (nvme && Sh > 0 ? 3 * largest_piece : 0));
              CHECK(plan->nvme_bytes() == (nvme ? 2 * nvme_copy : 0));
              CHECK(plan->host_transfer_bytes_per_step == (2 * gas - 1) * Sh * gb + Sh * cb);
              // Every byte of model state is in one part or the other (or params / full grads).
              // (fp32 training keeps no master for the units on the device.)
              CHECK(plan->model_state_bytes == full->model_state_bytes - (mixed ? 0 : 4 * Sd));
              // The two ends are the plans without offload and with all of it, buffer for
              // buffer (names included: one part keeps the plain names).
              if (ratio == 0.0 || ratio == 1.0) {
                const Plan& same = ratio == 0.0 ? *none : *full;
                REQUIRE(plan->buffers.size() == same.buffers.size());
                for (size_t b = 0; b < same.buffers.size(); ++b) {
                  CHECK(plan->buffers[b].name == same.buffers[b].name);
                  CHECK(plan->buffers[b].kind == same.buffers[b].kind);
                  CHECK(plan->buffers[b].bytes == same.buffers[b].bytes);
                }
              }
              if (Sd > 0 && Sh > 0) {  // both parts: the device part's names say so
                bool named = false;
                for (const Buffer& b : plan->buffers) named = named || b.name == "exp_avg_device";
                CHECK(named);
              }
            }
          }
        }
      }
    }
  }
  // A ratio is the least that is offloaded: 0.5 offloads at least half, whole units.
  PlanOptions o;
  o.stage = 2;
  o.world_size = 3;
  o.unit_target_elements = 20000;
  o.offload_optimizer = true;
  o.offload_optimizer_ratio = 0.5;
  auto half = MakePlan(specs, o);
  REQUIRE(half.ok());
  CHECK(half->offload_ratio_achieved() >= 0.5);
  CHECK(half->offload_ratio_achieved() < 1);
  // Without offload_optimizer the ratio is not read.
  o.offload_optimizer = false;
  auto plain = MakePlan(specs, o);
  REQUIRE(plain.ok());
  CHECK(plain->offloaded_state_elements == 0);
  CHECK(plain->offload_ratio_achieved() == 0);
}

TEST_CASE("Planner: bad input is an error naming the problem", "[memory]") {
  std::vector<ParamSpec> ok_specs = {{"w", {4, 4}, "m"}};
  PlanOptions o;
  auto expect = [](const absl::StatusOr<Plan>& plan, const std::string& needle) {
    REQUIRE_FALSE(plan.ok());
    CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(plan.status().message()), Catch::Contains(needle));
  };
  expect(MakePlan({}, o), "no parameters");
  expect(MakePlan({{"w", {4, 0}, "m"}}, o), "'w' dimension 1 is 0");
  expect(MakePlan({{"w", {}, "m"}}, o), "empty shape");
  expect(MakePlan({{"w", {2}, "m"}, {"w", {3}, "n"}}, o), "'w' is registered twice");
  PlanOptions bad = o;
  bad.stage = 4;
  expect(MakePlan(ok_specs, bad), "stage = 4");
  bad = o;
  bad.world_size = 4;
  bad.rank = 4;
  expect(MakePlan(ok_specs, bad), "rank = 4");
  bad = o;
  bad.stage = 2;
  bad.offload_param = true;
  expect(MakePlan(ok_specs, bad), "offload_param requires stage 3");
  for (double ratio : {-0.5, 1.5, std::nan("")}) {
    bad = o;
    bad.stage = 2;
    bad.offload_optimizer = true;
    bad.offload_optimizer_ratio = ratio;
    expect(MakePlan(ok_specs, bad), "offload_optimizer_ratio (offload_optimizer.ratio) = ");
  }
}

TEST_CASE("Planner: communication bytes per step follow the stage", "[memory]") {
  std::vector<ParamSpec> specs = {{"w", {1 << 16}, "m"}};
  PlanOptions o;
  o.world_size = 8;
  o.persistence_threshold = 0;
  int64_t bytes[4];
  for (int stage = 0; stage < 4; ++stage) {
    o.stage = stage;
    auto plan = MakePlan(specs, o);
    REQUIRE(plan.ok());
    bytes[stage] = plan->comm_bytes_per_step;
  }
  const int64_t one_pass = (1 << 16) / 8 * 7 * 2;  // (n-1)/n of the bf16 buffer
  CHECK(bytes[0] == 2 * one_pass + ControlBytes(8, 1, 0));  // all-reduce
  CHECK(bytes[1] == 2 * one_pass + ControlBytes(8, 1, 1));  // reduce-scatter + all-gather
  CHECK(bytes[2] == 2 * one_pass + ControlBytes(8, 1, 2));
  // Gather for forward + reduce-scatter: backward finds the one unit still in its slot.
  CHECK(bytes[3] == 2 * one_pass + ControlBytes(8, 1, 3));
}

TEST_CASE("Planner: fp32 gradient accumulation and reduction count their bytes", "[memory]") {
  std::vector<ParamSpec> specs = {{"a", {1 << 12}, "a"}, {"b", {1 << 12}, "b"}};
  PlanOptions o;
  o.world_size = 8;
  o.persistence_threshold = 0;
  o.unit_target_elements = 1 << 12;  // one unit per parameter
  const int64_t E = 2 << 12, S = E / 8, unit = 1 << 12;
  const int64_t pass = E / 8 * 7;  // elements sent per collective over all units
  for (int stage = 0; stage < 4; ++stage) {
    CAPTURE(stage);
    o.stage = stage;
    o.fp32_grad_accum = o.fp32_grad_comm = false;
    auto base = MakePlan(specs, o);
    REQUIRE(base.ok());
    CHECK(base->Find(BufferClass::kGradWire) == nullptr);
    o.fp32_grad_accum = true;
    auto acc = MakePlan(specs, o);
    REQUIRE(acc.ok());
    // The reduced gradients become fp32: the stage 0-1 accumulator appears (even at gas 1),
    // the stage 2-3 shard doubles; the scratch holds one reduced block (stage 0: a unit).
    const int64_t reduced = stage == 0 ? E : S;
    if (stage <= 1) {
      REQUIRE(acc->Find(BufferClass::kGradAccumulator) != nullptr);
      CHECK(acc->Find(BufferClass::kGradAccumulator)->bytes == 4 * reduced);
    } else {
      CHECK(acc->Find(BufferClass::kGrads)->bytes == 4 * S);
    }
    REQUIRE(acc->Find(BufferClass::kGradWire) != nullptr);
    CHECK(acc->Find(BufferClass::kGradWire)->bytes == 4 * (stage == 0 ? unit : unit / 8));
    CHECK(acc->comm_bytes_per_step == base->comm_bytes_per_step);
    o.fp32_grad_accum = false;
    o.fp32_grad_comm = true;
    auto wire = MakePlan(specs, o);
    REQUIRE(wire.ok());
    CHECK(wire->Find(BufferClass::kGradWire)->bytes == 4 * unit);
    // Gradient reductions move 4 bytes per element instead of 2.
    const int64_t reductions = stage == 0 ? 2 : 1;
    CHECK(wire->comm_bytes_per_step - base->comm_bytes_per_step == reductions * pass * 2);
  }
  // With optimizer offload the fp32 gradients are staged as they are (zero/planner_test).
  o.stage = 2;
  o.fp32_grad_accum = true;
  o.offload_optimizer = true;
  CHECK(MakePlan(specs, o).ok());
}

// `count` one-parameter modules of `numel` elements each.
std::vector<ParamSpec> EqualModules(int count, int64_t numel) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < count; ++i) {
    const std::string m = "m" + std::to_string(i);
    specs.push_back({m + ".w", {numel}, m});
  }
  return specs;
}

void ExpectTooLarge(const absl::StatusOr<Plan>& plan, const std::string& quantity) {
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(plan.status().message()),
             Catch::Contains("the plan's " + quantity + " exceeds 2^63-1"));
}

TEST_CASE("Planner: sizes at the int64 boundary are exact or refused, never wrapped", "[memory]") {
  constexpr int64_t k2p50 = int64_t{1} << 50;  // the largest parameter Numel accepts
  PlanOptions o;
  o.compute_dtype = DType::kF32;  // 16 bytes per element at stage 0: params, grads, m, v
  // 511 * 2^50 elements * 16 B = 2^63 - 2^54: fits, and every total is the exact product.
  auto fits = MakePlan(EqualModules(511, k2p50), o);
  REQUIRE(fits.ok());
  const __int128 E = static_cast<__int128>(511) * k2p50;
  CHECK(fits->num_elements == static_cast<int64_t>(E));
  CHECK(static_cast<__int128>(fits->device_bytes()) == 16 * E);
  CHECK(static_cast<__int128>(fits->model_state_bytes) == 16 * E);
  // 512 * 2^50 * 16 B = 2^63: the fourth 2^61-byte buffer overflows the device total.
  ExpectTooLarge(MakePlan(EqualModules(512, k2p50), o), "device bytes");
  // 8192 * 2^50 = 2^63 elements: the count itself overflows (it used to print as negative).
  ExpectTooLarge(MakePlan(EqualModules(8192, k2p50), o), "parameter count");
  o.compute_dtype = DType::kBF16;
  ExpectTooLarge(MakePlan(EqualModules(8191, k2p50), o), "params buffer size");
}

TEST_CASE("Planner: gradient_accumulation_steps 2^31-1 gives exact or refused comm bytes",
          "[memory]") {
  PlanOptions o;
  o.world_size = 2;
  o.gradient_accumulation_steps = 2147483647;
  auto small = MakePlan({{"w", {1024}, "m"}}, o);
  REQUIRE(small.ok());
  // All-reduce: 2 passes of (n-1)/n of 1024 bf16 elements per micro-step; the control exchange
  // once per step.
  CHECK(small->comm_bytes_per_step ==
        int64_t{2147483647} * 2 * (1024 / 2 * 2) + ControlBytes(2, 1, 0));
  ExpectTooLarge(MakePlan({{"w", {int64_t{1} << 40}, "m"}}, o), "communication bytes per step");
  o.stage = 3;
  o.offload_optimizer = o.offload_param = true;
  ExpectTooLarge(MakePlan({{"w", {int64_t{1} << 40}, "m"}}, o), "communication bytes per step");
  auto transfer = MakePlan({{"w", {1024}, "m"}}, o);
  REQUIRE(transfer.ok());
  // Each rank owns 512 of the 1024 elements: the gradient shard down in every micro-step and
  // its running sum up in all but the first (gradient offload), the parameters up once per
  // step, and the parameter shard up twice in every micro-step; 2 bytes each (bf16).
  const int64_t gas = 2147483647, shard = 512 * 2, both_ways = 2 * shard;
  CHECK(transfer->host_transfer_bytes_per_step == (2 * gas - 1) * shard + shard + gas * both_ways);
  // Stage 1 with local accumulation reduces once per window: its shard goes down once.
  o.stage = 1;
  o.offload_param = false;
  o.gradient_accumulation_steps = 4;
  o.local_grad_accumulation = true;
  auto local = MakePlan({{"w", {1024}, "m"}}, o);
  REQUIRE(local.ok());
  CHECK(local->host_transfer_bytes_per_step == shard + shard);
}

TEST_CASE("Planner: a prefetch of INT64_MAX elements gathers every unit it may", "[memory]") {
  PlanOptions o;
  o.stage = 3;
  o.world_size = 2;
  o.persistence_threshold = 0;
  o.unit_target_elements = 1000;
  o.prefetch_elements = std::numeric_limits<int64_t>::max();
  auto plan = MakePlan(EqualModules(6, 1000), o);
  REQUIRE(plan.ok());
  REQUIRE(plan->units.size() == 6);
  // max_live_elements (1e9) allows all six; 1 + ceil(prefetch / unit) used to wrap to 1.
  CHECK(plan->gather_slots == 6);
  o.max_live_elements = 3 * 1024;
  auto capped = MakePlan(EqualModules(6, 1000), o);
  REQUIRE(capped.ok());
  CHECK(capped->gather_slots == 3);  // 3072 live elements / 1024-element units
}

TEST_CASE("Planner: a world of 2^31-1 ranks plans exactly; huge alignments are refused",
          "[memory]") {
  PlanOptions o;
  o.stage = 3;
  o.world_size = std::numeric_limits<int>::max();
  o.rank = o.world_size - 1;
  o.persistence_threshold = 0;
  o.unit_target_elements = 4096;
  auto plan = MakePlan(EqualModules(3, 4096), o);
  REQUIRE(plan.ok());
  // Each unit is padded to world * 128 elements, so every rank owns 128 of each.
  CHECK(plan->shard_elements == 3 * 128);
  CHECK(plan->padded_elements == int64_t{3} * 128 * o.world_size);
  CHECK(plan->comm_bytes_per_step > 0);
  o.shard_alignment = std::numeric_limits<int64_t>::max() / 2;
  ExpectTooLarge(MakePlan(EqualModules(3, 4096), o), "shard alignment");
  o.shard_alignment = 128;
  o.param_alignment = std::numeric_limits<int64_t>::max();
  ExpectTooLarge(MakePlan({{"a", {3}, "m"}, {"b", {3}, "m"}}, o), "unit size");
}

// World 3, units of up to 200000 elements: several units for RandomModel(rng, 9, 700).
PlanOptions ThreeRanks(int stage, int rank) {
  PlanOptions o;
  o.stage = stage;
  o.world_size = 3;
  o.rank = rank;
  o.unit_target_elements = 200000;
  return o;
}

TEST_CASE("Plan: NVMe offload puts two padded copies of master, m, v in files", "[memory]") {
  std::mt19937 rng(11);
  const std::vector<ParamSpec> specs = RandomModel(rng, 9, 700);
  PlanOptions o = ThreeRanks(2, 1);
  o.offload_optimizer = true;
  o.offload_optimizer_nvme = true;
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  REQUIRE(plan->units.size() > 2);
  int64_t copy = 0, largest = 0;  // an independent sum over units, each array padded to 4 KiB
  for (const Unit& u : plan->units) {
    const int64_t array = (u.shard * 4 + 4095) / 4096 * 4096;
    copy += 3 * array;
    largest = std::max(largest, 3 * array);
  }
  for (BufferClass c : {BufferClass::kMaster, BufferClass::kExpAvg, BufferClass::kExpAvgSq}) {
    CHECK(plan->Find(c)->kind == MemoryKind::kNvme);
    CHECK(plan->Find(c)->bytes == 4 * plan->shard_elements);
  }
  CHECK(plan->nvme_bytes() == 2 * copy);
  CHECK(plan->nvme_bytes() % 4096 == 0);
  CHECK(plan->Find(BufferClass::kNvmeStaging)->bytes == 3 * largest);
  CHECK(plan->Find(BufferClass::kNvmeStaging)->count == 3);
  // Gradient offload: the reduced shard goes to host memory, then the pipeline.
  CHECK(plan->Find(BufferClass::kGrads)->kind == MemoryKind::kPinnedHost);
  CHECK(plan->pinned_host_bytes() == plan->Find(BufferClass::kOffloadStaging)->bytes +
                                         plan->Find(BufferClass::kNvmeStaging)->bytes +
                                         plan->Find(BufferClass::kGrads)->bytes +
                                         plan->Find(BufferClass::kNormPartials)->bytes);
  CHECK(std::string(MemoryKindName(MemoryKind::kNvme)) == "nvme");
  // Pieces of at most 1024 elements: the slots shrink to one piece, the file pads each piece.
  CHECK(NvmePieces(2500, 1024) == std::vector<int64_t>({1024, 1024, 452}));
  CHECK(NvmePieces(2500, 3000) == std::vector<int64_t>({2048, 452}));  // down to a multiple of 1024
  CHECK(NvmePieces(2500, 0) == std::vector<int64_t>({2500}));
  PlanOptions pieces = o;
  pieces.nvme_piece_elements = 1024;
  auto small = MakePlan(specs, pieces);
  REQUIRE(small.ok());
  int64_t piece_copy = 0;
  for (const Unit& u : small->units) {
    for (int64_t left = u.shard; left > 0; left -= 1024) {
      piece_copy += 3 * ((std::min<int64_t>(left, 1024) * 4 + 4095) / 4096 * 4096);
    }
  }
  CHECK(small->nvme_bytes() == 2 * piece_copy);
  CHECK(small->Find(BufferClass::kNvmeStaging)->bytes == 3 * 3 * 4096);
  // The model state is the same as with CPU offload: only its place differs.
  o.offload_optimizer_nvme = false;
  auto cpu = MakePlan(specs, o);
  REQUIRE(cpu.ok());
  CHECK(cpu->model_state_bytes == plan->model_state_bytes);
  CHECK(cpu->nvme_bytes() == 0);
  o.offload_optimizer = false;
  o.offload_optimizer_nvme = true;
  CHECK(MakePlan(specs, o).status().message().find("offload_optimizer_nvme") != std::string::npos);
}

TEST_CASE("Plan: NVMe parameter offload without optimizer offload counts the file and buffers",
          "[memory]") {
  std::mt19937 rng(17);
  const std::vector<ParamSpec> specs = RandomModel(rng, 9, 700);
  PlanOptions o = ThreeRanks(3, 2);
  o.offload_param = true;
  o.offload_param_nvme = true;  // the optimizer step on the device
  o.offload_param_buffer_count = 3;
  o.nvme_piece_elements = 2048;  // bf16: one 4 KiB page per buffer
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  REQUIRE(plan->units.size() > 2);
  int64_t file = 0;  // an independent sum: each unit's bf16 shard padded to 4 KiB
  for (const Unit& u : plan->units) file += (u.shard * 2 + 4095) / 4096 * 4096;
  CHECK(plan->Find(BufferClass::kParams)->kind == MemoryKind::kNvme);
  CHECK(plan->Find(BufferClass::kParams)->bytes == 2 * plan->shard_elements);
  CHECK(plan->nvme_bytes() == file);
  CHECK(plan->Find(BufferClass::kNvmeParamBuffers)->count == 3);
  CHECK(plan->pinned_host_bytes() == 3 * 4096);  // the buffers are all the host memory
  CHECK(plan->host_bytes() == 0);
  for (BufferClass c : {BufferClass::kMaster, BufferClass::kExpAvg, BufferClass::kExpAvgSq}) {
    CHECK(plan->Find(c)->kind == MemoryKind::kDevice);
  }
  CHECK(plan->Find(BufferClass::kOffloadStaging) == nullptr);
  // The device holds the same as with the shard in host memory, minus nothing else.
  PlanOptions host = o;
  host.offload_param_nvme = false;
  auto in_host = MakePlan(specs, host);
  REQUIRE(in_host.ok());
  CHECK(in_host->device_bytes() == plan->device_bytes());
  CHECK(in_host->nvme_bytes() == 0);
  // fp32: AdamW cannot update a shard in a file in place, so there is a device master.
  o.compute_dtype = DType::kF32;
  auto fp32 = MakePlan(specs, o);
  REQUIRE(fp32.ok());
  REQUIRE(fp32->Find(BufferClass::kMaster) != nullptr);
  CHECK(fp32->Find(BufferClass::kMaster)->kind == MemoryKind::kDevice);
  o.offload_param = false;
  CHECK(MakePlan(specs, o).status().message().find("offload_param_nvme") != std::string::npos);
}

}  // namespace
}  // namespace memory
}  // namespace zerort

namespace zerort {
namespace memory {
namespace {

TEST_CASE("Planner: declared activation bytes add up per unit and per plan, outside the buffers",
          "[memory]") {
  std::mt19937 rng(7);
  std::vector<ParamSpec> specs = RandomModel(rng, 40, 64);
  std::uniform_int_distribution<int64_t> bytes(0, 1 << 20);
  int64_t total = 0;
  for (ParamSpec& s : specs) {
    s.activation_bytes_per_sample = bytes(rng);
    total += s.activation_bytes_per_sample;
  }
  PlanOptions o;
  o.stage = 2;
  o.world_size = 4;
  o.unit_target_elements = 2000;  // several units, some merged modules
  absl::StatusOr<Plan> plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  REQUIRE(plan->units.size() > 3);
  CHECK(plan->activation_bytes_per_sample == total);
  for (const Unit& u : plan->units) {
    int64_t unit_total = 0;
    for (int i : u.params) unit_total += specs[i].activation_bytes_per_sample;
    CHECK(u.activation_bytes_per_sample == unit_total);
  }
  // Activations are the trainer's allocations, not the engine's: the buffers do not change.
  std::vector<ParamSpec> undeclared = specs;
  for (ParamSpec& s : undeclared) s.activation_bytes_per_sample = 0;
  absl::StatusOr<Plan> bare = MakePlan(undeclared, o);
  REQUIRE(bare.ok());
  CHECK(bare->activation_bytes_per_sample == 0);
  for (int k = 0; k < kNumMemoryKinds; ++k) CHECK(bare->bytes_by_kind[k] == plan->bytes_by_kind[k]);

  specs[3].activation_bytes_per_sample = -1;
  absl::StatusOr<Plan> bad = MakePlan(specs, o);
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.status().message() ==
        "parameter '" + specs[3].name +
            "': activation_bytes_per_sample = -1 is negative: expected >= 0 bytes");
}

TEST_CASE("Planner: HSDP shards within the group and counts bytes per link class",
          "[memory][hsdp]") {
  // One 4096-element unit (a multiple of 8 * 128: no padding) on 8 ranks, groups of 4.
  std::vector<ParamSpec> specs = {{"w", {64, 64}, "m"}};
  PlanOptions o;
  o.stage = 3;
  o.world_size = 8;
  o.rank = 5;  // group 1, shard 1
  o.persistence_threshold = 0;
  o.compute_dtype = DType::kBF16;
  auto flat = MakePlan(specs, o);
  o.shard_group_size = 4;
  auto hsdp = MakePlan(specs, o);
  REQUIRE(flat.ok());
  REQUIRE(hsdp.ok());
  CHECK(hsdp->padded_elements == 4096);
  CHECK(hsdp->shard_elements == 1024);  // 4096 / 4, twice flat's 512
  CHECK(flat->shard_elements == 512);
  // Per rank: params, gradient and fp32 master + m + v of the 1024-element shard.
  CHECK(hsdp->model_state_bytes == 1024 * (2 + 2 + 12));
  // Within the group, bf16: the forward gather 3/4 x 4096 x 2 B (backward finds the one unit
  // still in its slot), the gradient reduce-scatter 3/4 x 4096 x 2 B; across the 2 groups, the
  // all-reduce of the 1024-element shard: 2 x 1/2 x 1024 x 2 B; the control exchange over the
  // world apart.
  CHECK(hsdp->comm_bytes_within_group_per_step == 2 * 3072 * 2);
  CHECK(hsdp->comm_bytes_across_groups_per_step == 2048);
  CHECK(hsdp->comm_control_bytes_per_step == ControlBytes(8, 1, 3));
  CHECK(hsdp->comm_bytes_per_step == 2 * 3072 * 2 + 2048 + ControlBytes(8, 1, 3));
  // Flat: everything within the one group, (7/8) of each collective.
  CHECK(flat->comm_bytes_within_group_per_step == 2 * 3584 * 2);
  CHECK(flat->comm_bytes_across_groups_per_step == 0);
  CHECK(flat->comm_bytes_per_step ==
        flat->comm_bytes_within_group_per_step + ControlBytes(8, 1, 3));

  // Gradient offload's per-unit buffers hold a group shard (1024 elements), not a flat one.
  {
    PlanOptions g = o;
    g.offload_optimizer = true;
    g.gradient_accumulation_steps = 2;
    for (int stage = 1; stage <= 3; ++stage) {
      INFO("stage " << stage);
      g.stage = stage;
      auto off = MakePlan(specs, g);
      REQUIRE(off.ok());
      const Buffer* accum_stage = off->Find(BufferClass::kGradAccumStage);
      REQUIRE(accum_stage != nullptr);
      CHECK(accum_stage->elements == 1024);
      const Buffer* staging = off->Find(BufferClass::kOffloadStaging);
      REQUIRE(staging != nullptr);
      CHECK(staging->elements == staging->count * 1024);
      // The 1024-element shard down twice and up once (the running sum), parameters up once.
      CHECK(off->host_transfer_bytes_per_step == 3 * 1024 * 2 + 1024 * 2);
    }
  }

  for (int bad : {3, 16, -1}) {
    o.shard_group_size = bad;
    auto refused = MakePlan(specs, o);
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  }
  o.shard_group_size = 4;
  o.stage = 0;
  CHECK(MakePlan(specs, o).status().code() == absl::StatusCode::kInvalidArgument);
}

// llm.c's CPU GPT-2 (L = 4, C = 128, V = 50304, 64 positions) as its trainer holds it.
std::vector<ParamSpec> LlmcTensors(const std::string& buffer = "grads") {
  return memory::testing::LlmcTensors(/*L=*/4, /*C=*/128, /*V=*/50304, /*T=*/64, buffer);
}

// The options of the llm.c hand-off cases: fp32, world 2, a unit per module, `stage`.
PlanOptions LlmcOptions(int stage) {
  PlanOptions o;
  o.compute_dtype = DType::kF32;
  o.world_size = 2;
  o.unit_per_module = true;
  o.stage = stage;
  return o;
}

const Unit& UnitOf(const Plan& plan, const std::string& param) {
  for (const ParamLayout& p : plan.params) {
    if (p.name == param) return plan.units[p.unit];
  }
  FAIL("no parameter " << param);
  return plan.units[0];
}

TEST_CASE("Plan: gradients declared in the trainer's buffer are reduced in place where the "
          "layout allows, and get no storage of the engine's",
          "[memory]") {
  PlanOptions o = LlmcOptions(2);
  const std::vector<ParamSpec> declared = LlmcTensors();
  auto plan = MakePlan(declared, o);
  REQUIRE(plan.ok());
  CHECK(plan->grad_buffers == std::vector<std::string>{"grads"});
  // Every tensor but the last fills a multiple of 2 x 128 elements, or (lnfw) its padding lies
  // over lnfb's gradient; lnfb's padding would run past the buffer's end.
  const GradHandoff& h = plan->grad_handoff;
  CHECK(h.tensors == 16);
  CHECK(h.tensors_in_place == 15);
  CHECK(h.bytes == 7240448 * 4);
  CHECK(h.bytes_copied == 128 * 4);
  CHECK(UnitOf(*plan, "wte").grad_source == GradSource::kInPlace);
  const Unit& lnfw = UnitOf(*plan, "lnfw");
  CHECK(lnfw.grad_source == GradSource::kInPlace);
  REQUIRE(lnfw.grad_room_params.size() == 1);
  CHECK(plan->params[lnfw.grad_room_params[0]].name == "lnfb");
  const Unit& lnfb = UnitOf(*plan, "lnfb");
  CHECK(lnfb.grad_source == GradSource::kCopied);
  CHECK_THAT(lnfb.grad_copy_reason,
             Catch::Contains("128 padding elements") &&
                 Catch::Contains("past the last gradient declared in 'grads' (element 7240447)"));
  // Stage 2: one bucket, lnfb's, instead of one of the embedding's and two of the MLP's.
  const Buffer* bucket = plan->Find(BufferClass::kGradBucket);
  REQUIRE(bucket != nullptr);
  CHECK(bucket->count == 1);
  CHECK(bucket->elements == 256);
  std::vector<ParamSpec> undeclared = declared;
  for (ParamSpec& s : undeclared) s.grad_buffer.clear();
  auto before = MakePlan(undeclared, o);
  REQUIRE(before.ok());
  CHECK(before->Find(BufferClass::kGradBucket)->elements == 6438912 + 2 * 262144);
  const int64_t shard = (7240448 + 2 * 128) / 2 * 4;  // grad_shard, fp32: lnfw, lnfb padded
  CHECK(h.engine_grad_bytes == shard + 256 * 4);
  CHECK(h.engine_grad_bytes_undeclared == shard + (6438912 + 2 * 262144) * 4);
  CHECK(before->grad_handoff.engine_grad_bytes == h.engine_grad_bytes_undeclared);
  CHECK(before->device_bytes() - plan->device_bytes() == (6438912 + 2 * 262144 - 256) * 4);

  // The layout never depends on the declaration, at any stage or world size.
  for (int stage = 0; stage <= 3; ++stage) {
    for (int world : {1, 2, 3, 5}) {
      CAPTURE(stage, world);
      o.stage = stage;
      o.world_size = world;
      auto a = MakePlan(declared, o), b = MakePlan(undeclared, o);
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      REQUIRE(a->units.size() == b->units.size());
      for (size_t u = 0; u < a->units.size(); ++u) {
        CHECK(a->units[u].padded == b->units[u].padded);
        CHECK(a->units[u].flat_offset == b->units[u].flat_offset);
      }
      for (size_t i = 0; i < a->params.size(); ++i) {
        CHECK(a->params[i].flat_offset == b->params[i].flat_offset);
      }
      CHECK(GradStorageBytes(*a) <= GradStorageBytes(*b));
      CHECK(a->grad_handoff.engine_grad_bytes_undeclared == GradStorageBytes(*b));
      CHECK(a->comm_bytes_per_step == b->comm_bytes_per_step);
    }
  }
}

TEST_CASE("Plan: stages 0-1 without accumulation keep reduced gradients in the trainer's "
          "buffer, or, with padding, stage 1 in a shard of the engine's",
          "[memory]") {
  PlanOptions o = LlmcOptions(0);
  auto plan = MakePlan(LlmcTensors(), o);
  REQUIRE(plan.ok());
  // Stage 0 would keep lnfw's whole padded unit where it is reduced: over lnfb's gradient.
  CHECK(plan->grad_handoff.tensors_in_place == 14);
  const Unit* lnfw = &UnitOf(*plan, "lnfw");
  CHECK(lnfw->grad_source == GradSource::kCopied);
  CHECK_THAT(lnfw->grad_copy_reason, Catch::Contains("keeps the whole reduced unit"));
  CHECK(ReducedInTrainerBuffer(*plan, UnitOf(*plan, "wte")));
  // The full gradients hold the two copied units only, one after the other.
  CHECK(plan->Find(BufferClass::kGrads)->elements == 2 * 256);
  CHECK(UnitOf(*plan, "lnfb").grad_offset == 0);
  CHECK(lnfw->grad_offset == 256);
  CHECK(UnitOf(*plan, "wte").grad_offset == -1);
  CHECK(plan->Find(BufferClass::kGradAccumulator) == nullptr);

  // Stage 1 keeps lnfw's reduced shard (128 elements) in grad_reduced instead.
  o.stage = 1;
  plan = MakePlan(LlmcTensors(), o);
  REQUIRE(plan.ok());
  CHECK(plan->grad_handoff.tensors_in_place == 15);
  lnfw = &UnitOf(*plan, "lnfw");
  CHECK(lnfw->grad_source == GradSource::kInPlace);
  CHECK_FALSE(ReducedInTrainerBuffer(*plan, *lnfw));
  CHECK(lnfw->grad_shard_offset == 0);
  const Buffer* reduced = plan->Find(BufferClass::kGradAccumulator);
  REQUIRE(reduced != nullptr);
  CHECK(reduced->name == "grad_reduced");
  CHECK(reduced->elements == 128);
  CHECK(plan->Find(BufferClass::kGrads)->elements == 256);  // lnfb
  CHECK(plan->grad_handoff.engine_grad_bytes == (128 + 256) * 4);

  // Unless a gradient under its padding is one that stays in the trainer's buffer.
  std::vector<ParamSpec> exact_after = {{"a.w", {200}, "a"}, {"b.w", {256}, "b"}};
  for (ParamSpec& p : exact_after) p.grad_buffer = "g";
  plan = MakePlan(exact_after, o);
  REQUIRE(plan.ok());
  CHECK(UnitOf(*plan, "b.w").grad_source == GradSource::kInPlace);
  CHECK_THAT(UnitOf(*plan, "a.w").grad_copy_reason,
             Catch::Contains("would lie over 'b.w''s gradient in 'g', which its unit keeps there "
                             "as its reduced gradient until the step (stage 1"));

  // Accumulating, the reduced gradients live in the engine's accumulator: lnfw's padding may
  // lie over lnfb's gradient, and the full gradients hold only lnfb.
  for (int stage : {0, 1}) {
    CAPTURE(stage);
    o.stage = stage;
    o.gradient_accumulation_steps = 2;
    auto accumulating = MakePlan(LlmcTensors(), o);
    REQUIRE(accumulating.ok());
    CHECK(accumulating->grad_handoff.tensors_in_place == 15);
    CHECK(accumulating->Find(BufferClass::kGrads)->elements == 256);
    CHECK(accumulating->Find(BufferClass::kGradAccumulator)->name == "grad_accumulator");
  }
}

TEST_CASE("Plan: with offload_optimizer.ratio the hand-off rule holds per unit: a padded unit "
          "is copied only where its padding lies over a result kept on the device",
          "[memory]") {
  // Unit a (200 elements, padded to 256 at world 2) lies before b (256, no padding) in one
  // buffer: a's padding lies over b's gradient. Stage 1 without accumulation keeps b's reduced
  // gradient in the trainer's buffer only where b's optimizer state stays on the device; an
  // offloaded b's reduced shard goes to host memory, so a may be reduced over it.
  std::vector<ParamSpec> specs = {{"a.w", {200}, "a"}, {"b.w", {256}, "b"}};
  for (ParamSpec& p : specs) p.grad_buffer = "g";
  PlanOptions o = LlmcOptions(1);
  o.offload_optimizer = true;
  bool saw_b_kept_a_offloaded = false, saw_b_offloaded = false, saw_all_kept = false;
  for (double ratio : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    CAPTURE(ratio);
    o.offload_optimizer_ratio = ratio;
    auto plan = MakePlan(specs, o);
    REQUIRE(plan.ok());
    const Unit& a = UnitOf(*plan, "a.w");
    const Unit& b = UnitOf(*plan, "b.w");
    REQUIRE(a.padded == 256);
    REQUIRE(b.padded == b.numel);
    // b is reduced in place whatever its part; its result stays in the trainer's buffer only
    // when its state is on the device.
    CHECK(b.grad_source == GradSource::kInPlace);
    CHECK(ReducedInTrainerBuffer(*plan, b) == !b.offloaded);
    if (b.offloaded) {
      saw_b_offloaded = true;
      CHECK(a.grad_source == GradSource::kInPlace);
      CHECK(a.grad_copy_reason.empty());
      CHECK(plan->grad_handoff.tensors_in_place == 2);
    } else {
      if (a.offloaded) saw_b_kept_a_offloaded = true;
      if (!a.offloaded) saw_all_kept = true;
      CHECK(a.grad_source == GradSource::kCopied);
      CHECK_THAT(a.grad_copy_reason,
                 Catch::Contains("would lie over 'b.w''s gradient in 'g'") &&
                     Catch::Contains("its optimizer state kept on the device by "
                                     "offload_optimizer.ratio < 1"));
      CHECK(plan->grad_handoff.tensors_in_place == 1);
      CHECK(plan->grad_handoff.bytes_copied == 200 * 4);
    }
  }
  // The ratios above cover each arrangement the rule distinguishes.
  CHECK(saw_b_offloaded);
  CHECK(saw_b_kept_a_offloaded);
  CHECK(saw_all_kept);
}

TEST_CASE("Plan: a unit of per-layer slices of stacked tensors is copied, saying why",
          "[memory]") {
  // llm.c's buffer declared per layer (ln1w[l], ln1b[l], ... in module h[l]): a layer's
  // slices lie L slices apart in the trainer's buffer, not consecutive as its unit lays them.
  const int64_t L = 4;
  std::vector<ParamSpec> specs;
  int64_t offset = 0;
  for (const ParamSpec& t : LlmcTensors()) {
    const bool stacked = t.shape.size() >= 2 && t.shape[0] == L;
    const int64_t n = t.numel() / (stacked ? L : 1);
    for (int64_t l = 0; l < (stacked ? L : 1); ++l) {
      ParamSpec s = t;
      if (stacked) {
        s.shape.erase(s.shape.begin());
        s.name = "h." + t.name + "[" + std::to_string(l) + "]";
        s.module = "h[" + std::to_string(l) + "]";
      }
      if (t.name == "lnfw" || t.name == "lnfb") s.module = "lnf";
      s.grad_buffer_offset = offset + l * n;
      specs.push_back(s);
    }
    offset += t.numel();
  }
  REQUIRE(specs.size() == 52);
  PlanOptions o = LlmcOptions(2);
  auto plan = MakePlan(specs, o);
  REQUIRE(plan.ok());
  // wte, wpe and the final LayerNorm (two consecutive [C] tensors: 256 elements) are in place.
  CHECK(plan->grad_handoff.tensors_in_place == 4);
  CHECK(plan->grad_handoff.bytes_in_place == (6438912 + 8192 + 256) * 4);
  const Unit& h0 = UnitOf(*plan, "h.ln1w[0]");
  CHECK(h0.grad_source == GradSource::kCopied);
  CHECK_THAT(h0.grad_copy_reason,
             Catch::Contains("'h.ln1b[0]' starts at element 6447616 of 'grads', not right after "
                             "'h.ln1w[0]' (elements 6447104..6447231)"));
  // The buckets hold a layer (198272 elements, padded to 198400), no longer the embedding.
  CHECK(plan->Find(BufferClass::kGradBucket)->elements == 2 * 198400);
}

TEST_CASE("Plan: declared gradient buffers: mixed units, explicit offsets, gaps and errors",
          "[memory]") {
  PlanOptions o;
  o.compute_dtype = DType::kBF16;
  o.world_size = 2;
  o.unit_per_module = true;
  o.stage = 3;
  // One module, two tensors, one of them undeclared: the unit is copied.
  std::vector<ParamSpec> mixed = {{"a.w", {16, 16}, "a"}, {"a.b", {256}, "a"}};
  mixed[0].grad_buffer = "g";
  auto plan = MakePlan(mixed, o);
  REQUIRE(plan.ok());
  CHECK(plan->units[0].grad_source == GradSource::kCopied);
  CHECK_THAT(plan->units[0].grad_copy_reason, Catch::Contains("'a.b' shares the unit and "
                                                              "declares no gradient buffer"));
  CHECK(plan->grad_handoff.tensors == 1);
  // Both in one buffer, consecutive: in place, whatever the order of declaration.
  mixed[1].grad_buffer = "g";
  mixed[0].grad_buffer_offset = 1000;
  mixed[1].grad_buffer_offset = 1256;
  plan = MakePlan(mixed, o);
  REQUIRE(plan.ok());
  CHECK(plan->units[0].grad_source == GradSource::kInPlace);
  CHECK(plan->params[1].grad_buffer_offset == 1256);
  // In two buffers: copied.
  mixed[1].grad_buffer = "h";
  plan = MakePlan(mixed, o);
  REQUIRE(plan.ok());
  CHECK_THAT(plan->units[0].grad_copy_reason, Catch::Contains("'a.w' is in gradient buffer 'g' "
                                                              "and 'a.b' in 'h'"));
  CHECK(plan->grad_buffers == std::vector<std::string>{"g", "h"});
  // A tensor whose size is not a multiple of param_alignment leaves a gap in its unit.
  std::vector<ParamSpec> odd = {{"b.w", {13}, "b"}, {"b.b", {243}, "b"}};
  for (ParamSpec& s : odd) s.grad_buffer = "g";
  plan = MakePlan(odd, o);
  REQUIRE(plan.ok());
  CHECK_THAT(plan->units[0].grad_copy_reason,
             Catch::Contains("the unit starts 'b.b' at element 16, not right after 'b.w'"));
  // Padding over elements no parameter declares (a gap the trainer left): copied.
  std::vector<ParamSpec> gap = {{"c.w", {200}, "c"}, {"d.w", {256}, "d"}};
  for (ParamSpec& s : gap) s.grad_buffer = "g";
  gap[1].grad_buffer_offset = 300;
  plan = MakePlan(gap, o);
  REQUIRE(plan.ok());
  CHECK(plan->units[0].grad_source == GradSource::kInPlace);  // d.w: 256 elements
  CHECK_THAT(plan->units[1].grad_copy_reason,
             Catch::Contains("over elements 200..255 of 'g', which no parameter declares"));
  // Overlapping ranges and a bad offset are refused, naming the parameters.
  gap[1].grad_buffer_offset = 100;
  auto overlap = MakePlan(gap, o);
  CHECK(overlap.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(overlap.status().message()),
             Catch::Contains("'c.w' (elements 0..199) and 'd.w' (elements 100..355) overlap in "
                             "gradient buffer 'g'"));
  gap[1].grad_buffer_offset = -2;
  CHECK(MakePlan(gap, o).status().code() == absl::StatusCode::kInvalidArgument);
  // A frozen parameter keeps its place in a packed buffer and declares nothing.
  std::vector<ParamSpec> frozen = LlmcTensors();
  frozen[1].frozen = true;  // wpe
  o.compute_dtype = DType::kF32;
  plan = MakePlan(frozen, o);
  REQUIRE(plan.ok());
  CHECK(plan->grad_handoff.tensors == 15);
  CHECK(plan->params[2].grad_buffer_offset == 6438912 + 8192);  // ln1w, after wpe's place
  CHECK(plan->params[1].grad_buffer == -1);
}

// The stage-3 gathers in the standard order against a closed form written from the slots'
// behaviour, not from the plan's replay: units of one size class share its slots, least
// recently used first, so each pass gathers every unit of the class except, at each of the
// window's 2 x gas - 1 turns of direction, the first min(slots, units) of the new pass, which
// the slots still hold (a prefetch only moves gathers earlier). Per class and step:
// 2 x gas x units - (2 x gas - 1) x min(slots, units).
TEST_CASE("Planner: stage-3 gathers follow the slots, per size class, with frozen units",
          "[memory]") {
  constexpr int64_t kLarge = 16384, kSmall = 2048;  // multiples of 8 x 128: no padding
  struct Model {
    const char* name;
    int64_t prefetch;
    bool frozen;  // the last small module frozen: its own unit, one more slot per class
    int classes;  // the gather_buffer's size classes the case is about
  };
  const Model models[] = {
      {"two classes: the large unit's one slot, two slots for four small units", kSmall, false,
       2},
      {"one class: five units of two sizes share one slot (no prefetch)", 0, false, 1},
      {"a frozen unit, no prefetch: one slot more per class, so two classes", 0, true, 2},
      {"a frozen unit and prefetch: three slots for four small units", kSmall, true, 2},
  };
  for (const Model& m : models) {
    for (int gas : {1, 3}) {
      for (int hpz : {1, 2}) {
        INFO(m.name << ", " << gas << " micro-steps, hpZ " << hpz);
        std::vector<ParamSpec> specs = {{"big", {kLarge}, "big"}};
        for (int i = 0; i < 4; ++i) {
          specs.push_back({absl::StrCat("s", i), {kSmall}, absl::StrCat("s", i)});
        }
        specs.back().frozen = m.frozen;
        PlanOptions o;
        o.stage = 3;
        o.world_size = 8;
        o.rank = 3;
        o.unit_per_module = true;
        o.persistence_threshold = 0;
        o.prefetch_elements = m.prefetch;
        o.gradient_accumulation_steps = gas;
        o.hpz_partition_size = hpz;
        o.compute_dtype = DType::kBF16;
        absl::StatusOr<Plan> p = MakePlan(specs, o);
        REQUIRE(p.ok());
        REQUIRE(p->units.size() == 5);
        const Buffer* slots = p->Find(BufferClass::kGatherBuffer);
        REQUIRE(slots != nullptr);
        std::vector<int64_t> sizes = slots->slot_elements;
        if (sizes.empty()) sizes.assign(slots->count, slots->elements / slots->count);
        std::vector<int64_t> classes = sizes;
        classes.erase(std::unique(classes.begin(), classes.end()), classes.end());
        REQUIRE(static_cast<int>(classes.size()) == m.classes);
        int64_t gathers = 0, first = 0, again = 0;  // elements: first gathers, later ones
        bool few = false;  // some class has fewer slots than units
        for (int64_t c : classes) {
          const int64_t n_slots = std::count(sizes.begin(), sizes.end(), c);
          int64_t units = 0, elements = 0;
          for (const Unit& u : p->units) {
            if (SlotClassElements(sizes, u.padded) != c) continue;
            ++units;
            elements += u.padded;
          }
          REQUIRE(units > 0);
          few = few || n_slots < units;
          const int64_t held = std::min(n_slots, units);
          const int64_t per_class = 2 * gas * units - (2 * gas - 1) * held;
          gathers += per_class;
          // Which units the turns find held depends on their order; the bytes do only when
          // the class's units differ in size: take the sizes as they come in the passes.
          std::vector<int64_t> order;  // the class's unit sizes in forward order
          for (int u = static_cast<int>(p->units.size()) - 1; u >= 0; --u) {
            if (SlotClassElements(sizes, p->units[u].padded) == c) {
              order.push_back(p->units[u].padded);
            }
          }
          // Forward ends with order.back(), backward with order.front(): a turn into backward
          // finds the last `held` of forward, a turn into forward the last `held` of backward.
          int64_t skipped = 0;
          for (int64_t t = 0; t < 2 * gas - 1; ++t) {
            for (int64_t k = 0; k < held; ++k) {
              skipped += t % 2 == 0 ? order[order.size() - 1 - k] : order[k];
            }
          }
          first += elements;
          again += 2 * gas * elements - skipped - elements;
        }
        if (m.prefetch == 0 && !m.frozen) REQUIRE(few);
        CHECK(p->stage3_gathers_per_step == gathers);
        // Bytes within the world (flat): the reduce-scatters of the trainable units, then the
        // gathers, each over the world (hpZ: a unit's first over the world, its others over
        // the 2 ranks of the node), and the control exchange.
        const int64_t b = 2;
        const int64_t reduce = gas * p->trainable_padded_elements / 8 * 7 * b;
        const int64_t gather_bytes =
            hpz == 1 ? (first + again) / 8 * 7 * b : first / 8 * 7 * b + again / 2 * 1 * b;
        CHECK(p->comm_bytes_within_group_per_step == reduce + gather_bytes);
        CHECK(p->comm_control_bytes_per_step == ControlBytes(8, 5, 3));
        CHECK(p->comm_bytes_per_step == reduce + gather_bytes + ControlBytes(8, 5, 3));
      }
    }
  }
}

TEST_CASE("Planner: bytes per link class for flat, HSDP, MiCS's hierarchical gather and hpZ",
          "[memory][hsdp][hpz]") {
  // One 8192-element unit (a multiple of 16 * 128: no padding) on 16 ranks, 4 nodes of 4,
  // bf16, one micro-step, rank 6 (node 1). In nccl-tests' convention a gather or reduce-scatter
  // of n over g ranks sends n (g - 1) / g; a collective whose ranks span nodes counts whole
  // as inter-node. The one unit is gathered once per step (backward finds it in its slot); the
  // control exchange (840 B) runs over the world, across nodes.
  std::vector<ParamSpec> specs = {{"w", {64, 128}, "m"}};
  PlanOptions o;
  o.stage = 3;
  o.world_size = 16;
  o.rank = 6;
  o.persistence_threshold = 0;
  o.compute_dtype = DType::kBF16;
  o.ranks_per_node = 4;
  const int64_t n = 8192, b = 2;
  auto plan = [&](const PlanOptions& p) {
    absl::StatusOr<Plan> made = MakePlan(specs, p);
    REQUIRE(made.ok());
    return *made;
  };
  {
    INFO("flat: a gather and a reduce-scatter over 16 ranks, all across nodes");
    const Plan p = plan(o);
    CHECK(p.comm_control_bytes_per_step == ControlBytes(16, 1, 3));
    CHECK(p.comm_bytes_intra_node_per_step == 0);
    CHECK(p.comm_bytes_inter_node_per_step == 2 * n / 16 * 15 * b + ControlBytes(16, 1, 3));
    CHECK(p.comm_bytes_per_step == p.comm_bytes_inter_node_per_step);
  }
  {
    INFO("HSDP in groups of one node: gathers and reduce-scatter within it, the all-reduce of "
         "the 2048-element shard across the 4 groups");
    PlanOptions h = o;
    h.shard_group_size = 4;
    const Plan p = plan(h);
    CHECK(p.comm_bytes_intra_node_per_step == 2 * n / 4 * 3 * b);
    CHECK(p.comm_bytes_inter_node_per_step == 2 * 2048 / 4 * 3 * b + ControlBytes(16, 1, 3));
    CHECK(p.comm_bytes_intra_node_per_step + p.comm_bytes_inter_node_per_step ==
          p.comm_bytes_per_step);
  }
  {
    INFO("MiCS in groups of 8 (2 nodes) with the hierarchical gather: of each gather, 1/8 of "
         "the unit to the group's other node, then 2 blocks of 1/8 within the node of 4");
    PlanOptions h = o;
    h.shard_group_size = 8;
    const Plan flat_gather = plan(h);
    h.hierarchical_gather = true;
    const Plan p = plan(h);
    const int64_t across = n / 8 * 1 * b, within = n / 8 * 2 * 3 * b;
    const int64_t reduce = n / 8 * 7 * b, allreduce = 2 * 1024 / 2 * 1 * b;
    CHECK(p.comm_bytes_inter_node_per_step ==
          across + reduce + allreduce + ControlBytes(16, 1, 3));
    CHECK(p.comm_bytes_intra_node_per_step == within);
    // The same total as the flat gather over the group: the gather only moves differently.
    CHECK(p.comm_bytes_per_step == flat_gather.comm_bytes_per_step);
    CHECK(flat_gather.comm_bytes_intra_node_per_step == 0);
    const Buffer* stage = p.Find(BufferClass::kGatherStage);
    REQUIRE(stage != nullptr);
    CHECK(stage->elements == n / 4);  // 2 blocks of 1/8: the across-node step's output
    CHECK(p.device_bytes() == flat_gather.device_bytes() + stage->bytes);
  }
  {
    INFO("hpZ over the node (K = 4), 3 micro-steps, two units in one slot (no prefetch): of "
         "the 12 passes over a unit 5 find it in the slot (one at each turn of direction), "
         "the other 7 gather: each unit's first over 16 ranks, the 5 others within the node; "
         "the secondary blocks are 1/4 of each unit");
    const std::vector<ParamSpec> two = {{"w", {64, 128}, "m"}, {"v", {64, 128}, "n"}};
    PlanOptions h = o;
    h.unit_per_module = true;
    h.prefetch_elements = 0;
    h.gradient_accumulation_steps = 3;
    absl::StatusOr<Plan> flat = MakePlan(two, h);
    h.hpz_partition_size = 4;
    absl::StatusOr<Plan> p = MakePlan(two, h);
    REQUIRE(flat.ok());
    REQUIRE(p.ok());
    REQUIRE(p->units.size() == 2);
    REQUIRE(p->gather_slots == 1);
    CHECK(p->stage3_gathers_per_step == 7);
    CHECK(p->comm_bytes_inter_node_per_step ==
          (2 + 3 * 2) * n / 16 * 15 * b + ControlBytes(16, 2, 3));
    CHECK(p->comm_bytes_intra_node_per_step == 5 * n / 4 * 3 * b);
    CHECK(p->comm_bytes_per_step ==
          p->comm_bytes_inter_node_per_step + p->comm_bytes_intra_node_per_step);
    const Buffer* secondary = p->Find(BufferClass::kHpzSecondary);
    REQUIRE(secondary != nullptr);
    CHECK(secondary->elements == 2 * n / 4);
    CHECK(p->device_bytes() == flat->device_bytes() + 2 * n / 4 * b);
    CHECK(flat->Find(BufferClass::kHpzSecondary) == nullptr);
  }
  {
    INFO("without ranks_per_node no link classes; a bad one is refused by name");
    PlanOptions h = o;
    h.ranks_per_node = 0;
    const Plan p = plan(h);
    CHECK(p.comm_bytes_intra_node_per_step == 0);
    CHECK(p.comm_bytes_inter_node_per_step == 0);
    h.ranks_per_node = 3;
    auto refused = MakePlan(specs, h);
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(refused.status().message(), "ranks_per_node"));
  }
}

TEST_CASE("Plan: compact optimizer state counts each form's bytes in closed form", "[memory]") {
  std::mt19937 rng(29);
  const std::vector<ParamSpec> specs = RandomModel(rng, 9, 700);
  struct Where {
    const char* name;
    int min_stage;
    bool optimizer, param, nvme;
  };
  const Where wheres[] = {{"device", 0, false, false, false},
                          {"offload cpu", 1, true, false, false},
                          {"offload nvme", 1, true, false, true},
                          {"offload cpu + parameters", 3, true, true, false},
                          {"offload nvme + parameters", 3, true, true, true},
                          {"device optimizer, parameters on the host", 3, false, true, false}};
  for (const Where& w : wheres) {
    for (int stage = w.min_stage; stage <= 3; ++stage) {
      for (int world : {1, 3}) {
        for (MasterForm form :
             {MasterForm::kF32, MasterForm::kBf16Remainder, MasterForm::kBf16Stochastic}) {
          for (DType moments : {DType::kF32, DType::kBF16}) {
            PlanOptions o = ThreeRanks(stage, world - 1);
            o.world_size = world;
            o.offload_optimizer = w.optimizer;
            o.offload_optimizer_nvme = w.nvme;
            o.offload_param = w.param;
            o.nvme_piece_elements = 1024;
            o.master_form = form;
            o.moment_dtype = moments;
            INFO(w.name << ", stage " << stage << ", world " << world << ", master "
                        << MasterFormName(form) << ", moments " << DTypeName(moments));
            auto plan = MakePlan(specs, o);
            REQUIRE(plan.ok());
            // Bytes per owned element, by hand: the master's bf16 part lives in the parameter
            // shard where the optimizer runs beside it (device, or host with host parameters),
            // never with NVMe state; elsewhere the optimizer keeps a bf16 copy.
            const bool in_params = !w.nvme && (!w.optimizer || w.param);
            const int64_t master = form == MasterForm::kF32             ? 4
                                   : form == MasterForm::kBf16Remainder ? (in_params ? 2 : 4)
                                                                        : (in_params ? 0 : 2);
            const int64_t per = master + 2 * static_cast<int64_t>(DTypeSize(moments));
            const int64_t owned = stage == 0 ? plan->padded_elements : plan->shard_elements;
            int64_t state = 0;
            for (const Buffer& b : plan->buffers) {
              if (b.cls == BufferClass::kMaster || b.cls == BufferClass::kMasterRemainder ||
                  b.cls == BufferClass::kExpAvg || b.cls == BufferClass::kExpAvgSq) {
                state += b.bytes;
              }
            }
            CHECK(state == owned * per);
            CHECK(StateFormOf(o).BytesPerElement() == per);
            CHECK((plan->Find(BufferClass::kMasterRemainder) != nullptr) ==
                  (form == MasterForm::kBf16Remainder));
            const int64_t params = plan->Find(BufferClass::kParams)->bytes;
            const int64_t grads = plan->Find(BufferClass::kGrads)->bytes;
            CHECK(plan->model_state_bytes == params + grads + state);
            if (w.nvme) {
              // Two copies of each piece's arrays, each padded to 4 KiB.
              int64_t copy = 0;
              std::vector<int64_t> arrays;  // bytes per element, in file order
              if (form == MasterForm::kF32) arrays.push_back(4);
              if (form != MasterForm::kF32) arrays.push_back(2);  // the bf16 copy
              if (form == MasterForm::kBf16Remainder) arrays.push_back(2);
              arrays.push_back(DTypeSize(moments));
              arrays.push_back(DTypeSize(moments));
              for (const Unit& u : plan->units) {
                for (int64_t left = u.shard; left > 0; left -= 1024) {
                  for (int64_t b : arrays) {
                    copy += (std::min<int64_t>(left, 1024) * b + 4095) / 4096 * 4096;
                  }
                }
              }
              CHECK(plan->nvme_bytes() == 2 * copy);
            }
            // The staging chunks carry new shards up unless the compact master's host copy
            // goes up itself (host optimizer, device parameters, no NVMe).
            const bool direct = form != MasterForm::kF32 && w.optimizer && !w.param && !w.nvme;
            const bool staging = w.optimizer && !w.param && !direct;
            CHECK((plan->Find(BufferClass::kOffloadStaging) != nullptr) == staging);
            const std::string line = StateFormDescription(o);
            CHECK(line.find(MasterFormName(form)) != std::string::npos);
            CHECK(line.find(absl::StrCat(per, " bytes")) != std::string::npos);
          }
        }
      }
    }
  }
  // Refused: compact state without bf16 parameters, and a compact master with NVMe parameters.
  PlanOptions o = ThreeRanks(3, 0);
  o.compute_dtype = DType::kF32;
  o.moment_dtype = DType::kBF16;
  CHECK(MakePlan(specs, o).status().message().find("bf16.bf16_optimizer_states") !=
        std::string::npos);
  o.moment_dtype = DType::kF32;
  o.master_form = MasterForm::kBf16Remainder;
  CHECK(MakePlan(specs, o).status().message().find("zerort.store_param_remainders") !=
        std::string::npos);
  o.compute_dtype = DType::kBF16;
  o.master_form = MasterForm::kBf16Stochastic;
  o.offload_param = o.offload_param_nvme = true;
  CHECK(MakePlan(specs, o).status().message().find("bf16.bf16_master_weights_and_grads") !=
        std::string::npos);
}

TEST_CASE("Plan: unit index offsets do not depend on the world size or the stage", "[memory]") {
  std::mt19937 rng(31);
  const std::vector<ParamSpec> specs = RandomModel(rng, 12, 300);
  auto reference = MakePlan(specs, ThreeRanks(0, 0));
  REQUIRE(reference.ok());
  int64_t sum = 0;
  for (const Unit& u : reference->units) {
    CHECK(u.index_offset == sum);
    sum += u.numel;
  }
  for (int stage = 0; stage <= 3; ++stage) {
    for (int world : {1, 2, 5, 64}) {
      PlanOptions o = ThreeRanks(stage, 0);
      o.world_size = world;
      auto plan = MakePlan(specs, o);
      REQUIRE(plan.ok());
      REQUIRE(plan->units.size() == reference->units.size());
      for (size_t u = 0; u < plan->units.size(); ++u) {
        CHECK(plan->units[u].index_offset == reference->units[u].index_offset);
      }
    }
  }
}

}  // namespace
}  // namespace memory
}  // namespace zerort
