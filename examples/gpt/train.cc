// RunInProcess: the GPT trained on in-process ranks, with validation and a generated sample.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/weights.h"
#include "comm/inprocess.h"
#include "device/cpu_device.h"
#include "examples/gpt/backend.h"
#include "examples/gpt/gpt.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

absl::Status ValidateOptions(const RunOptions& o) {
  auto bad = [](absl::string_view field, int64_t value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat("RunOptions.", field, " ", value, " must be ", want));
  };
  if (o.world_size < 1) return bad("world_size", o.world_size, ">= 1");
  if (o.steps < 1) return bad("steps", o.steps, ">= 1");
  if (o.batch < 1) return bad("batch", o.batch, ">= 1");
  if (o.seq < 0 || o.seq > o.shape.context) {
    return bad("seq", o.seq, absl::StrCat("in [0, shape.context = ", o.shape.context, "]"));
  }
  if (o.threads < 0) return bad("threads", o.threads, ">= 0");
  if (o.device_threads < 0) return bad("device_threads", o.device_threads, ">= 0");
  if (o.eval_every < 0) return bad("eval_every", o.eval_every, ">= 0");
  if (o.eval_windows < 0) return bad("eval_windows", o.eval_windows, ">= 0");
  if (o.sample_tokens < 0) return bad("sample_tokens", o.sample_tokens, ">= 0");
  if (o.checkpoint_every < 0) return bad("checkpoint_every", o.checkpoint_every, ">= 0");
  return Annotate(ValidateShape(o.shape), "RunOptions.shape");
}

// The CPU backend: Gpt's fp32 kernels on the host, one CPU device shared by every rank, as a
// single process would, and an in-process group over host memory.
class CpuTrainer : public RankTrainer {
 public:
  CpuTrainer(const GptShape& shape, int threads) : gpt_(shape, threads) {}
  Device::Stream stream() const override { return nullptr; }
  absl::StatusOr<float> ForwardBackward(Engine& engine, const TokenBatch& batch) override {
    const ActivationMeter meter;
    absl::StatusOr<float> loss = gpt_.ForwardBackward(engine, batch);
    peak_ = std::max(peak_, meter.peak_bytes());
    return loss;
  }
  absl::StatusOr<std::vector<float>> SequenceLosses(Engine& engine,
                                                    const TokenBatch& batch) override {
    return gpt_.SequenceLosses(engine, batch);
  }
  // The training passes' activations at the highest, as measured (evaluation is not counted:
  // the plan's activations are those of a training micro-batch).
  int64_t activation_bytes() const override { return peak_; }
  void DeclareActivations(int, int seq, DType,
                          std::vector<memory::ParamSpec>* specs) const override {
    const std::vector<memory::ParamSpec> declared = gpt_.ParamSpecs(seq);
    for (size_t i = 0; i < specs->size() && i < declared.size(); ++i) {
      (*specs)[i].activation_bytes_per_sample = declared[i].activation_bytes_per_sample;
    }
  }

 private:
  const Gpt gpt_;
  int64_t peak_ = 0;
};

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int device_threads) : device_threads_(device_threads) {}
  std::string name() const override { return "cpu"; }
  absl::StatusOr<std::unique_ptr<Device>> CreateDevice() const override {
    CpuDeviceOptions device_options;
    device_options.threads = device_threads_;
    return CreateCpuDevice(device_options);
  }
  absl::StatusOr<std::vector<std::unique_ptr<comm::Communicator>>> CreateGroup(
      int world, const comm::CommOptions& options) const override {
    return comm::CreateInProcessGroup(world, options);
  }
  absl::StatusOr<std::unique_ptr<RankTrainer>> CreateTrainer(const GptShape& shape, int threads,
                                                             Device*) const override {
    return std::make_unique<CpuTrainer>(shape, threads);
  }

 private:
  const int device_threads_;
};

