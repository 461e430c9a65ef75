#include "zero/internal/adamw_groups.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "device/testing/one_thread.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

// SmallModel's parameters by name: embed.w, l0.w, l0.b, l1.w, l1.b, l2.w, head.w.
int ParamIndex(const std::vector<memory::ParamSpec>& specs, const std::string& name) {
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name == name) return static_cast<int>(i);
  }
  FAIL("no parameter " << name);
  return -1;
}

// What parameter `name` should get: nullopt for no group.
void RequireGroup(const GroupChoice& c, const std::vector<memory::ParamSpec>& specs,
                  const std::string& name, std::optional<ParamGroup> want) {
  INFO("parameter " << name);
  REQUIRE(c.of_param.size() == specs.size());
  const int g = c.of_param[ParamIndex(specs, name)];
  if (!want.has_value()) {
    REQUIRE(g == -1);
    return;
  }
  REQUIRE(g >= 0);
  REQUIRE(g < static_cast<int>(c.groups.size()));
  CHECK(c.groups[g].weight_decay == want->weight_decay);
  CHECK(c.groups[g].lr_scale == want->lr_scale);
}

TEST_CASE("AdamWGroups: explicit groups, then the first matching pattern, then no_decay_1d",
          "[zero]") {
  const std::vector<memory::ParamSpec> specs = testing::SmallModel();
  const std::vector<ParamGroupConfig> patterns = {
      {"*.b", 0.0, 0.5},       // [0] l0.b, l1.b
      {"l?.w", 0.3, 2.0},      // [1] l0.w, l2.w (l1.w is taken explicitly)
      {"l0.*", 0.7, 3.0},      // [2] only l0.w and l0.b, both taken by earlier patterns
      {"nothing*", 0.2, 1.0},  // [3] matches nothing
  };
  std::vector<std::optional<ParamGroup>> explicit_groups(specs.size());
  explicit_groups[ParamIndex(specs, "l1.w")] = ParamGroup{0.05, 4.0};
  std::vector<std::string> notes;
  const absl::StatusOr<GroupChoice> c =
      ResolveParamGroups(specs, patterns, explicit_groups, /*no_decay_1d=*/true, &notes);
  REQUIRE(c.ok());
  RequireGroup(*c, specs, "embed.w", std::nullopt);  // 2-d, unmatched
  RequireGroup(*c, specs, "l0.w", ParamGroup{0.3, 2.0});
  RequireGroup(*c, specs, "l0.b", ParamGroup{0.0, 0.5});
  RequireGroup(*c, specs, "l1.w", ParamGroup{0.05, 4.0});  // explicit beats "l?.w"
  RequireGroup(*c, specs, "l1.b", ParamGroup{0.0, 0.5});
  RequireGroup(*c, specs, "l2.w", ParamGroup{0.3, 2.0});
  RequireGroup(*c, specs, "head.w", ParamGroup{0.0, 1.0});  // 1-d, unmatched: no decay
  // Parameters matched by one pattern share its group.
  CHECK(c->of_param[ParamIndex(specs, "l0.b")] == c->of_param[ParamIndex(specs, "l1.b")]);
  CHECK(c->of_param[ParamIndex(specs, "l0.w")] == c->of_param[ParamIndex(specs, "l2.w")]);

  // One note per pattern that took no parameter, naming its index and pattern.
  REQUIRE(notes.size() == 2);
  CHECK(absl::StrContains(notes[0], "zerort.param_groups[2]"));
  CHECK(absl::StrContains(notes[0], "l0.*"));
  CHECK(absl::StrContains(notes[1], "zerort.param_groups[3]"));
  CHECK(absl::StrContains(notes[1], "nothing*"));
  // Notes are optional.
  CHECK(ResolveParamGroups(specs, patterns, explicit_groups, true, nullptr).ok());
}

