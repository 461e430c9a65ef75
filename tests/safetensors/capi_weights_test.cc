// The C ABI's weights and parameter-group calls (capi/zero_c.h, the section "Weights as
// safetensors, and parameter groups"), through the C functions a trainer in C calls.
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "base/dtype.h"
#include "checkpoint/safetensors.h"
#include "zerort/zero_c.h"

namespace {

std::string TestDir(const char* name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// "w" [3, 4] and "b" [4] in module "l", "e" [2, 2] with its own group {0.3, x2}.
struct Job {
  zr_comm* comm = nullptr;
  zr_device* device = nullptr;
  zr_engine* engine = nullptr;
  ~Job() {
    zr_engine_destroy(engine);
    zr_device_destroy(device);
    zr_comm_destroy(comm);
  }
};

const int64_t kW[] = {3, 4}, kB[] = {4}, kE[] = {2, 2};
constexpr int64_t kNumel = 12 + 4 + 4;

void Create(Job* job) {
  REQUIRE(zr_comm_group_create(1, 0, &job->comm) == ZR_OK);
  REQUIRE(zr_cpu_device_create(1, &job->device) == ZR_OK);
  zr_param_spec params[3] = {{sizeof(zr_param_spec), "w", 2, kW, "l", 0, 0, 0},
                             {sizeof(zr_param_spec), "b", 1, kB, "l", 0, 0, 0},
                             {sizeof(zr_param_spec), "e", 2, kE, "emb", 1, 0.3, 2.0}};
  zr_engine_options options = {sizeof(zr_engine_options), nullptr, 1, nullptr};
  const char* config =
      R"({"zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}})";
  const zr_status st =
      zr_engine_create(config, params, 3, job->comm, job->device, &options, &job->engine);
  INFO(zr_last_error());
  REQUIRE(st == ZR_OK);
}

void Init(void*, int index, const char*, int, const int64_t*, int64_t numel, float* values) {
  for (int64_t k = 0; k < numel; ++k) values[k] = 0.1f * (index + 1) + 0.0123f * k;
}

std::vector<float> Masters(zr_engine* engine) {
  std::vector<float> out(kNumel);
  REQUIRE(zr_engine_gather_master_weights(engine, out.data(), kNumel) == ZR_OK);
  return out;
}

TEST_CASE("C ABI: a parameter's group and settings", "[capi]") {
  Job job;
  Create(&job);
  // Hand-worked: "w" is 2-d in no group (the step's decay 0.1, lr 0.01); "b" is 1-d, so
  // no_decay_1d gives it decay 0; "e" has its own group (decay 0.3, twice the lr).
  const double want[3][4] = {{0, 0.1, 1, 0.01}, {1, 0, 1, 0.01}, {1, 0.3, 2, 0.02}};
  for (int i = 0; i < 3; ++i) {
    INFO("parameter " << i);
    zr_param_group_info info = {sizeof info};
    REQUIRE(zr_engine_param_group(job.engine, i, &info) == ZR_OK);
    CHECK(info.has_group == want[i][0]);
    CHECK(info.weight_decay == Approx(want[i][1]));
    CHECK(info.lr_scale == want[i][2]);
    CHECK(info.lr == Approx(want[i][3]));
  }
  REQUIRE(zr_engine_set_learning_rate(job.engine, 0.5) == ZR_OK);
  zr_param_group_info info = {sizeof info};
  REQUIRE(zr_engine_param_group(job.engine, 2, &info) == ZR_OK);
  CHECK(info.lr == 1.0);
  CHECK(zr_engine_param_group(job.engine, 3, &info) == ZR_OUT_OF_RANGE);
  CHECK(std::string(zr_last_error()).find("parameter index 3") != std::string::npos);
  zr_param_group_info unsized = {0};
  CHECK(zr_engine_param_group(job.engine, 0, &unsized) == ZR_INVALID_ARGUMENT);
}

TEST_CASE("C ABI: weights out and back in, extra tensors listed", "[capi]") {
  const std::string dir = TestDir("capi_weights");
  Job a;
  Create(&a);
  REQUIRE(zr_engine_init_params(a.engine, Init, nullptr, 1) == ZR_OK);
  const std::vector<float> init = Masters(a.engine);
  const std::string file = dir + ".safetensors";
  REQUIRE(zr_engine_export_weights(a.engine, file.c_str(), ZR_BF16, 0) == ZR_OK);
  CHECK(zr_engine_export_weights(a.engine, file.c_str(), ZR_F16, 0) == ZR_INVALID_ARGUMENT);

  Job b;
  Create(&b);
  int64_t count = -1;
  REQUIRE(zr_engine_import_weights(b.engine, file.c_str(), 0, nullptr, 0, &count) == ZR_OK);
  CHECK(count == 0);
  std::vector<float> want = init;
  for (float& f : want) f = zerort::Bf16ToFloat(zerort::FloatToBf16(f));
  CHECK(Masters(b.engine) == want);

  // A file with one more tensor: refused, or ignored and named.
  const std::vector<float> w(12, 1.0f), bias(4, 2.0f), e(4, 3.0f), extra(2, 4.0f);
  const std::string more = dir + "_more.safetensors";
  REQUIRE(zerort::safetensors::WriteFile(more,
                                         {{"b", {4}, bias}, {"e", {2, 2}, e},
                                          {"rotary.inv_freq", {2}, extra}, {"w", {3, 4}, w}},
                                         zerort::DType::kF32, {})
              .ok());
  CHECK(zr_engine_import_weights(b.engine, more.c_str(), 0, nullptr, 0, nullptr) ==
        ZR_INVALID_ARGUMENT);
  CHECK(std::string(zr_last_error()).find("rotary.inv_freq") != std::string::npos);
  CHECK(Masters(b.engine) == want);  // a failed import leaves the engine as it was
  char names[64];
  REQUIRE(zr_engine_import_weights(b.engine, more.c_str(), 1, names, sizeof names, &count) ==
          ZR_OK);
  CHECK(count == 1);
  CHECK(std::string(names) == "rotary.inv_freq\n");
  char cut[4];
  REQUIRE(zr_engine_import_weights(b.engine, more.c_str(), 1, cut, sizeof cut, nullptr) == ZR_OK);
  CHECK(std::string(cut) == "rot");
  const std::vector<float> loaded = Masters(b.engine);  // registration order: w, b, e
  CHECK(loaded[0] == 1.0f);
  CHECK(loaded[12] == 2.0f);
  CHECK(loaded[19] == 3.0f);

  // From a checkpoint, without an engine: the same bytes as the live export.
  const std::string root = dir + "_ckpt";
  REQUIRE(zr_engine_save_checkpoint(a.engine, root.c_str()) == ZR_OK);
  const std::string offline = dir + "_offline.safetensors";
  REQUIRE(zr_checkpoint_export_weights(root.c_str(), offline.c_str(), ZR_BF16, 0) == ZR_OK);
  CHECK(ReadAll(offline) == ReadAll(file));
  CHECK(zr_checkpoint_export_weights(nullptr, offline.c_str(), ZR_BF16, 0) == ZR_INVALID_ARGUMENT);
}

}  // namespace

