// A GPT-2-style decoder trained through the engine, written the way a user embeds zerort: the
// trainer owns forward and backward (fp32 math on the CPU, reading the engine's compute-dtype
// parameters), the engine owns parameter, gradient and optimizer memory and the step.
//
// The model is GPT-2's: token and position embeddings, pre-LayerNorm blocks of causal
// multi-head self-attention and a GELU (tanh approximation) MLP, a final LayerNorm and an
// output projection tied to the token embedding. Tokens are bytes (a vocabulary of at least
// 256) of a text file, by default /usr/share/common-licenses/GPL-3; the last 10% is held out.
//
//   ASSIGN_OR_RETURN(Corpus corpus, Corpus::Load(DefaultCorpusPath()));
//   Gpt gpt(GptShape{});
//   ASSIGN_OR_RETURN(auto engine, Engine::Create(config, gpt.ParamSpecs(), comm, device));
//   RETURN_IF_ERROR(engine->InitParams(gpt.Initializer()));
//   for (int step = 0; step < steps; ++step) {
//     TokenBatch batch = corpus.Sample(rank, step, /*batch=*/8, /*seq=*/64, /*seed=*/1);
//     ASSIGN_OR_RETURN(float loss, gpt.ForwardBackward(*engine, batch));
//     ASSIGN_OR_RETURN(StepStats stats, engine->Step());
//   }
//
// RunInProcess does exactly that on N threads over an in-process communicator group, with a
// validation loss every few steps and a generated sample at the end; RunOnCommunicator does it
// for one rank over any communicator (one process per rank under mpirun).
//
// Thread safety: Corpus and Gpt are immutable after construction and may be shared by the
// ranks' threads; ForwardBackward and Loss keep their scratch in the call.
#ifndef ZERORT_EXAMPLES_GPT_GPT_H_
#define ZERORT_EXAMPLES_GPT_GPT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "zero/engine.h"

namespace zerort {
namespace examples {
namespace gpt {

class Backend;  // backend.h
class ActivationMeter;
namespace internal {
void CountActivationBytes(int64_t delta);  // internal/model.h
}  // namespace internal

// The model's shape. The default (0.83M parameters) trains visibly in about a minute on two
// cores: 2 ranks of 4 sequences of 64 bytes take ~0.27 s of CPU per step (~1,900 tokens per
// CPU-second), and the held-out loss falls from 5.54 to ~3.0 in 150 steps at lr 3e-3.
// Gpt2Small() is GPT-2 124M, for memory-footprint runs.
struct GptShape {
  int vocab = 256;    // >= 256: tokens are bytes (rows above 255 are trained only as outputs)
  int context = 64;   // >= 1: positions (wpe rows), the longest sequence
  int layers = 4;     // >= 1
  int heads = 4;      // >= 1, divides d_model
  int d_model = 128;  // >= 1
  float init_std = 0.02f;  // > 0: GPT-2's N(0, 0.02) weights (residual projections / sqrt(2L))
  uint64_t seed = 1;       // initial weights

  // 12 layers, 12 heads, d_model 768, context 1024, vocab 50257: 124,439,808 parameters.
  static GptShape Gpt2Small();
};

// Checks the shape's constraints; InvalidArgument naming the field.
absl::Status ValidateShape(const GptShape& shape);

// `batch` sequences of `seq` + 1 tokens, row-major: inputs are tokens [0, seq) of a row and
// targets tokens [1, seq + 1).
struct TokenBatch {
  int batch = 0;
  int seq = 0;
  std::vector<int32_t> tokens;  // batch * (seq + 1)
};

// Checks a batch against the shape: batch, seq >= 1, seq <= context, batch * (seq + 1)
// tokens, each in [0, vocab). InvalidArgument naming what is wrong.
absl::Status ValidateBatch(const GptShape& shape, const TokenBatch& batch);

// The first of /usr/share/common-licenses/GPL-3, then any other regular file of that directory,
// that exists. NotFound naming GPL-3's path when the directory has none.
absl::StatusOr<std::string> DefaultCorpusPath();

// Byte-level text split into training (the first 90%) and held-out (the last 10%) tokens.
class Corpus {
 public:
  // NotFound naming `path` if it cannot be read; InvalidArgument if it is too short to split.
  static absl::StatusOr<Corpus> Load(const std::string& path);
  static absl::StatusOr<Corpus> FromText(const std::string& text);

