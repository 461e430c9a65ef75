#include "cli/demo.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "base/testing/temp_dir.h"
#include "catch2/catch.hpp"
#include "checkpoint/checkpoint.h"
#include "checkpoint/weights.h"
#include "examples/gpt/gpt_cuda.h"

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

TEST_CASE("Demo: --model mlp prints one line per step, a falling loss and planned == allocated",
          "[zero]") {
  const std::string stage = GENERATE(std::string("2"), std::string("3"));
  std::ostringstream out;
  absl::Status status =
      RunDemoCommand({"--model", "mlp", "--ranks", "2", "--steps=12", "--stage", stage}, out);
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
  const std::string path = testing::TestTmpDir() + "/demo_offload.json";
  {
    std::ofstream f(path);
    f << R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
             "bf16": {"enabled": true}, "optimizer": {"params": {"lr": 0.01}}})";
  }
  std::ostringstream out;
  absl::Status status = RunDemoCommand(
      {"--model=mlp", "--config", path, "--stage", "2", "--precision", "fp32", "--ranks", "3",
       "--steps", "4"},
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

// "val loss A -> B ..." of the GPT demo: {A, B} as printed.
std::pair<std::string, std::string> ValLoss(const std::string& text) {
  const size_t at = text.find("\nval loss ");
  if (at == std::string::npos) return {};
  std::vector<std::string> f = absl::StrSplit(text.substr(at + 10, 40), ' ');
  if (f.size() < 3 || f[1] != "->") return {};
  return {f[0], f[2]};
}

std::string TempDir(const std::string& name) {
  return testing::TestTmpDir() + "/" + name;
}

TEST_CASE("Demo: the GPT by default: falling losses, a sample, planned == allocated", "[zero]") {
  std::ostringstream out;
  // 2 layers of width 32 keep the test fast under ASan.
  absl::Status status = RunDemoCommand({"--ranks", "2", "--steps", "6", "--batch", "1",
                                        "--eval_every", "3", "--sample_tokens", "12",
                                        "--stage", "3", "--layers", "2", "--d_model", "32"},
                                       out);
  INFO(out.str());
  REQUIRE(status.ok());
  const std::string text = out.str();
  CHECK(text.find("zerort demo: GPT of 2 layers, 4 heads, d_model 32") != std::string::npos);
  // wte 256*32 + wpe 64*32 + 2 layers of (2 LayerNorms 4*32, qkv 32*96+96, proj 32*32+32,
  // fc 32*128+128, proj 128*32+32) + ln_f 2*32.
  CHECK(text.find("(35,712 parameters) on 2 in-process ranks, stage 3, bf16") !=
        std::string::npos);
  // Rows: step 1 (5 numbers), step 3 and step 6 (6 numbers: with the held-out loss).
  std::vector<std::vector<double>> rows;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    std::vector<double> row;
    double v;
    for (absl::string_view x : f) {
      if (!absl::SimpleAtod(x, &v)) break;
      row.push_back(v);
    }
    if (row.size() == f.size() && (row.size() == 5 || row.size() == 6)) rows.push_back(row);
  }
  REQUIRE(rows.size() == 3u);
  CHECK(rows[0][0] == 1);
  CHECK(rows[1][0] == 3);
  CHECK(rows[2][0] == 6);
  CHECK(rows[0].size() == 5u);
  CHECK(rows[2].size() == 6u);
  CHECK(rows[2][1] < rows[0][1]);  // training loss
  const auto [before, after] = ValLoss(text);
  double v0 = 0, v1 = 0;
  REQUIRE(absl::SimpleAtod(before, &v0));
  REQUIRE(absl::SimpleAtod(after, &v1));
  CHECK(v1 < v0);
  CHECK(std::abs(rows[2][2] - v1) < 1e-4);  // the last row's held-out loss is the final one
  CHECK(text.find("tokens/s") != std::string::npos);
  const size_t untrained = text.find("before training:\nThis program is ");
  const size_t trained = text.find("after training:\nThis program is ");
  REQUIRE(untrained != std::string::npos);
  REQUIRE(trained != std::string::npos);
  CHECK(untrained < trained);
  // Generated bytes reach the terminal only as printable ASCII, newlines or middle dots.
  std::string rest = text.substr(untrained);
  rest = absl::StrReplaceAll(rest, {{"\u00b7", ""}});
  int raw = 0;
  for (unsigned char c : rest) raw += !(c == '\n' || (c >= 0x20 && c < 0x7f));
  CHECK(raw == 0);
  CHECK(text.find("every rank allocated exactly its plan") != std::string::npos);
}