namespace {

TEST_CASE("C ABI: weights through a name map, out and back in", "[capi]") {
  const std::string dir = TestDir("capi_weights_mapped");
  Job a;
  Create(&a);
  REQUIRE(zr_engine_init_params(a.engine, Init, nullptr, 1) == ZR_OK);
  const std::vector<float> init = Masters(a.engine);
  const char* out_map = "# parameter -> file\nregex ([wb]) model.layer.$1\nexact e model.embed\n";
  const char* in_map =
      "prefix model.layer.\nexact model.embed e\nignore lm_head.weight\nignore *.inv_freq\n";
  const std::string file = dir + ".safetensors";
  REQUIRE(zr_engine_export_weights_mapped(a.engine, file.c_str(), ZR_F32, 0, out_map) == ZR_OK);
  zerort::safetensors::FileHeader h = zerort::safetensors::ReadHeader(file).value();
  std::vector<std::string> names;
  for (const auto& t : h.tensors) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"model.embed", "model.layer.b", "model.layer.w"});

  // Back in through the inverse map, with a tied head and a buffer the map ignores.
  const std::vector<float> w(12, 1.0f), bias(4, 2.0f), e(4, 3.0f), extra(2, 4.0f);
  const std::string hf = dir + "_hf.safetensors";
  REQUIRE(zerort::safetensors::WriteFile(hf,
                                         {{"lm_head.weight", {2}, extra},
                                          {"model.embed", {2, 2}, e},
                                          {"model.layer.b", {4}, bias},
                                          {"model.layer.w", {3, 4}, w},
                                          {"model.rotary.inv_freq", {2}, extra}},
                                         zerort::DType::kF32, {})
              .ok());
  Job b;
  Create(&b);
  char ignored[128];
  int64_t count = -1;
  REQUIRE(zr_engine_import_weights_mapped(b.engine, hf.c_str(), in_map, 0, ignored,
                                          sizeof ignored, &count) == ZR_OK);
  CHECK(count == 2);
  CHECK(std::string(ignored) == "lm_head.weight\nmodel.rotary.inv_freq\n");
  const std::vector<float> loaded = Masters(b.engine);  // registration order: w, b, e
  CHECK(loaded[0] == 1.0f);
  CHECK(loaded[12] == 2.0f);
  CHECK(loaded[19] == 3.0f);
  // And the file engine a wrote: a round trip gives the same bytes.
  REQUIRE(zr_engine_import_weights_mapped(b.engine, file.c_str(), in_map, 0, nullptr, 0,
                                          nullptr) == ZR_OK);
  CHECK(Masters(b.engine) == init);
  const std::string again = dir + "_again.safetensors";
  REQUIRE(zr_engine_export_weights_mapped(b.engine, again.c_str(), ZR_F32, 0, out_map) == ZR_OK);
  CHECK(ReadAll(again) == ReadAll(file));
  const std::string root = dir + "_ckpt";
  REQUIRE(zr_engine_save_checkpoint(a.engine, root.c_str()) == ZR_OK);
  const std::string offline = dir + "_offline.safetensors";
  REQUIRE(zr_checkpoint_export_weights_mapped(root.c_str(), offline.c_str(), ZR_F32, 0,
                                              out_map) == ZR_OK);
  CHECK(ReadAll(offline) == ReadAll(file));

  // Without the map the names are unknown; a bad rule names its line; two tensors to one
  // parameter name both.
  CHECK(zr_engine_import_weights_mapped(b.engine, hf.c_str(), nullptr, 0, nullptr, 0,
                                        nullptr) == ZR_NOT_FOUND);
  CHECK(zr_engine_import_weights_mapped(b.engine, hf.c_str(), "exact a", 0, nullptr, 0,
                                        nullptr) == ZR_INVALID_ARGUMENT);
  CHECK(std::string(zr_last_error()).find("zr_engine_import_weights_mapped: name_map line 1") !=
        std::string::npos);
  CHECK(zr_engine_import_weights_mapped(b.engine, hf.c_str(), "glob model.layer.* w", 1,
                                        nullptr, 0, nullptr) == ZR_INVALID_ARGUMENT);
  CHECK(std::string(zr_last_error()).find("two file tensors map to 'w': 'model.layer.b'") !=
        std::string::npos);
  CHECK(Masters(b.engine) == init);  // a failed import leaves the engine as it was
}

}  // namespace