  int64_t train_tokens() const { return split_; }
  int64_t val_tokens() const { return static_cast<int64_t>(bytes_.size()) - split_; }

  // Random training windows, different per (rank, step), deterministic in (rank, step, seed).
  // REQUIRES: seq + 1 <= train_tokens().
  TokenBatch Sample(int rank, int64_t step, int batch, int seq, uint64_t seed) const;
  // Non-overlapping held-out windows of seq + 1 tokens: window k starts at k * seq.
  int NumValWindows(int seq) const;
  // Windows [first, first + count); a window index past the end repeats the last window (so
  // every rank can evaluate a batch of the same size).
  TokenBatch ValWindows(int first, int count, int seq) const;

 private:
  Corpus(std::string bytes, int64_t split) : bytes_(std::move(bytes)), split_(split) {}
  std::string bytes_;
  int64_t split_;
};

class Gpt {
 public:
  // REQUIRES: ValidateShape(shape).ok(). `threads` (>= 1) split each kernel of one call; the
  // results do not depend on it.
  explicit Gpt(GptShape shape, int threads = 1);

  const GptShape& shape() const { return shape_; }
  // Registration order and modules: wte (vocab, d) "wte"; wpe (context, d) "wpe"; per layer l:
  // h<l>.ln1.{w,b} "h<l>.ln1", h<l>.attn.{qkv.w (d, 3d), qkv.b, proj.w (d, d), proj.b}
  // "h<l>.attn", h<l>.ln2.{w,b} "h<l>.ln2", h<l>.mlp.{fc.w (d, 4d), fc.b, proj.w (4d, d),
  // proj.b} "h<l>.mlp"; ln_f.{w,b} "ln_f". Linear weights are (in, out) as in GPT-2.
  std::vector<memory::ParamSpec> ParamSpecs() const;
  // The same list with the bytes a training pass keeps for sequences of `seq` tokens declared
  // per sample (memory::ParamSpec::activation_bytes_per_sample), so that the engine's plan
  // counts this trainer's own activations rather than a formula's. Every buffer is fp32:
  //   each block, 4 (16 s d + 4 s + heads s^2) bytes: on h<l>.ln1.w its input and LayerNorm
  //     output (2 s d) and statistics (2 s), on h<l>.attn.qkv.w q, k, v (3 s d), the attention
  //     probabilities (heads s^2) and output (s d), on h<l>.ln2.w the residual, LayerNorm output
  //     and statistics (2 s d + 2 s), on h<l>.mlp.fc.w the MLP's hidden layer before and after
  //     the GELU (8 s d);
  //   on ln_f.w the final LayerNorm's output and statistics, 4 (s d + 2 s);
  //   on wte the residual stream (s d), the logits and then their gradient (s vocab), the
  //     sequence's loss (1), and one block's backward working set (14 s d: the gradients of its
  //     MLP hidden layer, input, LayerNorm, attention output and q, k, v, all alive at once).
  // The sum times the micro-batch is the peak an ActivationMeter measures over ForwardBackward
  // and Gradients: the peak falls in the last block's backward, when every block's saved
  // tensors, the logits' gradient and the working set are held together (gpt_test checks it).
  // REQUIRES: 1 <= seq <= shape().context.
  std::vector<memory::ParamSpec> ParamSpecs(int seq) const;
  int64_t num_elements() const;
  // The same values on every rank (works with InitParams(init, /*from_rank0=*/false)).
  Engine::Initializer Initializer() const;
  // The initial parameters concatenated in registration order.
  std::vector<float> InitialParams() const;

