#include "examples/mlp/mlp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "device/cpu_device.h"

namespace zerort {
namespace examples {
namespace {

// splitmix64: a tiny, portable generator, so data and initial weights are the same everywhere.
uint64_t NextU64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// In [0, 1), 24 random bits.
float Uniform(uint64_t& state) { return static_cast<float>(NextU64(state) >> 40) * 0x1p-24f; }

float Normal(uint64_t& state) {
  const float u1 = std::max(Uniform(state), 1e-7f);
  const float u2 = Uniform(state);
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530718f * u2);
}

uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t s = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull);
  return NextU64(s);
}

void ToFloat(const void* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
  }
}

void FromFloat(const float* src, int64_t n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToBf16(src[i]);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToHalf(src[i]);
      return;
  }
}

// out (n, dout) = in (n, din) * w^T + b, with w (dout, din); then tanh unless `linear`.
void Dense(const float* in, int n, int din, const float* w, const float* b, int dout, bool linear,
           float* out) {
  for (int s = 0; s < n; ++s) {
    const float* x = in + static_cast<int64_t>(s) * din;
    for (int o = 0; o < dout; ++o) {
      const float* wr = w + static_cast<int64_t>(o) * din;
      float acc = b[o];
      for (int i = 0; i < din; ++i) acc += wr[i] * x[i];
      out[static_cast<int64_t>(s) * dout + o] = linear ? acc : std::tanh(acc);
    }
  }
}

float Mse(const std::vector<float>& pred, const std::vector<float>& target) {
  double sum = 0;
  for (size_t i = 0; i < pred.size(); ++i) {
    const double d = static_cast<double>(pred[i]) - target[i];
    sum += d * d;
  }
  return static_cast<float>(sum / static_cast<double>(pred.size()));
}

// Stage 3 keeps only the units the current layer reads gathered. A layer's weight and bias
// usually share a unit, several small layers may share one, and a huge layer may be split, so
// the set is computed from unit_of() rather than assumed. Gather and Release are no-ops below
// stage 3, so the trainer calls them unconditionally.
class HeldUnits {
 public:
  explicit HeldUnits(Engine& engine) : engine_(engine) {}

