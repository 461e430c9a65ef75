#include "cli/ckpt_command.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "nlohmann/json.hpp"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "comm/testing/on_ranks.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/weights.h"
#include "device/testing/one_thread.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

// A checkpoint of the synthetic model after two steps on two ranks, stage 2.
std::string MakeCheckpoint() {
  const std::string tmpl = testing::TempDir("ckpt_cmd_");
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  const std::vector<absl::Status> st =
      comm::testing::OnRanks(2, {20000}, [&](int, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                         Engine::Create(config, testing::SmallModel(), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*e));
        return SaveCheckpoint(*e, tmpl).status();
      });
  REQUIRE(st[0].ok());
  REQUIRE(st[1].ok());
  return tmpl;
}

TEST_CASE("CkptCommand: inspect verifies and summarises, consolidate writes the file", "[ckpt]") {
  const std::string dir = MakeCheckpoint();
  std::ostringstream text;
  REQUIRE(RunCkptCommand({"inspect", dir}, text).ok());
  INFO(text.str());
  REQUIRE(absl::StrContains(text.str(), "step 0, saved by 2 ranks at stage 2, bf16 compute"));
  REQUIRE(absl::StrContains(text.str(), "7 parameters"));
  REQUIRE(absl::StrContains(text.str(), "rank_00001.bin"));
  REQUIRE(absl::StrContains(text.str(), "l2.w"));
  std::ostringstream json;
  REQUIRE(RunCkptCommand({"inspect", dir, "--json"}, json).ok());
  REQUIRE(absl::StrContains(json.str(), "\"world_size\": 2"));
  std::ostringstream cons;
  // Next to the checkpoint, not inside it (refused: see the data-loss cases below).
  const std::string out = dir + ".safetensors";
  REQUIRE(RunCkptCommand({"consolidate", dir, out}, cons).ok());
  std::ifstream f(out, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(absl::StrContains(bytes, "\"exp_avg_sq.head.w\""));
  // A corrupted shard fails inspect with the file named.
  {
    std::fstream g(dir + "/step_0/rank_00000.bin", std::ios::binary | std::ios::in | std::ios::out);
    g.seekp(100);
    g.put('\x7f');
  }
  std::ostringstream bad;
  const absl::Status s = RunCkptCommand({"inspect", dir}, bad);
  REQUIRE(s.code() == absl::StatusCode::kDataLoss);
  REQUIRE(absl::StrContains(s.message(), "rank_00000.bin' is corrupted"));
}

TEST_CASE("CkptCommand: export writes bf16 shards that import as the checkpoint's masters",
          "[ckpt]") {
  const std::string dir = MakeCheckpoint();
  const std::string out = dir + "-hf";
  std::ostringstream text;
  const absl::Status s = RunCkptCommand(
      {"export", dir, "--format", "safetensors", "--dtype=bf16", "--max-shard-size", "1kB", out},
      text);
  INFO(s.ToString() << "\n" << text.str());
  REQUIRE(s.ok());
  REQUIRE(absl::StrContains(text.str(), "wrote 4 file(s): step 0, 7 parameters (bf16 weights)"));
  REQUIRE(absl::StrContains(text.str(), "model.safetensors.index.json"));
  // The reference: the checkpoint's masters read by the checkpoint reader, rounded to bf16.
  absl::StatusOr<CheckpointState> state = ReadCheckpoint(dir);
  REQUIRE(state.ok());
  std::vector<float> want;
  for (const auto& m : state->master) {
    for (float f : m) want.push_back(Bf16ToFloat(FloatToBf16(f)));
  }
  auto device = testing::OneThreadCpuDevice();
  std::vector<float> got;
  const std::vector<absl::Status> st =
      comm::testing::OnRanks(1, {20000}, [&](int, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                         Engine::Create(testing::TestConfig(3, DType::kF32, 1, 0, false),
                                        testing::SmallModel(), comm, device.get()));
        RETURN_IF_ERROR(ImportWeights(*e, out).status());
        ASSIGN_OR_RETURN(got, e->GatherMasterWeights());
        return absl::OkStatus();
      });
  REQUIRE(st[0].ok());
  REQUIRE(got == want);
  std::ostringstream err;
  REQUIRE(absl::StrContains(RunCkptCommand({"export", dir, out}, err).message(),
                            "the one format is safetensors"));
  REQUIRE(absl::StrContains(
      RunCkptCommand({"export", dir, "--format", "safetensors", "--dtype", "fp16", out}, err)
          .message(),
      "use fp32 or bf16"));
  REQUIRE(absl::StrContains(RunCkptCommand({"export", dir, "--format", "safetensors",
                                            "--max-shard-size", "lots", out}, err)
                                .message(),
                            "lots"));
}

