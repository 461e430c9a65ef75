// Two-dimensional parallelism with the engine as the data-parallel half: world 4 = 2
// tensor-parallel ranks x 2 data-parallel ranks on the in-process group. Each tensor-parallel
// rank owns half of every weight matrix (one split by rows, as a column-parallel linear layer
// holds it, one by columns, as a row-parallel one does) and gets an engine over its
// data-parallel group (Communicator::Split). Gradient clipping needs the norm over the whole
// model: each engine measures its half (Engine::ComputeGradNorm, over its data-parallel group),
// the tensor-parallel ranks add the squares in double through their own group, and every engine
// applies the same coefficient (ApplyOptions::clip_coef), the recipe of docs/embedding.md.
//
// Reference: one process, whole matrices, the double-precision AdamW with clipping of
// zero/testing/synthetic_trainer.h (SerialAdamW). Not bitwise: the engines reduce the two
// data-parallel gradients in fp32 (one rounding the reference does not make), run AdamW in fp32,
// and sum the norm's squares in another order. The bound is engine_test's for fp32 training
// against the same reference: 1e-6, relative to max(|w|, 1), after 10 steps with clipping on
// every step; the norm within 1e-6 relative.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/agree.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

constexpr int kTp = 2, kDp = 2, kSteps = 10;
constexpr double kClip = 0.05;

// The whole model, as the serial reference trains it.
std::vector<memory::ParamSpec> WholeModel() {
  return {{"l0.w", {24, 10}, "l0"}, {"l1.w", {10, 24}, "l1"}, {"l2.w", {16, 6}, "l2"}};
}
// How a matrix is cut between the tensor-parallel ranks.
enum class Cut { kRows, kColumns };
constexpr Cut kCuts[] = {Cut::kRows, Cut::kColumns, Cut::kRows};

// Tensor-parallel rank t's half of each matrix.
std::vector<memory::ParamSpec> HalfModel() {
  std::vector<memory::ParamSpec> s = WholeModel();
  for (size_t i = 0; i < s.size(); ++i) s[i].shape[kCuts[i] == Cut::kRows ? 0 : 1] /= kTp;
  return s;
}

// Element k (row-major) of tensor-parallel rank t's half of matrix i: its index in the whole.
int64_t Whole(int i, int t, int64_t k) {
  const std::vector<memory::ParamSpec> whole = WholeModel();
  const int64_t rows = whole[i].shape[0], cols = whole[i].shape[1];
  if (kCuts[i] == Cut::kRows) return t * (rows / kTp) * cols + k;
  const int64_t half = cols / kTp;
  return (k / half) * cols + t * half + k % half;
}

// One tensor-parallel x data-parallel rank's training: InitValue and GradValue of the whole
// matrices' elements (the data-parallel rank's gradients), the norm combined across the
// tensor-parallel group. Returns this half's masters and each step's combined norm.
struct Half {
  std::vector<float> master;
  std::vector<double> norms;
  std::vector<double> coefs;
  std::vector<float> reloaded;  // from this half's checkpoint
};

absl::StatusOr<Half> TrainHalf(int stage, int tp, int dp, comm::Communicator* tp_comm,
                               comm::Communicator* dp_comm, Device* device,
                               const std::string& ckpt_root) {
  Config c = testing::TestConfig(stage, DType::kF32, /*gas=*/1, /*clip=*/kClip, false);
  ASSIGN_OR_RETURN(auto e, Engine::Create(c, HalfModel(), dp_comm, device));
  RETURN_IF_ERROR(e->InitParams([tp](int i, const memory::ParamSpec& spec, float* v) {
    for (int64_t k = 0; k < spec.numel(); ++k) v[k] = testing::InitValue(i, Whole(i, tp, k));
  }));
  // The tensor-parallel group's exchange of exact values (comm/agree.h): a double travels as its
  // bits, so both ranks add the same squares in the same order and get the same coefficient.
  comm::DirectHostExchange tp_exchange(tp_comm);
  Half out;
  std::vector<std::vector<float>> host;
  for (int step = 0; step < kSteps; ++step) {
    for (int u = 0; u < e->num_units(); ++u) {
      RETURN_IF_ERROR(e->Gather(u));
      for (int i : e->plan().units[u].params) {
        ASSIGN_OR_RETURN(void* g, e->grad(i));
        const int64_t n = e->plan().params[i].numel;
        host.emplace_back(n);
        for (int64_t k = 0; k < n; ++k) {
          host.back()[k] = testing::GradValue(dp, step, 0, i, Whole(i, tp, k));
        }
        RETURN_IF_ERROR(e->device()->Copy(g, host.back().data(), n * sizeof(float),
                                          e->compute_stream()));
        RETURN_IF_ERROR(e->GradReady(i));
      }
      RETURN_IF_ERROR(e->Release(u));
    }
    ASSIGN_OR_RETURN(GradNormInfo mine, e->ComputeGradNorm());
    RETURN_IF_ERROR(e->device()->Synchronize(e->compute_stream()));
    host.clear();
    const double sq = mine.norm * mine.norm;
    uint64_t bits;
    std::memcpy(&bits, &sq, sizeof bits);
    ASSIGN_OR_RETURN(std::vector<uint64_t> all, comm::AllGatherU64(tp_exchange, {bits}));
    double total = 0;
    for (uint64_t b : all) {  // in tensor-parallel rank order, on every rank alike
      double x;
      std::memcpy(&x, &b, sizeof x);
      total += x;
    }
    const double norm = std::sqrt(total);
    // The engine's own rule (zero/engine_step.cc) applied to the whole model's norm.
    const double coef = norm > kClip ? kClip / (norm + 1e-6) : 1.0;
    ApplyOptions apply;
    apply.clip_coef = coef;
    RETURN_IF_ERROR(e->ApplyStep(apply).status());
    out.norms.push_back(norm);
    out.coefs.push_back(coef);
  }
  ASSIGN_OR_RETURN(out.master, e->GatherMasterWeights());
  // Each tensor-parallel rank checkpoints its engine into a root of its own (the engines hold
  // different slices), and a fresh engine of the same slices reads it back.
  const std::string root = absl::StrCat(ckpt_root, "/tp_", tp);
  RETURN_IF_ERROR(SaveCheckpoint(*e, root).status());
  ASSIGN_OR_RETURN(auto fresh, Engine::Create(c, HalfModel(), dp_comm, device));
  RETURN_IF_ERROR(LoadCheckpoint(*fresh, root));
  ASSIGN_OR_RETURN(out.reloaded, fresh->GatherMasterWeights());
  return out;
}

