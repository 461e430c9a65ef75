// Planner speed: how long `zerort plan` takes for the largest plans users ask for.
//
// Limit: the brief's target of well under one second for 1e12 parameters on 1024 ranks.
// Prints one JSON document: per case, the median of several MakePlan calls in milliseconds and
// the ratio to that one-second budget.
//
// Usage: plan_bench [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "memory/plan.h"
#include "nlohmann/json.hpp"
#include "zero/model_spec.h"

namespace zerort {
namespace {

double MedianPlanMs(const std::vector<memory::ParamSpec>& specs, const memory::PlanOptions& o,
                    int reps, int64_t* units) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto plan = memory::MakePlan(specs, o);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
    if (!plan.ok()) {
      std::fprintf(stderr, "plan_bench: %s\n", std::string(plan.status().message()).c_str());
      return -1;
    }
    *units = static_cast<int64_t>(plan->units.size());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int Main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int reps = quick ? 3 : 21;
  struct Case {
    std::string name;
    std::vector<memory::ParamSpec> specs;
    int world;
    int stage;
  };
  std::vector<Case> cases;
  cases.push_back({"synthetic-1e12-96layers", SyntheticModel(1000000000000LL, 96).value(), 1024, 3});
  cases.push_back({"llama2-70b", ModelPreset("llama2-70b").value(), 1024, 3});
  cases.push_back({"llama2-70b", ModelPreset("llama2-70b").value(), 64, 2});
  nlohmann::ordered_json out;
  out["benchmark"] = "plan_bench";
  out["limit"] = "1000 ms per plan (the brief's target for 1e12 parameters on 1024 ranks)";
  out["reps"] = reps;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  bool ok = true;
  for (const Case& c : cases) {
    memory::PlanOptions o;
    o.stage = c.stage;
    o.world_size = c.world;
    o.rank = c.world - 1;
    int64_t units = 0;
    const double ms = MedianPlanMs(c.specs, o, reps, &units);
    ok = ok && ms >= 0;
    rows.push_back(nlohmann::ordered_json{{"model", c.name},
                                          {"params_tensors", c.specs.size()},
                                          {"units", units},
                                          {"world_size", c.world},
                                          {"stage", c.stage},
                                          {"median_ms", ms},
                                          {"fraction_of_limit", ms / 1000.0}});
  }
  out["results"] = rows;
  std::printf("%s\n", out.dump(2).c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