// What the ranks share: read-only inputs, and the result under `mu`.
struct Shared {
  const Config& config;
  const RunOptions& options;
  const Corpus& corpus;
  const Gpt& gpt;
  const Backend& backend;
  Device* device;
  int seq;           // tokens per training sequence
  int eval_windows;  // held-out windows per evaluation
  int first_step;    // 0, or the step of the checkpoint resumed from
  int threads;       // kernel threads per rank (CPU backend)
  // RunOnCommunicator: this process is one rank; every rank's loss arrives by all-reduce, and
  // this rank's stats, plan and memory are the ones reported.
  bool one_rank_per_process = false;
  std::mutex mu;
  RunResult result;
  std::vector<int> arrived;                // per step: ranks done
  std::vector<std::vector<float>> losses;  // per step, per rank
  double train_ms = 0;                     // rank 0's time in training steps
};

// Mean loss over the first `windows` held-out windows. Each rank evaluates an equal slice (the
// same number of collective Gathers everywhere) and writes it into its place in a vector of
// every window's loss, zero elsewhere; the all-reduce then sums each element with zeros only,
// exactly, so every rank sums the same values in the same order whatever the world size.
// The scalars travel through the engine (AllReduceScalars), which stages host values through
// device memory where the communicator needs it (NCCL).
absl::StatusOr<double> Evaluate(Shared& s, Engine& engine, RankTrainer& trainer) {
  comm::Communicator* comm = engine.communicator();
  const int per_rank = (s.eval_windows + comm->size() - 1) / comm->size();
  const int first = comm->rank() * per_rank;
  ASSIGN_OR_RETURN(std::vector<float> mine,
                   trainer.SequenceLosses(engine, s.corpus.ValWindows(first, per_rank, s.seq)));
  std::vector<double> all(static_cast<size_t>(per_rank) * comm->size(), 0.0);
  for (int k = 0; k < per_rank && first + k < s.eval_windows; ++k) all[first + k] = mine[k];
  RETURN_IF_ERROR(engine.AllReduceScalars(absl::MakeSpan(all), comm::ReduceOp::kSum));
  double sum = 0;
  for (int w = 0; w < s.eval_windows; ++w) sum += all[w];
  return sum / s.eval_windows;
}

// Publishes step `step` once every rank of this process has reported it. Steps complete in
// order because Step() is collective; the last rank to arrive calls on_step. With one rank per
// process, `loss` is already the group's mean and the process's rank is the one reported.
void Report(Shared& s, int rank, const StepReport& mine, const std::vector<float>& losses) {
  std::lock_guard<std::mutex> lock(s.mu);
  const int i = mine.step - s.first_step;
  StepReport& report = s.result.steps[i];
  if (s.one_rank_per_process) {
    s.losses[i] = losses;
  } else {
    s.losses[i][rank] = losses[rank];
  }
  if (s.one_rank_per_process || rank == 0) {
    report = mine;
    s.train_ms += mine.ms;
  }
  const int ranks_here = s.one_rank_per_process ? 1 : static_cast<int>(s.losses[i].size());
  if (++s.arrived[i] < ranks_here) return;
  double sum = 0;
  for (float l : s.losses[i]) sum += l;  // rank order: the same value run to run
  report.loss = sum / static_cast<double>(s.losses[i].size());
  if (s.options.on_step) s.options.on_step(report);
}

// Commits the save in flight, if any; rank 0 records its directory.
absl::Status FinishCheckpoint(Shared& s, AsyncCheckpointer& saver, int rank) {
  if (!saver.in_flight()) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::string dir, saver.Finish());
  if (rank == 0) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.result.checkpoints.push_back(std::move(dir));
  }
  return absl::OkStatus();
}

