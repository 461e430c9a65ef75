// `zerort demo`: trains an example model on N in-process ranks and shows what the engine does
// per step and how much memory each rank holds, planned beside allocated.
//
//   zerort demo [--model gpt|mlp] [--config FILE] [--ranks N] [--steps S] [--stage 0-3]
//               [--precision P]
//   GPT only:   [--batch N] [--eval_every N] [--sample_tokens N] [--layers N] [--d_model N]
//               [--checkpoint DIR [--checkpoint_every N]] [--resume DIR] [--device cpu|cuda|auto]
//               [--init-from FILE]
//
// --model gpt (the default) trains examples/gpt's 0.83M-parameter byte-level GPT on the GPL-3
// text: 4 ranks of 2 sequences of 64 bytes, 150 steps, stage 2, bf16, AdamW lr 3e-3, clipping 1;
// it prints the training loss every 10 steps, the held-out loss every --eval_every (25) steps,
// tokens per second and, at the end, a sample generated from the trained weights.
// --checkpoint DIR saves asynchronously every --checkpoint_every (50) steps and after the last
// step, so a run that asked for checkpoints always ends with one; --resume DIR
// continues from DIR's latest checkpoint, giving the same bits as an uninterrupted run.
// --init-from FILE starts from safetensors weights (a file, an index or a directory, e.g. what
// `zerort ckpt export` wrote) instead of the random initialisation.
// --device cuda trains on GPU 0 (examples/gpt/gpt_cuda.h): GPT-2 124M's shapes (12 layers,
// 12 heads, d_model 768, context 1024) with the corpus's byte vocabulary (256), 1 rank over
// NCCL (--ranks 2-16: in-process ranks sharing the GPU) of 8 sequences of 1024 bytes, 50 steps,
// lr 6e-4, weight decay 0.1; it adds model FLOPs utilisation against the GPU's datasheet peak
// and each rank's activation bytes. Without a usable GPU it fails (FailedPrecondition naming
// the reason). --device auto takes the GPU when usable, else says why and runs the CPU default.
// --device cpu (the default) is the CPU run above.
// --model mlp trains examples/mlp's 5,768-parameter MLP (4 ranks, 30 steps) with units of at
// most 2048 elements (so that several buckets exist) and no persistent stage-3 units (so that
// stage 3 really gathers). --stage and --precision override the config (default or --config).
//
// Thread safety: RunDemoCommand may be called from any thread; it starts its own rank threads.
#ifndef ZERORT_CLI_DEMO_H_
#define ZERORT_CLI_DEMO_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace zerort {

// Output goes to `out`. Errors: InvalidArgument naming the flag for an unknown flag or a bad
// value; the config's errors (naming the file and key); a failing rank's error.
absl::Status RunDemoCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace zerort

#endif  // ZERORT_CLI_DEMO_H_