TEST_CASE("Demo: --checkpoint then --resume continues bit for bit", "[zero]") {
  const std::vector<std::string> common = {"--ranks", "2", "--batch", "1", "--eval_every", "0",
                                           "--sample_tokens", "0", "--checkpoint_every", "2",
                                           "--layers", "2", "--d_model", "32"};
  auto run = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    std::ostringstream out;
    absl::Status status = RunDemoCommand(extra, out);
    INFO(out.str());
    REQUIRE(status.ok());
    return out.str();
  };
  const std::string whole = TempDir("demo_whole"), split = TempDir("demo_split");
  const std::string a = run({"--steps", "4", "--checkpoint", whole});
  CHECK(a.find("checkpoint " + whole + "/step_2\n") != std::string::npos);
  CHECK(a.find("checkpoint " + whole + "/step_4\n") != std::string::npos);
  run({"--steps", "2", "--checkpoint", split});
  const std::string c = run({"--steps", "4", "--resume", split, "--checkpoint", split});
  CHECK(c.find("resuming from " + split) != std::string::npos);
  CHECK(c.find("over steps 3-4") != std::string::npos);
  CHECK(ValLoss(c).second == ValLoss(a).second);

  absl::StatusOr<CheckpointState> x = ReadCheckpoint(whole);
  absl::StatusOr<CheckpointState> y = ReadCheckpoint(split);
  REQUIRE(x.ok());
  REQUIRE(y.ok());
  CHECK(x->info.step == 4);
  CHECK(y->info.step == 4);
  CHECK(x->master == y->master);  // float ==: bitwise here (no NaN in trained weights)
  CHECK(x->exp_avg == y->exp_avg);
  CHECK(x->exp_avg_sq == y->exp_avg_sq);
  absl::StatusOr<CheckpointState> two = ReadCheckpoint(whole + "/step_2");
  REQUIRE(two.ok());
  CHECK(two->master != x->master);  // steps 3-4 changed the weights
}

// --init-from reaches the GPT run: the weights a checkpoint of the first run exports start the
// second, whose first held-out loss is the first run's last.
TEST_CASE("Demo: --init-from starts the GPT from exported weights", "[zero]") {
  const std::vector<std::string> common = {"--ranks", "2", "--batch", "1", "--eval_every", "0",
                                           "--sample_tokens", "0", "--layers", "2",
                                           "--d_model", "32", "--steps", "2"};
  auto run = [&](std::vector<std::string> extra, absl::Status* status) {
    extra.insert(extra.end(), common.begin(), common.end());
    std::ostringstream out;
    *status = RunDemoCommand(extra, out);
    return out.str();
  };
  const std::string dir = TempDir("demo_init");
  absl::Status status;
  const std::string a = run({"--checkpoint", dir, "--checkpoint_every", "2"}, &status);
  REQUIRE(status.ok());
  REQUIRE(ExportCheckpointWeights(dir, dir + ".safetensors").ok());
  const std::string b = run({"--init-from", dir + ".safetensors"}, &status);
  INFO(b);
  REQUIRE(status.ok());
  CHECK(b.find("initial weights from " + dir + ".safetensors") != std::string::npos);
  REQUIRE(!ValLoss(a).second.empty());
  CHECK(ValLoss(b).first == ValLoss(a).second);
  run({"--init-from", dir + "/none.safetensors"}, &status);
  CHECK(absl::IsNotFound(status));
  CHECK(status.message().find("--init-from") != absl::string_view::npos);
}

