// Weights in and out as safetensors: the model's fp32 masters, by parameter name, in the files
// Hugging Face's loaders read (checkpoint/safetensors.h is the format), so that a fine-tuning
// run starts from a pretrained model and hands its result to other tools.
//
//   // Every rank, between optimizer steps (collective):
//   ASSIGN_OR_RETURN(WeightsImportReport r, ImportWeights(*engine, "/models/gpt2"));
//   ...
//   WeightsExportOptions out;
//   out.dtype = DType::kBF16;
//   out.max_shard_bytes = int64_t{5} << 30;
//   ASSIGN_OR_RETURN(std::vector<std::string> files, ExportWeights(*engine, "/out/gpt2-ft", out));
//
// Layout written (what `save_pretrained` writes): OUT ending in ".safetensors" is one file; any
// other OUT is a directory (created if missing) holding `model.safetensors`, or, when the
// weights exceed max_shard_bytes, `model-00001-of-0000N.safetensors`... and
// `model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name:
// file}}). Tensors are named as the parameters and written in name order with metadata
// {"format": "pt"} only, so the same weights always give the same bytes. Each file appears
// complete or not at all; the index is written last, so a set with an index is complete.
//
// Reading: a file, an index, or a directory holding either. Every rank reads only the bytes of
// the elements it owns (positioned reads), converts them to fp32 and hands them to the engine's
// restore path: as InitParams, master and compute-dtype parameters are set, m and v zeroed, and
// the step count and loss scale left as they are.
//
// Thread safety: free functions; the engine ones follow the engine's rules (the rank's thread).
#ifndef ZERORT_CHECKPOINT_WEIGHTS_H_
#define ZERORT_CHECKPOINT_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "checkpoint/safetensors.h"
#include "zero/engine.h"

namespace zerort {

inline constexpr char kWeightsFileName[] = "model.safetensors";
inline constexpr char kWeightsIndexName[] = "model.safetensors.index.json";

struct WeightsExportOptions {
  // The file's dtype: kF32 (exact) or kBF16 (rounded to nearest even). kF16 is refused: fp32
  // masters overflow it silently.
  DType dtype = DType::kF32;
  // > 0: split into shards of at most this many bytes of tensor data (a single tensor larger
  // than that gets a shard of its own, as Hugging Face does); 0: one file. A path ending in
  // ".safetensors" must fit one file.
  int64_t max_shard_bytes = 0;
};

struct WeightsImportOptions {
  // Tensors in the files that name no parameter (buffers such as attention masks, a tied
  // head): false fails naming them; true ignores them and lists them in the report.
  bool allow_extra = false;
  // Every read of the files goes through this (not owned; used by this rank's thread only);
  // nullptr: positioned POSIX reads. Tests count what each rank reads through it.
  safetensors::FileReader* reader = nullptr;
};

struct WeightsImportReport {
  std::vector<std::string> files;    // the safetensors files read
  std::vector<std::string> ignored;  // with allow_extra: tensors that name no parameter
};

// Full fp32 tensors by name, in the engine's registration order (names and shapes from
// `specs`, values concatenated as Engine::GatherMasterWeights returns them), written as
// described above. Returns the files written (the index last when sharded). InvalidArgument
// for options the layout cannot honour; the I/O error naming the path otherwise.
absl::StatusOr<std::vector<std::string>> WriteWeights(const std::vector<memory::ParamLayout>& specs,
                                                      absl::Span<const float> values,
                                                      const std::string& out,
                                                      const WeightsExportOptions& options);

// Gathers the fp32 masters (Engine::GatherMasterWeights) and writes them from rank 0. Every
// rank returns the same status and the same list. Collective.
absl::StatusOr<std::vector<std::string>> ExportWeights(Engine& engine, const std::string& out,
                                                       const WeightsExportOptions& options = {});

// The masters of a saved checkpoint (a step directory, or a root whose `latest` names one),
// read without an engine and written as WriteWeights does, byte for byte. Streams
// (StreamCheckpointMasters): each piece goes from the checkpoint's 8 MiB read buffer into its
// place in its output file, so memory stays bounded whatever the model's size; every output
// file is open at once (one descriptor per shard). Nothing is published unless every shard's
// checksum holds. Errors: those of VerifyCheckpoint, then those of WriteWeights.
absl::StatusOr<std::vector<std::string>> ExportCheckpointWeights(
    const std::string& checkpoint, const std::string& out,
    const WeightsExportOptions& options = {});

// Loads `path` (a .safetensors file, a model.safetensors.index.json, or a directory holding
// one of them, the index first) into the engine's masters by parameter name. Everything that
// can fail is checked on every rank before the engine is touched, and every rank returns the
// same verdict: InvalidArgument for a malformed header or index (naming the file and the
// tensor and byte range), a misshapen tensor (naming its file, byte range and both shapes), a
// dtype other than F64/F32/F16/BF16, or extra tensors without allow_extra; NotFound for a
// missing tensor or file; FailedPrecondition inside an accumulation window. Collective.
absl::StatusOr<WeightsImportReport> ImportWeights(Engine& engine, const std::string& path,
                                                  const WeightsImportOptions& options = {});

}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_WEIGHTS_H_