TEST_CASE("AdamWGroups: no_decay_1d puts every unmatched 1-d parameter in one group", "[zero]") {
  const std::vector<memory::ParamSpec> specs = testing::SmallModel();
  const absl::StatusOr<GroupChoice> with = ResolveParamGroups(specs, {}, {}, true, nullptr);
  REQUIRE(with.ok());
  int no_decay = -2;
  for (size_t i = 0; i < specs.size(); ++i) {
    INFO(specs[i].name);
    if (specs[i].shape.size() != 1) {
      CHECK(with->of_param[i] == -1);
      continue;
    }
    RequireGroup(*with, specs, specs[i].name, ParamGroup{0.0, 1.0});
    if (no_decay == -2) no_decay = with->of_param[i];
    CHECK(with->of_param[i] == no_decay);
  }
  CHECK(no_decay >= 0);  // SmallModel has 1-d parameters
  const absl::StatusOr<GroupChoice> without = ResolveParamGroups(specs, {}, {}, false, nullptr);
  REQUIRE(without.ok());
  for (int g : without->of_param) CHECK(g == -1);
}

// llm.c's layout with L = 2, C = 4: per-layer tensors stacked [L, ...]. Hand-worked expectation:
// the trainer never decays biases and gains, so the slices of ln1w [2, 4] and qkvb [2, 12] go to
// the no-decay group, the slices of qkvw [2, 12, 4] are decayed; the whole ln2w [2, 4] (not
// declared as slices) is decayed as a matrix, with a note, as are [1, 4] and a lone "odd[3]".
TEST_CASE("AdamWGroups: no_decay_1d decides stacked tensors by their StackedSlices slices",
          "[zero]") {
  // The slices as StackedSlices (zero/engine.h) names them: "name[l]" in module "module[l]".
  std::vector<memory::ParamSpec> specs = {{"wte", {10, 4}, "wte"},
                                          {"ln1w[0]", {4}, "ln1[0]"},
                                          {"ln1w[1]", {4}, "ln1[1]"},
                                          {"qkvw[0]", {12, 4}, "attn[0]"},
                                          {"qkvw[1]", {12, 4}, "attn[1]"},
                                          {"qkvb[0]", {12}, "attn[0]"},
                                          {"qkvb[1]", {12}, "attn[1]"}};
  specs.push_back({"ln2w", {2, 4}, "ln2"});
  specs.push_back({"lnfw", {4}, "lnf"});
  specs.push_back({"scale", {1, 4}, "lnf"});
  specs.push_back({"odd[3]", {2, 2}, "odd[3]"});
  // wte ln1w[0] ln1w[1] qkvw[0] qkvw[1] qkvb[0] qkvb[1] ln2w lnfw scale odd[3]
  const std::vector<int64_t> layers = {0, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0};
  CHECK(StackedLayers(specs) == layers);
  std::vector<std::string> notes;
  const absl::StatusOr<GroupChoice> c = ResolveParamGroups(specs, {}, {}, true, &notes);
  REQUIRE(c.ok());
  const std::vector<bool> no_decay = {false, true, true, false, false, true, true,
                                      false, true, false, false};
  for (size_t i = 0; i < specs.size(); ++i) {
    INFO(specs[i].name);
    RequireGroup(*c, specs, specs[i].name,
                 no_decay[i] ? std::optional<ParamGroup>(ParamGroup{0.0, 1.0}) : std::nullopt);
  }
  REQUIRE(notes.size() == 3);
  CHECK(absl::StrContains(notes[0], "'ln2w' [2, 4] is decayed as a matrix"));
  CHECK(absl::StrContains(notes[0], "declare it with StackedSlices so that each [4] slice"));
  CHECK(absl::StrContains(notes[1], "'scale' [1, 4] has a dimension of 1"));
  CHECK(absl::StrContains(notes[2], "'odd[3]' [2, 2] is named like a StackedSlices slice"));
  // Without no_decay_1d nothing is grouped and nothing is noted.
  notes.clear();
  REQUIRE(ResolveParamGroups(specs, {}, {}, false, &notes).ok());
  CHECK(notes.empty());
}

