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
// file}}). Tensors are named as the parameters (or as a WeightsNameMap renames them) and
// written in name order with metadata {"format": "pt"} only, so the same weights always give
// the same bytes. Each file appears complete or not at all; the index is written last, so a
// set with an index is complete.
//
// Reading: a file, an index, or a directory holding either; tensors matched to parameters by
// name, through a WeightsNameMap when the file's names differ. Every rank reads only the bytes
// of the elements it owns (positioned reads through safetensors::FileReader), converts them to
// fp32 and hands them to the engine's restore path: as InitParams, master and compute-dtype
// parameters are set, m and v zeroed, and the step count and loss scale left as they are.
//
// Thread safety: free functions; the engine ones follow the engine's rules (the rank's thread).
#ifndef ZERORT_CHECKPOINT_WEIGHTS_H_
#define ZERORT_CHECKPOINT_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "checkpoint/safetensors.h"
#include "zero/engine.h"

namespace zerort {

inline constexpr char kWeightsFileName[] = "model.safetensors";
inline constexpr char kWeightsIndexName[] = "model.safetensors.index.json";

// One rename rule of a WeightsNameMap.
struct WeightsNameRule {
  enum class Kind {
    kExact,   // the name equals `from`; it becomes `to`
    kPrefix,  // the name starts with `from` ("" matches every name), which becomes `to` ("": strip)
    kGlob,    // `from` matches the whole name: '*' any run (captured), '?' any one character;
              // `to` has as many '*' as `from` (each the capture of the same rank) or none
    kRegex,   // ECMAScript `from` matches the whole name; `to` may use $1..$9, $& and $$
  };
  Kind kind = Kind::kExact;
  std::string from;
  std::string to;  // never empty but for kPrefix
  int line = 0;    // where it was parsed from (WeightsNameMap::Parse), for messages; 0: none
};

// Tensor names between a file and the model: checkpoints from Hugging Face name tensors as
// their modules do ("transformer.h.0.attn.c_attn.weight"), the trainer as it registered its
// parameters ("h0.attn.qkv.w"). An ordered list of rules, the first that matches a name
// rewriting it (as transformers' `key_mapping`); a name no rule matches stays as it is. On
// import each file tensor's name is mapped to a parameter name; on export each parameter's name
// to the name written. Import also takes globs ('*', '?') of file tensors to ignore: never
// mapped nor read (a tied "lm_head.weight", "*.rotary_emb.inv_freq" buffers).
//
// As text (Parse, Load; `zr_engine_import_weights_mapped`), one rule per line, fields
// separated by blanks (so a name holds none), a field starting with '#' starting a comment:
//
//   prefix transformer.                                  # strips the prefix
//   glob   h.*.attn.c_attn.weight   h*.attn.qkv.w
//   regex  h\.(\d+)\.mlp\.c_fc\.(weight|bias)   h$1.mlp.fc.$2
//   exact  wte.weight   wte
//   ignore lm_head.weight
//   ignore *.rotary_emb.inv_freq
//
// Immutable once made; copies share it; thread-safe.
class WeightsNameMap {
 public:
  WeightsNameMap();  // no rule, nothing ignored: names as they are

  // InvalidArgument naming the rule (its number, kind, pattern and line) for an empty pattern
  // or target (but a prefix's), a glob whose target's '*' do not match its own, a regex that
  // does not compile or whose target names a group it lacks. `source` names the rules' origin
  // in messages.
  static absl::StatusOr<WeightsNameMap> Create(std::vector<WeightsNameRule> rules,
                                               std::vector<std::string> ignore = {},
                                               std::string source = "");
  // The text form above; InvalidArgument naming `source` and the line for anything else.
  static absl::StatusOr<WeightsNameMap> Parse(absl::string_view text,
                                              absl::string_view source = "name map");
  // Parse of the file at `path`; NotFound naming it when it cannot be read.
  static absl::StatusOr<WeightsNameMap> Load(const std::string& path);

  struct Mapped {
    std::string name;
    int rule = -1;  // the index of the rule that produced `name`; -1: none matched
  };
  // The first matching rule's rewrite of `name`, or `name` itself. InvalidArgument naming the
  // rule and the name when the rewrite is empty or the regex engine gives up.
  absl::StatusOr<Mapped> Map(absl::string_view name) const;
  // The first ignore pattern matching `name`, or nullptr.
  const std::string* IgnoredBy(absl::string_view name) const;
  // "rule 2 (glob 'h.*.w' -> 'h*.w', line 3 of gpt2.map)", for messages.
  std::string DescribeRule(int rule) const;

  const std::vector<WeightsNameRule>& rules() const;
  const std::vector<std::string>& ignore() const;
  bool empty() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

struct WeightsExportOptions {
  // The file's dtype: kF32 (exact) or kBF16 (rounded to nearest even). kF16 is refused: fp32
  // masters overflow it silently.
  DType dtype = DType::kF32;
  // > 0: split into shards of at most this many bytes of tensor data (a single tensor larger
  // than that gets a shard of its own, as Hugging Face does); 0: one file. A path ending in
  // ".safetensors" must fit one file.
  int64_t max_shard_bytes = 0;
  // Parameter name -> the name written (the files' order is that of the written names). Two
  // parameters written under one name are InvalidArgument naming both and their rules; ignore
  // patterns are import's only (InvalidArgument here).
  WeightsNameMap names;
};

struct WeightsImportOptions {
  // Tensors in the files that name no parameter (buffers such as attention masks, a tied
  // head): false fails naming them; true ignores them and lists them in the report.
  bool allow_extra = false;
  // File tensor name -> parameter name, and file tensors to ignore (never read; listed in the
  // report). Two file tensors mapped to one name are InvalidArgument naming both and the rule
  // that produced each name.
  WeightsNameMap names;
  // Every read of the files goes through this (not owned; used by this rank's thread only);
  // nullptr: positioned POSIX reads. Tests count what each rank reads through it.
  safetensors::FileReader* reader = nullptr;
};

struct WeightsImportReport {
  std::vector<std::string> files;    // the safetensors files read
  // File tensors not loaded, by name in the file: those an ignore pattern names, and with
  // allow_extra those that name no parameter.
  std::vector<std::string> ignored;
  // (file tensor, parameter) for each tensor loaded under another name, in file-name order.
  std::vector<std::pair<std::string, std::string>> renamed;
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
// dtype other than F64/F32/F16/BF16, extra tensors without allow_extra, or two file tensors
// mapped to one name; NotFound for a missing tensor or file; FailedPrecondition inside an
// accumulation window. With options.names, every message about a tensor gives its name in the
// file and the rule that renamed it. Collective.
absl::StatusOr<WeightsImportReport> ImportWeights(Engine& engine, const std::string& path,
                                                  const WeightsImportOptions& options = {});

}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_WEIGHTS_H_