TEST_CASE("CkptCommand: export --name-map writes the mapped names", "[ckpt]") {
  const std::string dir = MakeCheckpoint();
  const std::string map = dir + "-out.map", out = dir + "-mapped.safetensors";
  {
    std::ofstream f(map);
    f << "# parameter -> file\nregex l(\\d)\\.(.) model.layers.$1.$2\nprefix embed. model.embed.\n";
  }
  std::ostringstream text;
  const absl::Status s = RunCkptCommand(
      {"export", dir, "--format", "safetensors", "--name-map", map, out}, text);
  INFO(s.ToString());
  REQUIRE(s.ok());
  absl::StatusOr<safetensors::FileHeader> h = safetensors::ReadHeader(out);
  REQUIRE(h.ok());
  std::vector<std::string> names;
  for (const auto& t : h->tensors) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  REQUIRE(names == std::vector<std::string>{"head.w", "model.embed.w", "model.layers.0.b",
                                            "model.layers.0.w", "model.layers.1.b",
                                            "model.layers.1.w", "model.layers.2.w"});
  {
    std::ofstream f(map);
    f << "\nglob l* x\n";
  }
  std::ostringstream err;
  const absl::Status dup = RunCkptCommand(
      {"export", dir, "--format", "safetensors", "--name-map", map, out}, err);
  REQUIRE(dup.code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(absl::StrContains(dup.message(), "by rule 1 (glob 'l*' -> 'x', line 2 of " + map));
  REQUIRE(absl::IsNotFound(RunCkptCommand({"export", dir, "--format", "safetensors",
                                           "--name-map", dir + "-none.map", out}, err)));
}

TEST_CASE("CkptCommand: bad arguments are InvalidArgument naming the problem", "[ckpt]") {
  std::ostringstream out;
  REQUIRE(RunCkptCommand({}, out).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(absl::StrContains(RunCkptCommand({"frobnicate"}, out).message(), "'frobnicate'"));
  REQUIRE(absl::StrContains(RunCkptCommand({"inspect", "a", "--yaml"}, out).message(), "--yaml"));
  REQUIRE(RunCkptCommand({"consolidate", "a"}, out).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(RunCkptCommand({"inspect", "/nonexistent/ckpt"}, out).code() ==
          absl::StatusCode::kNotFound);
}

TEST_CASE("CkptCommand: a checkpoint path that is not UTF-8 inspects as JSON with U+FFFD",
          "[ckpt]") {
  const std::string dir = MakeCheckpoint();
  const std::string odd = dir + "\xff";
  REQUIRE(std::rename(dir.c_str(), odd.c_str()) == 0);
  std::ostringstream json;
  const absl::Status s = RunCkptCommand({"inspect", odd, "--json"}, json);
  INFO(s.ToString());
  REQUIRE(s.ok());
  const auto parsed = nlohmann::json::parse(json.str());  // throws if not valid JSON
  REQUIRE(absl::EndsWith(parsed["dir"].get<std::string>(), "\xef\xbf\xbd/step_0"));
  std::ostringstream text;
  REQUIRE(RunCkptCommand({"inspect", odd}, text).ok());
  REQUIRE(absl::StrContains(text.str(), "\\xff"));
  REQUIRE(text.str().find('\xff') == std::string::npos);
}

TEST_CASE("CkptCommand: consolidate refuses OUT inside the checkpoint and an existing OUT "
          "without --force", "[ckpt]") {
  const std::string dir = MakeCheckpoint();
  std::ostringstream out;
  const std::string shard = dir + "/step_0/rank_00000.bin";
  std::ifstream f(shard, std::ios::binary);
  const std::string before((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const std::string& target : {shard, dir + "/step_0/manifest.json", dir + "/latest"}) {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"consolidate", dir, target},
          std::vector<std::string>{"consolidate", dir, target, "--force"},
          std::vector<std::string>{"consolidate", dir + "/step_0", target, "--force"}}) {
      INFO(target);
      const absl::Status s = RunCkptCommand(args, out);
      REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
      REQUIRE(absl::StrContains(s.message(), "refusing to write"));
    }
  }
  std::ifstream g(shard, std::ios::binary);
  REQUIRE(std::string((std::istreambuf_iterator<char>(g)), std::istreambuf_iterator<char>()) ==
          before);
  REQUIRE(RunCkptCommand({"inspect", dir}, out).ok());  // still verifies
  const std::string target = dir + ".safetensors";
  REQUIRE(RunCkptCommand({"consolidate", dir, target}, out).ok());
  REQUIRE(RunCkptCommand({"consolidate", dir, target}, out).code() ==
          absl::StatusCode::kAlreadyExists);
  REQUIRE(RunCkptCommand({"consolidate", dir, target, "--force"}, out).ok());
  REQUIRE(RunCkptCommand({"consolidate", dir, target, "--frobnicate"}, out).code() ==
          absl::StatusCode::kInvalidArgument);
}

TEST_CASE("CkptCommand: what a checkpoint holds is printed escaped, never raw", "[ckpt]") {
  const std::string dir = MakeCheckpoint();
  {
    std::ofstream latest(dir + "/latest", std::ios::trunc);
    latest << "\x1b]0;pwned\x07\x1b[2J";
  }
  std::ostringstream out;
  const absl::Status s = RunCkptCommand({"inspect", dir}, out);
  REQUIRE(s.code() == absl::StatusCode::kDataLoss);
  REQUIRE(s.message().find('\x1b') == absl::string_view::npos);
  REQUIRE(absl::StrContains(s.message(), "\\x1b]0;pwned"));
  const absl::Status flag = RunCkptCommand({"inspect", dir, "--\x1b[2J"}, out);
  REQUIRE(flag.message().find('\x1b') == absl::string_view::npos);
}

}  // namespace
}  // namespace zerort
