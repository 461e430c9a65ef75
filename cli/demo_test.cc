#include "cli/demo.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "catch2/catch.hpp"

namespace zerort {
namespace {

// The numeric rows of the per-step table: "step loss grad_norm loss_scale ms step_ms".
std::vector<std::vector<double>> StepRows(const std::string& text) {
  std::vector<std::vector<double>> rows;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 6) continue;
    std::vector<double> row;
    for (int i = 0; i < 6; ++i) {
      double v;
      if (!absl::SimpleAtod(fields[i], &v)) break;
      row.push_back(v);
    }
    if (row.size() == 6) rows.push_back(row);
  }
  return rows;
}

TEST_CASE("Demo: prints one line per step, a falling loss and planned == allocated", "[zero]") {
  const std::string stage = GENERATE(std::string("2"), std::string("3"));
  std::ostringstream out;
  absl::Status status = RunDemoCommand({"--ranks", "2", "--steps=12", "--stage", stage}, out);
  INFO(out.str());
  REQUIRE(status.ok());
  const std::vector<std::vector<double>> rows = StepRows(out.str());
  REQUIRE(rows.size() == 12u);
  for (size_t i = 0; i < rows.size(); ++i) CHECK(rows[i][0] == static_cast<double>(i + 1));
  CHECK(rows.back()[1] < rows.front()[1]);
  CHECK(rows.front()[2] > 0);  // a real gradient norm
  CHECK(out.str().find("stage " + stage + ",") != std::string::npos);
  // A row per rank in the memory table and the verdict.
  CHECK(out.str().find("every rank allocated exactly its plan") != std::string::npos);
}

TEST_CASE("Demo: --config is honoured and --stage / --precision override it", "[zero]") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/demo_offload.json";
  {
    std::ofstream f(path);
    f << R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
             "bf16": {"enabled": true}, "optimizer": {"params": {"lr": 0.01}}})";
  }
  std::ostringstream out;
  absl::Status status = RunDemoCommand(
      {"--config", path, "--stage", "2", "--precision", "fp32", "--ranks", "3", "--steps", "4"},
      out);
  INFO(out.str());
  REQUIRE(status.ok());
  CHECK(out.str().find("on 3 in-process ranks, stage 2, fp32") != std::string::npos);
  CHECK(StepRows(out.str()).size() == 4u);
  // Offloaded optimizer state shows up as pinned host memory on every rank, as planned.
  int offload_rows = 0;
  for (absl::string_view line : absl::StrSplit(out.str(), '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    // "rank  dev_planned / dev_alloc  pinned_planned / pinned_alloc  host_planned / host_alloc"
    if (f.size() == 10 && f[2] == "/" && f[5] == "/" && f[4] != "0" && f[4] == f[6]) {
      ++offload_rows;
    }
  }
  CHECK(offload_rows == 3);
  CHECK(out.str().find("every rank allocated exactly its plan") != std::string::npos);
}

TEST_CASE("Demo: bad flags are InvalidArgument naming the flag", "[zero]") {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"--ranks", "0"}, "--ranks"},
      {{"--steps", "x"}, "--steps"},
      {{"--stage", "4"}, "--stage"},
      {{"--precision", "fp8"}, "--precision"},
      {{"--rank", "2"}, "--rank"},
      {{"--steps"}, "--steps"},
      {{"--ranks", "2", "--ranks", "3"}, "--ranks"},
      {{"stray"}, "stray"},
  };
  for (const Case& c : cases) {
    std::ostringstream out;
    absl::Status status = RunDemoCommand(c.args, out);
    INFO(c.args[0] << ": " << status);
    CHECK(absl::IsInvalidArgument(status));
    CHECK(status.message().find(c.needle) != absl::string_view::npos);
  }
}

TEST_CASE("Demo: a missing config file is an error naming the file", "[zero]") {
  std::ostringstream out;
  absl::Status status = RunDemoCommand({"--config", "/nonexistent/demo.json"}, out);
  CHECK(absl::IsNotFound(status));
  CHECK(status.message().find("/nonexistent/demo.json") != absl::string_view::npos);
}

}  // namespace
}  // namespace zerort