  // Leaves exactly `units` gathered, gathering in the given order (the direction of the pass,
  // which is what the engine prefetches along).
  absl::Status Hold(const std::vector<int>& units) {
    for (auto it = held_.begin(); it != held_.end();) {
      if (std::find(units.begin(), units.end(), *it) == units.end()) {
        RETURN_IF_ERROR(engine_.Release(*it));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    for (int u : units) {
      if (std::find(held_.begin(), held_.end(), u) != held_.end()) continue;
      RETURN_IF_ERROR(engine_.Gather(u));
      held_.push_back(u);
    }
    return absl::OkStatus();
  }

  absl::Status ReleaseAll() { return Hold({}); }

 private:
  Engine& engine_;
  std::vector<int> held_;
};

// Units holding layer l's parameters (2l: weight, 2l+1: bias), in the order a pass meets them:
// plan units run in backward order, so forward meets higher unit indices first.
std::vector<int> LayerUnits(const Engine& engine, int layer, bool forward) {
  std::vector<int> units = {engine.unit_of(2 * layer), engine.unit_of(2 * layer + 1)};
  std::sort(units.begin(), units.end());
  units.erase(std::unique(units.begin(), units.end()), units.end());
  if (forward) std::reverse(units.begin(), units.end());
  return units;
}

absl::Status ReadParam(Engine& engine, int index, DType dtype, int64_t numel, float* out) {
  ASSIGN_OR_RETURN(void* p, engine.param(index));
  ToFloat(p, dtype, numel, out);
  return absl::OkStatus();
}

absl::Status WriteGrad(Engine& engine, int index, DType dtype, const std::vector<float>& g) {
  ASSIGN_OR_RETURN(void* p, engine.grad(index));
  FromFloat(g.data(), static_cast<int64_t>(g.size()), dtype, p);
  return engine.GradReady(index);
}

}  // namespace

Teacher::Teacher(const MlpShape& shape, uint64_t seed) : shape_(shape), seed_(seed) {
  uint64_t state = seed;
  for (int l = 0; l < shape.num_layers(); ++l) {
    const int din = shape.dims[l], dout = shape.dims[l + 1];
    // Gain above 1 keeps the hidden tanh units away from their linear regime, so the target is
    // a genuinely non-linear function of the input.
    const float stddev = 1.5f / std::sqrt(static_cast<float>(din));
    std::vector<float> w(static_cast<size_t>(din) * dout), b(dout);
    for (float& v : w) v = stddev * Normal(state);
    for (float& v : b) v = 0.1f * Normal(state);
    w_.push_back(std::move(w));
    b_.push_back(std::move(b));
  }
}

Batch Teacher::Sample(int rank, int64_t step, int n) const {
  Batch batch;
  batch.n = n;
  const int din = shape_.dims.front();
  uint64_t state = Mix(Mix(seed_, static_cast<uint64_t>(rank) + 1), static_cast<uint64_t>(step));
  batch.x.resize(static_cast<size_t>(n) * din);
  for (float& v : batch.x) v = Normal(state);
  std::vector<float> a = batch.x, next;
  for (int l = 0; l < shape_.num_layers(); ++l) {
    next.assign(static_cast<size_t>(n) * shape_.dims[l + 1], 0.0f);
    Dense(a.data(), n, shape_.dims[l], w_[l].data(), b_[l].data(), shape_.dims[l + 1],
          l + 1 == shape_.num_layers(), next.data());
    a.swap(next);
  }
  batch.y = std::move(a);
  return batch;
}

Mlp::Mlp(MlpShape shape) : shape_(std::move(shape)) {}

std::vector<memory::ParamSpec> Mlp::ParamSpecs() const {
  std::vector<memory::ParamSpec> specs;
  for (int l = 0; l < shape_.num_layers(); ++l) {
    const std::string module = absl::StrCat("fc", l);
    specs.push_back({module + ".w", {shape_.dims[l + 1], shape_.dims[l]}, module});
    specs.push_back({module + ".b", {shape_.dims[l + 1]}, module});
  }
  return specs;
}

int64_t Mlp::num_elements() const {
  int64_t n = 0;
  for (int l = 0; l < shape_.num_layers(); ++l) {
    n += static_cast<int64_t>(shape_.dims[l]) * shape_.dims[l + 1] + shape_.dims[l + 1];
  }
  return n;
}

Engine::Initializer Mlp::Initializer() const {
  const MlpShape shape = shape_;
  return [shape](int index, const memory::ParamSpec& spec, float* values) {
    int64_t numel = 1;
    for (int64_t d : spec.shape) numel *= d;
    if (index % 2 == 1) {  // bias
      std::fill(values, values + numel, 0.0f);
      return;
    }
    const float bound = 1.0f / std::sqrt(static_cast<float>(shape.dims[index / 2]));
    uint64_t state = Mix(shape.seed, static_cast<uint64_t>(index));
    for (int64_t i = 0; i < numel; ++i) values[i] = bound * (2.0f * Uniform(state) - 1.0f);
  };
}

absl::StatusOr<float> Mlp::ForwardBackward(Engine& engine, const Batch& batch) const {
  const DType dtype = engine.plan().options.compute_dtype;
  const int layers = shape_.num_layers();
  const int n = batch.n;
  const std::vector<int>& dims = shape_.dims;
  if (batch.x.size() != static_cast<size_t>(n) * dims.front() ||
      batch.y.size() != static_cast<size_t>(n) * dims.back()) {
    return absl::InvalidArgumentError(absl::StrCat("batch of ", n, " samples has ",
                                                   batch.x.size(), " inputs and ",
                                                   batch.y.size(), " targets"));
  }
  HeldUnits held(engine);
  std::vector<float> w, b;

  // Forward: act[l] is the input of layer l, (n, dims[l]); act[layers] the prediction.
  std::vector<std::vector<float>> act(layers + 1);
  act[0] = batch.x;
  for (int l = 0; l < layers; ++l) {
    RETURN_IF_ERROR(held.Hold(LayerUnits(engine, l, /*forward=*/true)));
    w.resize(static_cast<size_t>(dims[l]) * dims[l + 1]);
    b.resize(dims[l + 1]);
    RETURN_IF_ERROR(ReadParam(engine, 2 * l, dtype, static_cast<int64_t>(w.size()), w.data()));
    RETURN_IF_ERROR(ReadParam(engine, 2 * l + 1, dtype, dims[l + 1], b.data()));
    act[l + 1].resize(static_cast<size_t>(n) * dims[l + 1]);
    Dense(act[l].data(), n, dims[l], w.data(), b.data(), dims[l + 1], l + 1 == layers,
          act[l + 1].data());
  }
  RETURN_IF_ERROR(held.ReleaseAll());
  const float loss = Mse(act[layers], batch.y);

  // dLoss/dprediction, times the loss scale so that small fp16 gradients do not flush to zero.
  const float scale = static_cast<float>(engine.loss_scale());
  std::vector<float> delta(act[layers].size());
  const float k = 2.0f * scale / static_cast<float>(delta.size());
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = k * (act[layers][i] - batch.y[i]);

  // Backward, last layer first: the order in which the plan's units become ready.
  std::vector<float> gw, gb, prev;
  for (int l = layers - 1; l >= 0; --l) {
    const int din = dims[l], dout = dims[l + 1];
    RETURN_IF_ERROR(held.Hold(LayerUnits(engine, l, /*forward=*/false)));
    w.resize(static_cast<size_t>(din) * dout);
    RETURN_IF_ERROR(ReadParam(engine, 2 * l, dtype, static_cast<int64_t>(w.size()), w.data()));
    gw.assign(w.size(), 0.0f);
    gb.assign(dout, 0.0f);
    for (int s = 0; s < n; ++s) {
      const float* d = delta.data() + static_cast<int64_t>(s) * dout;
      const float* a = act[l].data() + static_cast<int64_t>(s) * din;
      for (int o = 0; o < dout; ++o) {
        gb[o] += d[o];
        float* g = gw.data() + static_cast<int64_t>(o) * din;
        for (int i = 0; i < din; ++i) g[i] += d[o] * a[i];
      }
    }
    // Reverse registration order within the layer: the bias was registered last.
    RETURN_IF_ERROR(WriteGrad(engine, 2 * l + 1, dtype, gb));
    RETURN_IF_ERROR(WriteGrad(engine, 2 * l, dtype, gw));
    if (l > 0) {
      prev.assign(static_cast<size_t>(n) * din, 0.0f);
      for (int s = 0; s < n; ++s) {
        const float* d = delta.data() + static_cast<int64_t>(s) * dout;
        const float* a = act[l].data() + static_cast<int64_t>(s) * din;
        float* p = prev.data() + static_cast<int64_t>(s) * din;
        for (int o = 0; o < dout; ++o) {
          const float* wr = w.data() + static_cast<int64_t>(o) * din;
          for (int i = 0; i < din; ++i) p[i] += d[o] * wr[i];
        }
        for (int i = 0; i < din; ++i) p[i] *= 1.0f - a[i] * a[i];  // tanh'
      }
      delta.swap(prev);
    }
  }
  RETURN_IF_ERROR(held.ReleaseAll());
  return loss;
}

float Mlp::Loss(const std::vector<float>& flat_params, const Batch& batch) const {
  std::vector<float> a = batch.x, next;
  size_t offset = 0;
  for (int l = 0; l < shape_.num_layers(); ++l) {
    const int din = shape_.dims[l], dout = shape_.dims[l + 1];
    const float* w = flat_params.data() + offset;
    offset += static_cast<size_t>(din) * dout;
    const float* b = flat_params.data() + offset;
    offset += dout;
    next.assign(static_cast<size_t>(batch.n) * dout, 0.0f);
    Dense(a.data(), batch.n, din, w, b, dout, l + 1 == shape_.num_layers(), next.data());
    a.swap(next);
  }
  return Mse(a, batch.y);
}

namespace {

absl::Status ValidateOptions(const RunOptions& o) {
  auto bad = [](absl::string_view field, int64_t value, absl::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunOptions.", field, " ", value, " must be ", want));
  };
  if (o.world_size < 1) return bad("world_size", o.world_size, ">= 1");
  if (o.steps < 1) return bad("steps", o.steps, ">= 1");
  if (o.batch < 1) return bad("batch", o.batch, ">= 1");
  if (o.device_threads < 0) return bad("device_threads", o.device_threads, ">= 0");
  if (o.shape.dims.size() < 2 || *std::min_element(o.shape.dims.begin(), o.shape.dims.end()) < 1) {
    return absl::InvalidArgumentError("RunOptions.shape.dims needs at least 2 entries, each >= 1");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RunResult> RunInProcess(const Config& config, const RunOptions& options) {
  RETURN_IF_ERROR(ValidateOptions(options));
  const int world = options.world_size;
  comm::CommOptions comm_options;
  comm_options.timeout_ms = config.comm_timeout_ms;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<comm::Communicator>> comms,
                   comm::CreateInProcessGroup(world, comm_options));
  // One device shared by every rank, as a single process would.
  CpuDeviceOptions device_options;
  device_options.threads = options.device_threads;
  std::unique_ptr<Device> device = CreateCpuDevice(device_options);

  const Mlp mlp(options.shape);
  const Teacher teacher(options.shape);
  RunResult result;
  result.steps.resize(options.steps);
  result.memory.resize(world);
  if (options.gather_master) result.master.resize(world);

  // Per-step rendezvous for the report, without waiting: the last rank to finish a step
  // publishes it. Steps complete in order because Step() is collective.
  std::mutex mu;
  std::vector<int> arrived(options.steps, 0);
  std::vector<std::vector<float>> losses(options.steps, std::vector<float>(world, 0.0f));

  auto run_rank = [&](int rank, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                     Engine::Create(config, mlp.ParamSpecs(), comm, device.get()));
    if (rank == 0) result.plan = engine->plan();
    RETURN_IF_ERROR(engine->InitParams(mlp.Initializer(), options.from_rank0));
    for (int step = 0; step < options.steps; ++step) {
      const Batch batch = teacher.Sample(rank, step, options.batch);
      const auto t0 = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(float loss, mlp.ForwardBackward(*engine, batch));
      ASSIGN_OR_RETURN(StepStats stats, engine->Step());
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
              .count();
      std::lock_guard<std::mutex> lock(mu);
      StepReport& report = result.steps[step];
      losses[step][rank] = loss;
      if (rank == 0) {
        report.step = step;
        report.ms = ms;
        report.stats = stats;
      }
      if (++arrived[step] == world) {
        double sum = 0;
        for (float l : losses[step]) sum += l;  // rank order: the same text run to run
        report.loss = sum / world;
        if (options.on_step) options.on_step(report);
      }
    }
    result.memory[rank] = engine->memory_report();
    if (options.gather_master) {
      ASSIGN_OR_RETURN(result.master[rank], engine->GatherMasterWeights());
    }
    return absl::OkStatus();
  };

  std::vector<absl::Status> status(world);
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    try {
      threads.emplace_back([&, r, comm = std::move(comms[r])]() mutable {
        status[r] = run_rank(r, comm.get());
        // Destroying a failed rank's communicator releases peers blocked on it (Unavailable).
        comm.reset();
      });
    } catch (const std::system_error& e) {
      // Ranks r.. never run: their communicators go, so the running ranks fail fast.
      for (int q = r + 1; q < world; ++q) comms[q].reset();
      for (std::thread& t : threads) t.join();
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot start the thread of rank ", r, " of ", world, ": ", e.what()));
    }
  }
  for (std::thread& t : threads) t.join();
  // Report the cause, not its echo: peers of a failed rank see Unavailable or, once the group
  // is poisoned, FailedPrecondition.
  int first = -1;
  for (int r = 0; r < world; ++r) {
    if (status[r].ok()) continue;
    const bool echo = absl::IsUnavailable(status[r]) || absl::IsFailedPrecondition(status[r]);
    if (first < 0 || (!echo && (absl::IsUnavailable(status[first]) ||
                                absl::IsFailedPrecondition(status[first])))) {
      first = r;
    }
  }
  if (first >= 0) return Annotate(status[first], absl::StrCat("rank ", first));
  return result;
}

}  // namespace examples
}  // namespace zerort
