// The zerort side of the check against the `safetensors` Python package (hf_check.py): writes
// weights from a live engine and reads weights into one, dumping the engine's fp32 masters as
// text so that Python compares them with what its own loader sees.
//
//   st_tool write OUT DTYPE MAX_SHARD_BYTES DUMP [MAP]   init, export (fp32|bf16) to OUT (names
//                                                        through the name map file MAP), dump
//   st_tool read IN DUMP [MAP]                           import IN (extra tensors allowed; names
//                                                        through MAP), dump masters
//
// Two in-process ranks at stage 3, so that each rank writes and reads only its own shards. The
// dump is one line per parameter: name, then every value as %.9g (exact for fp32); an import
// also prints "ignored NAME" for each extra tensor.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status.h"
#include "checkpoint/weights.h"
#include "comm/inprocess.h"
#include "device/cpu_device.h"
#include "zero/engine.h"

namespace zerort {
namespace {

std::vector<memory::ParamSpec> Model() {
  return {{"emb", {7, 3}, "emb"}, {"w", {3, 4}, "layer"}, {"b", {4}, "layer"},
          {"h.0.g", {5}, "norm"}};
}

absl::Status Dump(const std::vector<float>& master, const std::string& path,
                  const std::vector<std::string>& ignored) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot write ", path));
  size_t at = 0;
  for (const memory::ParamSpec& p : Model()) {
    std::fprintf(f, "%s", p.name.c_str());
    for (int64_t k = 0; k < p.numel(); ++k) std::fprintf(f, " %.9g", master[at++]);
    std::fprintf(f, "\n");
  }
  for (const std::string& name : ignored) std::fprintf(f, "ignored %s\n", name.c_str());
  return std::fclose(f) == 0 ? absl::OkStatus() : absl::InternalError("cannot close " + path);
}

absl::Status OnRank(comm::Communicator* comm, Device* device, int argc, char** argv) {
  Config config;
  config.zero.stage = 3;
  config.zero.reduce_bucket_size = 16;  // several units, split across the two ranks
  config.zero.stage3_param_persistence_threshold = 0;
  config.cpu_threads = 1;
  ASSIGN_OR_RETURN(auto engine, Engine::Create(config, Model(), comm, device));
  const std::string mode = argv[1];
  std::vector<std::string> ignored;
  if (mode == "write") {
    // Values spread over many binades, negative and positive, some not representable in bf16.
    RETURN_IF_ERROR(engine->InitParams([](int i, const memory::ParamSpec& spec, float* v) {
      for (int64_t k = 0; k < spec.numel(); ++k) {
        v[k] = static_cast<float>(std::sin(1.0 + 7.0 * i + 0.37 * k) * std::pow(3.0, k % 9 - 4));
      }
    }));
    WeightsExportOptions options;
    ASSIGN_OR_RETURN(options.dtype, ParseDType(argv[3]));
    options.max_shard_bytes = std::atoll(argv[4]);
    if (argc == 7) {
      ASSIGN_OR_RETURN(options.names, WeightsNameMap::Load(argv[6]));
    }
    RETURN_IF_ERROR(ExportWeights(*engine, argv[2], options).status());
  } else {
    WeightsImportOptions options;
    options.allow_extra = true;
    if (argc == 5) {
      ASSIGN_OR_RETURN(options.names, WeightsNameMap::Load(argv[4]));
    }
    ASSIGN_OR_RETURN(WeightsImportReport report, ImportWeights(*engine, argv[2], options));
    ignored = report.ignored;
  }
  ASSIGN_OR_RETURN(std::vector<float> master, engine->GatherMasterWeights());
  if (comm->rank() != 0) return absl::OkStatus();
  return Dump(master, mode == "write" ? argv[5] : argv[3], ignored);
}

int Main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "write" && (argc == 6 || argc == 7)) ||
        (mode == "read" && (argc == 4 || argc == 5)))) {
    std::fprintf(stderr,
                 "usage: st_tool write OUT DTYPE MAX_SHARD_BYTES DUMP [MAP] | read IN DUMP [MAP]\n");
    return 2;
  }
  auto comms = comm::CreateInProcessGroup(2);
  if (!comms.ok()) {
    std::fprintf(stderr, "%s\n", comms.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<Device> device = CreateCpuDevice();
  std::vector<absl::Status> st(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { st[r] = OnRank((*comms)[r].get(), device.get(), argc, argv); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : st) {
    if (!s.ok()) {
      std::fprintf(stderr, "st_tool: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