// After the step that brings the engine to a multiple of checkpoint_every, and after the last
// step (a run that asked for checkpoints ends with one, however few its steps): commits the
// save in flight (so at most one shard buffer exists) and starts the next one, whose writes
// overlap the following steps. `saved_step` is the engine step of the last save started (a
// skipped last step must not save the same step twice).
absl::Status MaybeCheckpoint(Shared& s, Engine& engine, AsyncCheckpointer& saver, int rank,
                             bool last, int64_t* saved_step) {
  const RunOptions& o = s.options;
  if (o.checkpoint_dir.empty() || o.checkpoint_every == 0 || engine.step() == *saved_step ||
      (engine.step() % o.checkpoint_every != 0 && !last)) {
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(FinishCheckpoint(s, saver, rank));
  *saved_step = engine.step();
  return saver.Start(engine, o.checkpoint_dir);
}

// Every rank's `value`, by rank: each rank writes its slot of a zero vector and the all-reduce
// adds zeros only, exactly, whatever the backend's summation order.
absl::StatusOr<std::vector<float>> AllRanks(Engine& engine, float value) {
  comm::Communicator* comm = engine.communicator();
  std::vector<double> all(comm->size(), 0.0);
  all[comm->rank()] = value;
  RETURN_IF_ERROR(engine.AllReduceScalars(absl::MakeSpan(all), comm::ReduceOp::kSum));
  return std::vector<float>(all.begin(), all.end());
}

absl::Status TrainSteps(Shared& s, Engine& engine, RankTrainer& trainer,
                        AsyncCheckpointer& saver, int rank) {
  const RunOptions& o = s.options;
  const double tokens = static_cast<double>(o.world_size) * o.batch * s.seq;
  int64_t saved_step = engine.step();  // resumed: that checkpoint exists already
  for (int step = s.first_step; step < o.steps; ++step) {
    const TokenBatch batch = s.corpus.Sample(rank, step, o.batch, s.seq, o.data_seed);
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(const float loss, trainer.ForwardBackward(engine, batch));
    std::vector<float> losses(o.world_size, 0.0f);
    if (s.one_rank_per_process) {
      ASSIGN_OR_RETURN(losses, AllRanks(engine, loss));
    } else {
      losses[rank] = loss;
    }
    StepReport mine;
    ASSIGN_OR_RETURN(mine.stats, engine.Step());
    mine.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count();
    mine.step = step;
    mine.tokens_per_s = tokens / (mine.ms / 1000.0);
    mine.evaluated = (o.eval_every > 0 && (step + 1) % o.eval_every == 0) || step + 1 == o.steps;
    if (mine.evaluated) {
      ASSIGN_OR_RETURN(mine.val_loss, Evaluate(s, engine, trainer));
    }
    RETURN_IF_ERROR(MaybeCheckpoint(s, engine, saver, rank, step + 1 == o.steps, &saved_step));
    Report(s, rank, mine, losses);
  }
  return FinishCheckpoint(s, saver, rank);
}

absl::Status RunRank(Shared& s, int rank, comm::Communicator* comm) {
  const RunOptions& o = s.options;
  // The trainer first: its stream is the engine's compute stream.
  ASSIGN_OR_RETURN(std::unique_ptr<RankTrainer> trainer,
                   s.backend.CreateTrainer(s.gpt.shape(), s.threads, s.device));
  EngineOptions engine_options;
  engine_options.compute_stream = trainer->stream();
  // The trainer's own activation bytes, so that the plan's device budget counts them.
  std::vector<memory::ParamSpec> specs = s.gpt.ParamSpecs();
  trainer->DeclareActivations(o.batch, s.seq, s.config.compute_dtype, &specs);
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                   Engine::Create(s.config, std::move(specs), comm, s.device, engine_options));
  AsyncCheckpointer saver;  // after the engine: destroyed first, as it borrows the engine
  RETURN_IF_ERROR(engine->InitParams(s.gpt.Initializer(), o.from_rank0));
  if (!o.init_from.empty()) {
    WeightsImportOptions import;
    if (!o.init_map.empty()) {
      absl::StatusOr<WeightsNameMap> names = WeightsNameMap::Load(o.init_map);
      RETURN_IF_ERROR(Annotate(names.status(), "--init-map"));
      import.names = *std::move(names);
    }
    RETURN_IF_ERROR(Annotate(ImportWeights(*engine, o.init_from, import).status(),
                             absl::StrCat("--init-from ", o.init_from)));
  } else if (!o.init_map.empty()) {
    return absl::InvalidArgumentError("--init-map " + o.init_map + " needs --init-from");
  }
  if (!o.resume_from.empty()) {
    LoadOptions load;
    load.allow_reshard = true;  // resuming on another number of ranks is allowed
    RETURN_IF_ERROR(LoadCheckpoint(*engine, o.resume_from, load));
  }
  ASSIGN_OR_RETURN(const double initial_val, Evaluate(s, *engine, *trainer));
  RETURN_IF_ERROR(TrainSteps(s, *engine, *trainer, saver, rank));
  std::vector<float> master;
  if (o.gather_master || o.sample_tokens > 0) {
    ASSIGN_OR_RETURN(master, engine->GatherMasterWeights());  // collective: every rank
  }
  std::string sample;
  if (rank == 0 && o.sample_tokens > 0) {
    sample = s.gpt.Generate(master, o.sample_prompt, o.sample_tokens, o.sample_temperature,
                            o.data_seed);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.one_rank_per_process || rank == 0) {
    s.result.plan = engine->plan();
    s.result.initial_val_loss = initial_val;
    s.result.final_val_loss = s.result.steps.back().val_loss;
    s.result.sample = std::move(sample);
  }
  const int slot = s.one_rank_per_process ? 0 : rank;
  s.result.memory[slot] = engine->memory_report();
  s.result.activation_bytes[slot] = trainer->activation_bytes();
  if (o.gather_master) s.result.master[slot] = std::move(master);
  return absl::OkStatus();
}