TEST_CASE("AdamWGroups: bad groups are InvalidArgument naming the parameter or pattern",
          "[zero]") {
  const std::vector<memory::ParamSpec> specs = testing::SmallModel();
  {
    std::vector<std::optional<ParamGroup>> three(3);
    const auto c = ResolveParamGroups(specs, {}, three, false, nullptr);
    REQUIRE(absl::IsInvalidArgument(c.status()));
    CHECK(absl::StrContains(c.status().message(), "3"));
    CHECK(absl::StrContains(c.status().message(), "7"));
  }
  {
    const auto c = ResolveParamGroups(specs, {{"*.b", 0, 1}, {"l?.w", -0.5, 1}}, {}, false,
                                      nullptr);
    REQUIRE(absl::IsInvalidArgument(c.status()));
    CHECK(absl::StrContains(c.status().message(), "zerort.param_groups[1]"));
    CHECK(absl::StrContains(c.status().message(), "l?.w"));
  }
  {
    const auto c = ResolveParamGroups(specs, {{"head.*", 0, std::nan("")}}, {}, false, nullptr);
    REQUIRE(absl::IsInvalidArgument(c.status()));
    CHECK(absl::StrContains(c.status().message(), "head.*"));
  }
  {
    std::vector<std::optional<ParamGroup>> groups(specs.size());
    groups[ParamIndex(specs, "l2.w")] = ParamGroup{0.1, -2.0};
    const auto c = ResolveParamGroups(specs, {}, groups, false, nullptr);
    REQUIRE(absl::IsInvalidArgument(c.status()));
    CHECK(absl::StrContains(c.status().message(), "l2.w"));
  }
}

bool SameConstants(const offload::AdamWStepParams& a, const offload::AdamWStepParams& b) {
  return a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.one_minus_beta1 == b.one_minus_beta1 &&
         a.one_minus_beta2 == b.one_minus_beta2 && a.eps == b.eps &&
         a.step_size == b.step_size && a.inv_sqrt_bias2 == b.inv_sqrt_bias2 &&
         a.decay == b.decay;
}

// The constants a parameter of group g (-1: none) must get, from the scalars alone.
offload::AdamWStepParams Expected(const GroupChoice& c, int g, const AdamWScalars& s,
                                  int64_t step) {
  double lr = s.lr, wd = s.weight_decay;
  if (g >= 0) {
    lr = s.lr * c.groups[g].lr_scale;
    wd = c.groups[g].weight_decay;
  }
  return offload::MakeAdamWStepParams(lr, s.beta1, s.beta2, s.eps, wd, step).value();
}

struct Coverage {
  int multi_range_regions = 0;  // regions cut into several ranges
  int cut_params = 0;           // parameters that start before their region (a shard cut)
};