// The serial reference's norm of step t's averaged whole-model gradient (what it clips by).
double SerialNorm(int step) {
  const std::vector<memory::ParamSpec> whole = WholeModel();
  double sum = 0;
  for (int i = 0; i < static_cast<int>(whole.size()); ++i) {
    for (int64_t k = 0; k < whole[i].numel(); ++k) {
      double g = 0;
      for (int r = 0; r < kDp; ++r) g += testing::GradValue(r, step, 0, i, k);
      g /= kDp;
      sum += g * g;
    }
  }
  return std::sqrt(sum);
}

TEST_CASE("Engine 2-D: 2 tensor-parallel x 2 data-parallel ranks match the serial whole-matrix "
          "AdamW with clipping", "[zero][2d]") {
  const Config config = testing::TestConfig(1, DType::kF32, 1, kClip, false);
  const std::vector<double> ref =
      testing::SerialAdamW(WholeModel(), kDp, kSteps, 1, kClip, config.optimizer);
  const std::vector<memory::ParamSpec> whole = WholeModel();
  std::vector<int64_t> whole_offset(whole.size() + 1, 0);
  for (size_t i = 0; i < whole.size(); ++i) {
    whole_offset[i + 1] = whole_offset[i] + whole[i].numel();
  }
  const std::vector<memory::ParamSpec> halves = HalfModel();

  for (int stage = 1; stage <= 3; ++stage) {
    INFO("stage " << stage);
    auto device = CreateCpuDevice();
    const std::string root = testing::TempDir("tp_dp_ckpt_");
    std::vector<Half> runs(kTp * kDp);
    // Rank = dp * kTp + tp: the tensor-parallel ranks of one replica are neighbours (as on one
    // node's fast links), the data-parallel group is every kTp-th rank.
    const std::vector<absl::Status> st = comm::testing::OnRanks(
        kTp * kDp, {20000}, [&](int r, comm::Communicator* world) -> absl::Status {
          const int tp = r % kTp, dp = r / kTp;
          ASSIGN_OR_RETURN(auto tp_comm, world->Split(/*color=*/dp, /*key=*/tp));
          ASSIGN_OR_RETURN(auto dp_comm, world->Split(/*color=*/tp, /*key=*/dp));
          if (tp_comm->rank() != tp || dp_comm->rank() != dp || dp_comm->size() != kDp) {
            return absl::InternalError("unexpected split");
          }
          ASSIGN_OR_RETURN(runs[r], TrainHalf(stage, tp, dp, tp_comm.get(), dp_comm.get(),
                                              device.get(), root));
          return absl::OkStatus();
        });
    for (int r = 0; r < kTp * kDp; ++r) {
      INFO("rank " << r << ": " << st[r].ToString());
      REQUIRE(st[r].ok());
    }
    // Every rank clipped every step by the same coefficient, the serial norm's.
    for (int step = 0; step < kSteps; ++step) {
      CAPTURE(step);
      const double want = SerialNorm(step);
      CHECK(runs[0].coefs[step] < 1);
      CHECK(std::fabs(runs[0].norms[step] - want) <= 1e-6 * want);
      for (int r = 1; r < kTp * kDp; ++r) CHECK(runs[r].coefs[step] == runs[0].coefs[step]);
    }
    // The data-parallel replicas of a half agree bit for bit; the halves, put back into whole
    // matrices, follow the serial reference.
    double worst = 0;
    for (int r = 0; r < kTp * kDp; ++r) {
      const int tp = r % kTp;
      REQUIRE(runs[r].master == runs[tp].master);
      CHECK(runs[r].reloaded == runs[r].master);
      int64_t at = 0;
      for (int i = 0; i < static_cast<int>(halves.size()); ++i) {
        for (int64_t k = 0; k < halves[i].numel(); ++k, ++at) {
          const double w = ref[whole_offset[i] + Whole(i, tp, k)];
          worst = std::max(worst, std::fabs(runs[r].master[at] - w) / std::max(std::fabs(w), 1.0));
        }
      }
      REQUIRE(at == static_cast<int64_t>(runs[r].master.size()));
    }
    INFO("worst relative difference " << worst);
    CHECK(worst <= 1e-6);
  }
}

}  // namespace
}  // namespace zerort