// The root cause among the ranks' errors: peers of a failed rank echo it as Unavailable or,
// once the group is poisoned, FailedPrecondition, so prefer any other error.
absl::Status FirstCause(const std::vector<absl::Status>& status) {
  auto echo = [](const absl::Status& st) {
    return absl::IsUnavailable(st) || absl::IsFailedPrecondition(st);
  };
  for (bool accept_echo : {false, true}) {
    for (size_t r = 0; r < status.size(); ++r) {
      if (!status[r].ok() && (accept_echo || !echo(status[r]))) {
        return Annotate(status[r], absl::StrCat("rank ", r));
      }
    }
  }
  return absl::OkStatus();
}

// The step training starts from: the resumed checkpoint's, read from its manifest before any
// engine exists so that every rank knows how many steps it will run.
absl::StatusOr<int> FirstStep(const RunOptions& o) {
  if (o.resume_from.empty()) return 0;
  ASSIGN_OR_RETURN(const CheckpointInfo info, ReadCheckpointInfo(o.resume_from));
  if (info.step >= o.steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RunOptions.steps ", o.steps, ": the checkpoint ", info.dir, " is already at step ",
        info.step, "; nothing left to train"));
  }
  return static_cast<int>(info.step);
}

// What both runners prepare before any rank starts: the corpus, the model and the sizes.
struct Inputs {
  std::string path;
  Corpus corpus;
  int seq = 0;
  int eval_windows = 0;
  int threads = 0;
  int first_step = 0;
};

absl::StatusOr<Inputs> Prepare(const RunOptions& options, int world) {
  RETURN_IF_ERROR(ValidateOptions(options));
  std::string path = options.corpus_path;
  if (path.empty()) {
    ASSIGN_OR_RETURN(path, DefaultCorpusPath());
  }
  ASSIGN_OR_RETURN(Corpus corpus, Corpus::Load(path));
  const int seq = options.seq > 0 ? options.seq : options.shape.context;
  const int windows = corpus.NumValWindows(seq);
  if (seq + 1 > corpus.train_tokens() || windows < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", corpus.train_tokens(), " training and ", corpus.val_tokens(),
        " held-out bytes are too few for sequences of ", seq, " tokens"));
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ASSIGN_OR_RETURN(const int first_step, FirstStep(options));
  return Inputs{std::move(path),
                std::move(corpus),
                seq,
                options.eval_windows > 0 ? std::min(options.eval_windows, windows) : windows,
                options.threads > 0 ? options.threads : std::max(1, cores / world),
                first_step};
}

// The config the engines get: its micro-batch is the run's, so that the plan multiplies the
// declared activations by the batch that runs. InvalidArgument when the config names another.
absl::StatusOr<Config> RunConfig(const Config& config, const RunOptions& options) {
  Config c = config;
  if (c.train_micro_batch_size_per_gpu == 0) c.train_micro_batch_size_per_gpu = options.batch;
  if (c.train_micro_batch_size_per_gpu != options.batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RunOptions.batch ", options.batch, " differs from the config's "
        "train_micro_batch_size_per_gpu ", c.train_micro_batch_size_per_gpu));
  }
  return c;
}