// Checks every unit's ranges of one rank's plan against the parameter layout.
void CheckRanges(const memory::Plan& plan, const GroupChoice& choice, Coverage* seen) {
  auto dev = testing::OneThreadCpuDevice();
  auto mem = EngineMemory::Allocate(plan, dev.get(), nullptr);
  REQUIRE(mem.ok());
  const ShardLayout layout(plan, (*mem)->model_state());
  AdamWGroups groups(plan, layout, choice);
  AdamWScalars s;
  s.lr = 1e-2;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  for (int64_t step : {1, 5}) {
    const auto ranges = groups.Prepare(s, step);
    REQUIRE(ranges.ok());
    REQUIRE((*ranges)->size() == plan.units.size());
    for (int u = 0; u < static_cast<int>(plan.units.size()); ++u) {
      INFO("unit " << u << " step " << step);
      const Region& reg = layout.region(u);
      const std::vector<offload::AdamWRange>& rs = (**ranges)[u];
      // The group of each element of the region: its parameter's, or -2 for padding.
      std::vector<int> group_at(reg.n, -2);
      std::vector<bool> param_start(reg.n, false);
      for (int i : plan.units[u].params) {
        const memory::ParamLayout& p = plan.params[i];
        for (int64_t k = 0; k < p.numel; ++k) {
          const int64_t e = p.offset_in_unit + k - reg.unit_begin;
          if (e >= 0 && e < reg.n) group_at[e] = choice.of_param[i];
        }
        const int64_t start = p.offset_in_unit - reg.unit_begin;
        if (start >= 0 && start < reg.n) param_start[start] = true;
        if (start < 0 && start + p.numel > 0) ++seen->cut_params;
      }
      const bool any_param =
          std::any_of(group_at.begin(), group_at.end(), [](int g) { return g != -2; });
      // The ranges tile [0, n) in order, without empty ones.
      REQUIRE(!rs.empty());
      CHECK(rs.front().begin == 0);
      CHECK(rs.back().end == static_cast<size_t>(reg.n));
      if (rs.size() > 1) ++seen->multi_range_regions;
      for (size_t k = 0; k < rs.size(); ++k) {
        INFO("range " << k << " [" << rs[k].begin << ", " << rs[k].end << ")");
        REQUIRE(rs[k].begin < rs[k].end);
        if (k > 0) {
          REQUIRE(rs[k].begin == rs[k - 1].end);
          // Cut only where a parameter starts (padding joins the range before it), and only
          // between different groups (neighbours of one group share a range).
          CHECK(param_start[rs[k].begin]);
          CHECK(!SameConstants(rs[k].params, rs[k - 1].params));
        }
        bool has_param = false;
        for (size_t e = rs[k].begin; e < rs[k].end; ++e) {
          if (group_at[e] == -2) continue;
          has_param = true;
          if (!SameConstants(rs[k].params, Expected(choice, group_at[e], s, step))) {
            FAIL_CHECK("element " << e << " of group " << group_at[e]
                                  << " has another group's constants");
            break;
          }
        }
        // A range of padding alone exists only where the region holds no parameter.
        CHECK(has_param == any_param);
      }
    }
  }
}

TEST_CASE("AdamWGroups: ranges tile each region at parameter boundaries with the group's "
          "constants",
          "[zero]") {
  const std::vector<memory::ParamSpec> specs = testing::SmallModel();
  // Four groups with pairwise different constants: none (the step's decay), "*.b", "l?.w" and
  // no-decay (head.w).
  const GroupChoice choice =
      ResolveParamGroups(specs, {{"*.b", 0.0, 0.5}, {"l?.w", 0.3, 2.0}}, {}, true, nullptr)
          .value();
  Coverage seen;
  for (int stage = 0; stage <= 3; ++stage) {
    for (int rank = 0; rank < 3; ++rank) {
      INFO("stage " << stage << " rank " << rank << " of 3");
      CheckRanges(SmallPlan(stage, 3, rank, 1, DType::kF32), choice, &seen);
    }
  }
  // The plans exercise what the test is about: shards cutting parameters, regions of several
  // groups.
  CHECK(seen.cut_params > 0);
  CHECK(seen.multi_range_regions > 0);
}

TEST_CASE("AdamWGroups: without groups each unit is one range", "[zero]") {
  const std::vector<memory::ParamSpec> specs = testing::SmallModel();
  const GroupChoice none = ResolveParamGroups(specs, {}, {}, false, nullptr).value();
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    const memory::Plan plan = SmallPlan(stage, 2, 1, 1, DType::kF32);
    Coverage seen;
    CheckRanges(plan, none, &seen);
    CHECK(seen.multi_range_regions == 0);
  }
}

TEST_CASE("AdamWGroups: Prepare rejects invalid scalars", "[zero]") {
  const memory::Plan plan = SmallPlan(2, 2, 0, 1, DType::kF32);
  auto dev = testing::OneThreadCpuDevice();
  auto mem = EngineMemory::Allocate(plan, dev.get(), nullptr).value();
  const ShardLayout layout(plan, mem->model_state());
  AdamWGroups groups(plan, layout,
                     ResolveParamGroups(testing::SmallModel(), {}, {}, true, nullptr).value());
  AdamWScalars s;
  s.beta2 = 1.0;
  CHECK(absl::IsInvalidArgument(groups.Prepare(s, 1).status()));
  s = AdamWScalars();
  CHECK(absl::IsInvalidArgument(groups.Prepare(s, 0).status()));  // steps start at 1
  CHECK(groups.Prepare(s, 1).ok());
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