  // One micro-step through `engine`: forward with Gather/Release around each block (no-ops
  // below stage 3), backward writing every gradient (times engine.loss_scale()) and calling
  // GradReady as each block finishes, the tied embedding last with both of its uses summed.
  // Returns the unscaled mean cross-entropy. Does not call Step().
  absl::StatusOr<float> ForwardBackward(Engine& engine, const TokenBatch& batch) const;
  // Forward only, through the engine (collective in stage 3): the loss of each sequence.
  absl::StatusOr<std::vector<float>> SequenceLosses(Engine& engine, const TokenBatch& batch) const;

  // The same computations on a flat fp32 parameter vector (registration order, as
  // Engine::GatherMasterWeights returns it): the references the tests check against.
  // `output_embedding` (vocab * d), when given, replaces wte in the output projection only,
  // which separates the tied embedding's two uses.
  float Loss(const std::vector<float>& params, const TokenBatch& batch,
             const float* output_embedding = nullptr) const;
  // d(mean loss)/d(params), registration order.
  std::vector<float> Gradients(const std::vector<float>& params, const TokenBatch& batch) const;
  // Logits (batch * seq, vocab) of every position.
  std::vector<float> Logits(const std::vector<float>& params, const TokenBatch& batch) const;
  // Continues `prompt` by `tokens` bytes: greedy when temperature <= 0, else sampled from
  // softmax(logits / temperature) with `seed`. Only the last `context` bytes are seen.
  std::string Generate(const std::vector<float>& params, const std::string& prompt, int tokens,
                       float temperature, uint64_t seed) const;

 private:
  GptShape shape_;
  int threads_;
};

// Measures the CPU backend's activations: while a meter lives, the batch-sized buffers that
// passes on its thread allocate (activations, the logits and the gradients of both, each at its
// allocated capacity) are counted, now and at the highest. Not counted: parameter-sized
// buffers, which do not grow with the micro-batch (fp32 copies of the fetched parameters and
// the gradients handed to the engine; one block's at a time, plus the (vocab, d) embedding
// gradient), and a seq-float row of scratch per kernel thread in the attention's backward.
// Meters nest: the innermost one on the thread counts.
//
//   ActivationMeter meter;
//   gpt.Gradients(params, batch);
//   meter.peak_bytes();  // == sum of ParamSpecs(batch.seq)'s declarations * batch.batch
//
// Thread safety: counts only its own thread. REQUIRES: destroyed on the thread that made it,
// after the passes it counted have returned.
class ActivationMeter {
 public:
  ActivationMeter();
  ~ActivationMeter();
  ActivationMeter(const ActivationMeter&) = delete;
  ActivationMeter& operator=(const ActivationMeter&) = delete;

  int64_t live_bytes() const { return live_; }
  int64_t peak_bytes() const { return peak_; }