TEST_CASE("Demo: a run shorter than the checkpoint interval still ends with a checkpoint",
          "[zero]") {
  auto run = [&](const std::string& dir, const std::string& every, const std::string& steps) {
    std::ostringstream out;
    const absl::Status status = RunDemoCommand(
        {"--ranks", "2", "--batch", "1", "--eval_every", "0", "--sample_tokens", "0",
         "--layers", "2", "--d_model", "32", "--steps", steps, "--checkpoint_every", every,
         "--checkpoint", dir},
        out);
    INFO(out.str());
    REQUIRE(status.ok());
    return out.str();
  };
  const std::string short_run = TempDir("demo_short"), every_step = TempDir("demo_every");
  const std::string text = run(short_run, "50", "3");
  CHECK(text.find("checkpoint " + short_run + "/step_3\n") != std::string::npos);
  // The reference: the same 3 steps saved after every step; its step_3 is the same state.
  run(every_step, "1", "3");
  absl::StatusOr<CheckpointState> end = ReadCheckpoint(short_run);
  absl::StatusOr<CheckpointState> ref = ReadCheckpoint(every_step + "/step_3");
  REQUIRE(end.ok());
  REQUIRE(ref.ok());
  CHECK(end->info.step == 3);
  CHECK(end->master == ref->master);
  CHECK(end->exp_avg == ref->exp_avg);
  CHECK(end->exp_avg_sq == ref->exp_avg_sq);
  // An interval that divides the run saves the last step once (not twice: that would be
  // AlreadyExists), and one that does not adds the end: step_2, step_4, step_5.
  const std::string odd = TempDir("demo_odd");
  const std::string five = run(odd, "2", "5");
  for (const char* step : {"/step_2\n", "/step_4\n", "/step_5\n"}) {
    CHECK(five.find("checkpoint " + odd + step) != std::string::npos);
  }
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
      {{"--model", "gpt5"}, "--model"},
      {{"--model", "mlp", "--resume", "/tmp/x"}, "--resume"},
      {{"--checkpoint_every", "0"}, "--checkpoint_every"},
      {{"--d_model", "30"}, "--d_model"},
      {{"--model", "mlp", "--layers", "2"}, "--layers"},
      {{"--model", "mlp", "--init-from", "/tmp/x.safetensors"}, "--init-from"},
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

TEST_CASE("Demo: --device cuda without a GPU fails with the reason; auto falls back to the CPU",
          "[zero]") {
  const absl::StatusOr<examples::gpt::GpuInfo> gpu = examples::gpt::ProbeGpu(0);
  if (gpu.ok()) {
    WARN("SKIPPED: a GPU is usable here (" << gpu->name << "); this case needs none");
    return;
  }
  {
    std::ostringstream out;
    const absl::Status status = RunDemoCommand({"--device", "cuda"}, out);
    INFO(status.message());
    CHECK(absl::IsFailedPrecondition(status));
    CHECK(status.message().find("--device cuda: no usable GPU: ") != absl::string_view::npos);
    CHECK(status.message().find(gpu.status().message()) != absl::string_view::npos);
    CHECK(out.str().empty());  // nothing trained, nothing printed
  }
  {
    std::ostringstream out;
    const absl::Status status = RunDemoCommand(
        {"--device=auto", "--ranks", "1", "--steps", "2", "--sample_tokens", "0"}, out);
    INFO(out.str() << status.message());
    REQUIRE(status.ok());
    CHECK(out.str().find("--device auto: no usable GPU (") != std::string::npos);
    CHECK(out.str().find("); training on the CPU") != std::string::npos);
    CHECK(out.str().find("d_model 128") != std::string::npos);  // the CPU default model
    CHECK(out.str().find("every rank allocated exactly its plan") != std::string::npos);
  }
}

TEST_CASE("Demo: --corpus trains on the named file and names a missing one", "[zero]") {
  const std::string dir = TempDir("demo_corpus");
  REQUIRE(std::filesystem::create_directories(dir));
  const std::string corpus = dir + "/corpus.txt";
  {
    std::ofstream f(corpus);
    for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  std::ostringstream out;
  absl::Status status = RunDemoCommand(
      {"--ranks", "1", "--steps", "2", "--sample_tokens", "0", "--corpus", corpus}, out);
  INFO(out.str() << status.message());
  REQUIRE(status.ok());
  CHECK(out.str().find("corpus " + corpus + "\n") != std::string::npos);

  std::ostringstream none;
  status = RunDemoCommand({"--ranks", "1", "--steps", "2", "--corpus", dir + "/absent.txt"}, none);
  CHECK(absl::IsNotFound(status));
  CHECK(status.message().find(dir + "/absent.txt") != absl::string_view::npos);
}

TEST_CASE("Demo: --device is checked and applies to the GPT only", "[zero]") {
  std::ostringstream out;
  absl::Status status = RunDemoCommand({"--device", "tpu"}, out);
  CHECK(absl::IsInvalidArgument(status));
  CHECK(status.message().find("--device must be cpu, cuda or auto, got 'tpu'") !=
        absl::string_view::npos);
  status = RunDemoCommand({"--model", "mlp", "--device", "cuda"}, out);
  CHECK(absl::IsInvalidArgument(status));
  CHECK(status.message().find("--device applies to --model gpt only") != absl::string_view::npos);
}

}  // namespace
}  // namespace zerort