// Sizes the result for `slots` ranks reporting in this process.
void InitShared(Shared& s, const Inputs& in, int slots) {
  const int steps = s.options.steps - in.first_step;
  s.result.corpus_path = in.path;
  s.result.first_step = in.first_step;
  s.result.steps.resize(steps);
  s.result.memory.resize(slots);
  s.result.activation_bytes.resize(slots);
  if (s.options.gather_master) s.result.master.resize(slots);
  s.arrived.assign(steps, 0);
  s.losses.assign(steps, std::vector<float>(s.options.world_size, 0.0f));
}

double TokensPerSecond(const Shared& s, int world, int seq, int steps) {
  return static_cast<double>(world) * s.options.batch * seq * steps / (s.train_ms / 1000.0);
}

}  // namespace

absl::StatusOr<RunResult> RunInProcess(const Config& config, const RunOptions& options) {
  const int world = options.world_size;
  ASSIGN_OR_RETURN(const Inputs in, Prepare(options, world));
  ASSIGN_OR_RETURN(const Config run_config, RunConfig(config, options));
  const Gpt gpt(options.shape, in.threads);
  const CpuBackend cpu(options.device_threads);
  const Backend& backend = options.backend != nullptr ? *options.backend : cpu;
  ASSIGN_OR_RETURN(std::unique_ptr<Device> device, backend.CreateDevice());
  comm::CommOptions comm_options;
  comm_options.timeout_ms = config.comm_timeout_ms;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<comm::Communicator>> comms,
                   backend.CreateGroup(world, comm_options));
  Shared shared{run_config,   options,          in.corpus,      gpt,
                backend,      device.get(),     in.seq,         in.eval_windows,
                in.first_step, in.threads};
  InitShared(shared, in, world);

  std::vector<absl::Status> status(world);
  std::vector<std::thread> threads_of_ranks;
  threads_of_ranks.reserve(world);
  absl::Status started;
  for (int r = 0; r < world && started.ok(); ++r) {
    try {
      threads_of_ranks.emplace_back([&, r, comm = std::move(comms[r])]() mutable {
        status[r] = RunRank(shared, r, comm.get());
        comm.reset();  // a failed rank's peers then fail fast (Unavailable), not time out
      });
    } catch (const std::system_error& e) {
      // The ranks already running wait for this one: destroying the communicators not handed
      // out (rank r's died with its closure) makes them fail fast, so they can be joined.
      for (int q = r + 1; q < world; ++q) comms[q].reset();
      started = absl::ResourceExhaustedError(absl::StrCat(
          "cannot start the thread of rank ", r, " of ", world, ": ", e.what()));
    }
  }
  for (std::thread& t : threads_of_ranks) t.join();
  RETURN_IF_ERROR(started);
  RETURN_IF_ERROR(FirstCause(status));
  shared.result.tokens_per_s =
      TokensPerSecond(shared, world, in.seq, options.steps - in.first_step);
  return std::move(shared.result);
}

absl::StatusOr<RunResult> RunOnCommunicator(const Config& config, const RunOptions& options,
                                            comm::Communicator* comm) {
  const int world = comm->size();
  if (options.world_size != world) {
    return absl::InvalidArgumentError(absl::StrCat("RunOptions.world_size ", options.world_size,
                                                   " differs from the communicator's size ",
                                                   world));
  }
  ASSIGN_OR_RETURN(const Inputs in, Prepare(options, world));
  ASSIGN_OR_RETURN(const Config run_config, RunConfig(config, options));
  const Gpt gpt(options.shape, in.threads);
  const CpuBackend cpu(options.device_threads);
  const Backend& backend = options.backend != nullptr ? *options.backend : cpu;
  ASSIGN_OR_RETURN(std::unique_ptr<Device> device, backend.CreateDevice());
  Shared shared{run_config,   options,          in.corpus,      gpt,
                backend,      device.get(),     in.seq,         in.eval_windows,
                in.first_step, in.threads};
  shared.one_rank_per_process = true;
  InitShared(shared, in, 1);
  RETURN_IF_ERROR(Annotate(RunRank(shared, comm->rank(), comm),
                           absl::StrCat("rank ", comm->rank())));
  shared.result.tokens_per_s =
      TokensPerSecond(shared, world, in.seq, options.steps - in.first_step);
  return std::move(shared.result);
}

}  // namespace gpt
}  // namespace examples
}  // namespace zerort