 private:
  friend void internal::CountActivationBytes(int64_t delta);
  ActivationMeter* const outer_;
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

// What happened at one step, over all ranks.
struct StepReport {
  int step = 0;              // 0-based
  double loss = 0;           // mean over ranks of each rank's batch loss (before this update)
  bool evaluated = false;    // val_loss was measured after this step's update
  double val_loss = 0;       // held-out loss, the same on every rank
  double ms = 0;             // rank 0's wall time of forward + backward + Step()
  double tokens_per_s = 0;   // training tokens of all ranks over rank 0's step time
  StepStats stats;           // rank 0's (grad norm and loss scale are the same on every rank)
};

struct RunOptions {
  int world_size = 2;  // in-process ranks, one thread each; >= 1
  int steps = 200;     // micro-steps (Step() calls); >= 1
  // Sequences per rank per micro-step; >= 1. The engines' config gets it as
  // train_micro_batch_size_per_gpu (so the plan multiplies the trainer's declared activations
  // by it); a config naming another micro-batch is InvalidArgument.
  int batch = 4;
  int seq = 0;         // tokens per sequence; 0 = shape.context; <= shape.context
  GptShape shape;
  int threads = 0;           // kernel threads per rank; 0 = max(1, cores / world_size)
  int device_threads = 1;    // threads of the shared CPU device; >= 0 (0 = all cores)
  bool from_rank0 = true;    // InitParams broadcasts rank 0's values
  uint64_t data_seed = 1;    // training windows
  std::string corpus_path;   // "" = DefaultCorpusPath()
  // Validation: before training, every eval_every steps (0 = never) and after the last step.
  int eval_every = 50;
  int eval_windows = 0;      // held-out windows per evaluation; 0 = all of them
  bool gather_master = false;  // fill RunResult::master after the last step
  // Generation from rank 0's gathered master weights after the last step (0 = none).
  int sample_tokens = 0;
  std::string sample_prompt = "This program is ";
  float sample_temperature = 0;  // <= 0: greedy
  // Checkpoints (checkpoint/checkpoint.h): with checkpoint_dir set and checkpoint_every > 0,
  // an asynchronous save (AsyncCheckpointer) starts after every checkpoint_every-th step and
  // after the last step (so a run shorter than the interval still ends with a checkpoint), and
  // is committed before the next one starts and at the end. With resume_from set (a checkpoint
  // directory or a root whose `latest` names one), the ranks load it after InitParams and
  // train steps [checkpoint step, steps): the same windows, hence the same bits, as an
  // uninterrupted run. InvalidArgument if the checkpoint is at or past `steps`.
  std::string checkpoint_dir;
  int checkpoint_every = 0;  // >= 0
  std::string resume_from;
  // Safetensors weights (a file, an index or a directory: checkpoint/weights.h) loaded after
  // InitParams and before resume_from, by parameter name ("wte", "h0.attn.qkv.w", ...): a
  // fine-tuning run from exported weights. Tensors that name no parameter are an error.
  std::string init_from;
  // A name map file for init_from (checkpoint/weights.h WeightsNameMap: rules from the file's
  // tensor names to the parameters', and tensors to ignore), for weights another tool named;
  // "": the names as they are.
  std::string init_map;
  // Where the ranks compute (backend.h); nullptr = the CPU backend: Gpt's kernels with
  // `threads` threads per rank on one CPU device of `device_threads`. Not owned; outlives the run.
  const Backend* backend = nullptr;
  // Called once per step after every rank has finished it, in step order, on the thread of the
  // last rank to finish. Must not call into the engines.
  std::function<void(const StepReport&)> on_step;
};

struct RunResult {
  int first_step = 0;                       // 0, or the resumed checkpoint's step
  std::vector<StepReport> steps;            // steps [first_step, options.steps)
  double initial_val_loss = 0;              // before the first update
  double final_val_loss = 0;                // after the last update
  double tokens_per_s = 0;                  // all training tokens over the training wall time
  std::string corpus_path;                  // the file the tokens came from
  std::string sample;                       // prompt + generated text, if sample_tokens > 0
  std::vector<std::string> checkpoints;     // committed checkpoint directories, in order
  std::vector<MemoryReport> memory;         // per rank, after the last step
  // Per rank: the trainer's own activation bytes at the highest: on the GPU its activation
  // buffers' allocation, on the CPU what an ActivationMeter measured over the training passes.
  std::vector<int64_t> activation_bytes;
  std::vector<std::vector<float>> master;   // per rank, if gather_master
  memory::Plan plan;                        // rank 0's
};

// Trains the GPT on options.world_size in-process ranks sharing one CPU device. The validation
// loss is averaged over the held-out windows, which the ranks split between them and combine
// with an all-reduce on the engine's communicator: every rank gets the same value, and it does
// not depend on the world size. Errors: InvalidArgument for bad options (naming the field);
// otherwise the first failing rank's error.
absl::StatusOr<RunResult> RunInProcess(const Config& config, const RunOptions& options);

// One rank of the same run over `comm` (e.g. one process of `mpirun -np N` over the MPI
// communicator), with its own CPU device; options.world_size must equal comm->size(). The
// result is this rank's: StepReport::loss is the mean over the group (an all-reduce per step),
// `stats` and `ms` are this rank's, `memory` and `master` have one entry. Collective: every
// rank of `comm` calls it with the same config and options.
absl::StatusOr<RunResult> RunOnCommunicator(const Config& config, const RunOptions& options,
                                            comm::Communicator* comm);

}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_GPT_H_
