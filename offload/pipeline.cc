#include "offload/pipeline.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace offload {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Into *out: the ranges that cover [begin, begin + n) of a region, clipped to it and shifted
// to start at 0: the constants of one NVMe piece of the unit.
void SliceRanges(absl::Span<const AdamWRange> ranges, size_t begin, size_t n,
                 std::vector<AdamWRange>* out) {
  out->clear();
  for (const AdamWRange& r : ranges) {
    const size_t lo = std::max(r.begin, begin), hi = std::min(r.end, begin + n);
    if (lo < hi) out->push_back(AdamWRange{lo - begin, hi - begin, r.params});
  }
}

}  // namespace

OffloadPipeline::OffloadPipeline(Device* device, std::vector<PipelineRegion> regions,
                                 const PipelineOptions& options, Device::Stream grads_stream)
    : dev_(device),
      regions_(std::move(regions)),
      options_(options),
      c_(DTypeSize(options.dtype)),
      gc_(DTypeSize(options.grad_dtype.value_or(options.dtype))),
      grads_stream_(grads_stream) {
  for (const PipelineRegion& r : regions_) {
    whole_ranges_.push_back({AdamWRange{0, static_cast<size_t>(r.n), {}}});
  }
}

absl::StatusOr<std::unique_ptr<OffloadPipeline>> OffloadPipeline::Create(
    Device* device, std::vector<PipelineRegion> regions, const PipelineOptions& options,
    Device::Stream grads_stream) {
  const bool compact_master = options.master_form != MasterForm::kF32;
  if ((compact_master || options.moment_dtype != DType::kF32) && options.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OffloadPipeline: compact optimizer state (master ", MasterFormName(options.master_form),
        ", moments ", DTypeName(options.moment_dtype), ") needs bf16 parameters, not ",
        DTypeName(options.dtype)));
  }
  if (compact_master && options.nvme_params != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OffloadPipeline: a ", MasterFormName(options.master_form),
        " master with parameters on NVMe is not supported"));
  }
  // Chunks carry parameter shards up, or into the NVMe file; a compact master's host copy goes
  // up itself.
  const bool direct = compact_master && !options.param_on_host && options.nvme == nullptr;
  const bool needs_chunks =
      (!options.param_on_host && !direct) || options.nvme_params != nullptr;
  if (options.chunks < (needs_chunks ? 1 : 0)) {
    return absl::InvalidArgumentError("OffloadPipeline: needs at least one staging chunk");
  }
  for (const PipelineRegion& r : regions) {
    if (needs_chunks && r.n > options.chunk_elements) {
      return absl::InvalidArgumentError(absl::StrCat(
          "OffloadPipeline: a region of ", r.n, " elements exceeds the staging chunk's ",
          options.chunk_elements));
    }
  }
  std::unique_ptr<OffloadPipeline> p(
      new OffloadPipeline(device, std::move(regions), options, grads_stream));
  ASSIGN_OR_RETURN(p->h2d_, device->CreateStream());
  ASSIGN_OR_RETURN(p->grads_ready_, device->CreateEvent());
  // One event per chunk; uploads without chunks (a compact master's copy) record one.
  const int events = std::max(options.chunks, options.param_on_host ? 0 : 1);
  for (int k = 0; k < events; ++k) {
    ASSIGN_OR_RETURN(Device::Event out, device->CreateEvent());
    p->chunk_out_.push_back(out);
  }
  return p;
}

OffloadPipeline::~OffloadPipeline() {
  // Pending copies write into buffers that are freed after this object.
  if (h2d_ != nullptr) {
    dev_->Synchronize(h2d_).IgnoreError();  // a failure was reported by the step that caused it
    dev_->DestroyStream(h2d_);
  }
  if (grads_ready_ != nullptr) dev_->DestroyEvent(grads_ready_);
  for (Device::Event e : chunk_out_) dev_->DestroyEvent(e);
}

// REQUIRES: chunks >= 1 (a parameter shard that leaves through a chunk).
char* OffloadPipeline::ParamChunk(int u) const {
  const int64_t chunk = u % options_.chunks;
  return options_.staging + chunk * options_.chunk_elements * static_cast<int64_t>(c_);
}

absl::StatusOr<OffloadPipeline::Times> OffloadPipeline::Update(const AdamWStepParams& params,
                                                               float grad_scale,
                                                               const Hooks& hooks,
                                                               uint64_t step) {
  for (std::vector<AdamWRange>& unit : whole_ranges_) unit[0].params = params;
  return Update(whole_ranges_, grad_scale, hooks, step);
}

absl::StatusOr<OffloadPipeline::Times> OffloadPipeline::Update(
    const std::vector<std::vector<AdamWRange>>& ranges, float grad_scale, const Hooks& hooks,
    uint64_t step) {
  step_ = step;
  if (ranges.size() != regions_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("OffloadPipeline::Update: ", ranges.size(),
                                                   " range lists for ", regions_.size(),
                                                   " regions"));
  }
  Times times;
  nvme::NvmeState* state = options_.nvme;
  if (state == nullptr) {
    nvme_error_ = absl::OkStatus();
    absl::Status s = UpdateAll(ranges, grad_scale, hooks, &times);
    if (options_.nvme_params == nullptr) {
      RETURN_IF_ERROR(s);
      return times;
    }
    // A failed parameter write: every rank made the same transfers and gathers; they agree.
    s.Update(nvme_error_);
    if (hooks.agree) s = hooks.agree(s);
    if (!s.ok()) return s;
    return times;
  }
  // An I/O error stops the AdamW work but not the transfers and gathers, so that every rank
  // makes the same collectives; the ranks then agree, and switch copies all or none.
  nvme_error_ = state->Begin();
  absl::Status s = UpdateAll(ranges, grad_scale, hooks, &times);
  const auto t0 = std::chrono::steady_clock::now();
  s.Update(nvme_error_);
  s.Update(state->Drain());  // also after an error: the slots stay busy until requests return
  times.nvme_wait_ms += MsSince(t0);
  if (hooks.agree) s = hooks.agree(s);
  if (!s.ok()) return s;
  state->Commit();
  return times;
}

absl::Status OffloadPipeline::UpdateAll(const std::vector<std::vector<AdamWRange>>& ranges,
                                        float grad_scale, const Hooks& hooks, Times* times) {
  const int nu = static_cast<int>(regions_.size());
  // The copies into the host gradients (enqueued on grads_stream_ during backward) have landed
  // before the host reads them. The engine's Step has synchronized already; this keeps the
  // pipeline right on its own, at the cost of one event.
  const auto tw = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(dev_->Record(grads_ready_, grads_stream_));
  RETURN_IF_ERROR(dev_->WaitHost(grads_ready_));
  // A compact master's host copy is rewritten in place: the last step's uploads from it (one
  // stream, in order) have left.
  if (direct_upload()) RETURN_IF_ERROR(dev_->WaitHost(chunk_out_[0]));
  times->wait_ms += MsSince(tw);
  for (int u = 0; u < nu; ++u) {
    RETURN_IF_ERROR(UpdateUnit(u, ranges[u], grad_scale, times));
    if (u > 0) RETURN_IF_ERROR(Gather(u - 1, hooks, times));
  }
  if (nu > 0) RETURN_IF_ERROR(Gather(nu - 1, hooks, times));
  return absl::OkStatus();
}

absl::Status OffloadPipeline::UpdateUnit(int u, absl::Span<const AdamWRange> ranges,
                                         float grad_scale, Times* times) {
  const PipelineRegion& r = regions_[u];
  const int chunks = options_.chunks;
  const bool on_host = options_.param_on_host;
  const bool direct = direct_upload();
  // Unit u - B's upload has left the chunk before AdamW overwrites it.
  if (u >= chunks && !on_host && !direct) {
    const auto tw = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(dev_->WaitHost(chunk_out_[u % chunks]));
    times->wait_ms += MsSince(tw);
  }
  nvme::NvmeParams* params_file = options_.nvme_params;
  void* out = on_host && params_file == nullptr ? r.param
              : direct                          ? static_cast<void*>(r.master_bf16)
                                                : ParamChunk(u);
  if (options_.nvme != nullptr) {
    // After an I/O error the remaining units keep their old parameters in `out`'s place only
    // nominally (the chunk holds stale bytes); the engine re-derives them from the state.
    if (nvme_error_.ok()) nvme_error_ = UpdateNvmePieces(u, out, ranges, grad_scale, times);
  } else if (compact()) {
    CompactAdamWArrays a;
    a.master_form = options_.master_form;
    a.master = r.master;
    a.remainder = r.remainder;
    // A compact master is updated in place (with param_on_host, or direct, it is `out`).
    a.param = compact_master() ? static_cast<void*>(r.master_bf16) : out;
    a.m = r.m;
    a.v = r.v;
    a.grad = r.grad;
    a.n = static_cast<size_t>(r.n);
    a.rounding.first_index = r.first_index;
    RETURN_IF_ERROR(RunAdamW(a, ranges, grad_scale));
  } else {
    AdamWArrays a{r.master, static_cast<float*>(r.m), static_cast<float*>(r.v), r.grad,
                  GradDType(), out, options_.dtype, static_cast<size_t>(r.n)};
    RETURN_IF_ERROR(CpuAdamW(a, ranges, grad_scale, options_.cpu_threads));
  }
  // Written synchronously, so the chunk is free again at once; after an error the chunk holds
  // stale bytes and the file keeps the shard (the engine re-derives the parameters).
  if (params_file != nullptr && nvme_error_.ok()) {
    const auto tp = std::chrono::steady_clock::now();
    nvme_error_ = params_file->Write(Unit(u), static_cast<const char*>(out));
    times->nvme_wait_ms += MsSince(tp);
  }
  if (on_host) return absl::OkStatus();
  RETURN_IF_ERROR(dev_->Copy(r.param, out, r.n * c_, h2d_));
  return dev_->Record(chunk_out_[u % chunk_out_.size()], h2d_);
}

// The options' form, dtypes, threads and draw filled in around the caller's arrays.
absl::Status OffloadPipeline::RunAdamW(const CompactAdamWArrays& arrays,
                                       absl::Span<const AdamWRange> ranges,
                                       float grad_scale) const {
  CompactAdamWArrays a = arrays;
  a.master_form = options_.master_form;
  a.param_dtype = options_.dtype;
  a.moment_dtype = options_.moment_dtype;
  a.grad_dtype = GradDType();
  a.rounding.seed = options_.rounding_seed;
  a.rounding.step = step_;
  return CpuAdamWCompact(a, ranges, grad_scale, options_.cpu_threads);
}

// AdamW piece by piece on the pinned slots nvme::NvmeState fills: each Acquire reads the next piece
// ahead, then waits for this one; each Release writes it back. Elementwise, so the bits equal
// one AdamW over the unit.
absl::Status OffloadPipeline::UpdateNvmePieces(int u, void* out,
                                               absl::Span<const AdamWRange> ranges,
                                               float grad_scale, Times* times) {
  nvme::NvmeState* state = options_.nvme;
  for (int k = state->first_piece(u); k < state->first_piece(u + 1); ++k) {
    const nvme::NvmeState::Piece& p = state->pieces()[k];
    const auto tn = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(const nvme::NvmeState::Arrays s, state->Acquire(k));
    times->nvme_wait_ms += MsSince(tn);
    char* const piece_out = static_cast<char*>(out) + p.begin * static_cast<int64_t>(c_);
    SliceRanges(ranges, static_cast<size_t>(p.begin), static_cast<size_t>(p.n), &piece_ranges_);
    if (!compact()) {
      AdamWArrays a{s.master, s.m, s.v, Grad(u) + p.begin * static_cast<int64_t>(gc_),
                    GradDType(), piece_out, options_.dtype, static_cast<size_t>(p.n)};
      RETURN_IF_ERROR(CpuAdamW(a, piece_ranges_, grad_scale, options_.cpu_threads));
    } else {
      // The file's arrays in memory::OptimizerStateForm's order: master (or the compact
      // master's bf16 part), remainder, m, v.
      CompactAdamWArrays a;
      int next = 0;
      if (compact_master()) {
        a.param = s.array[next++];
      } else {
        a.master = reinterpret_cast<float*>(s.array[next++]);
        a.param = piece_out;
      }
      if (options_.master_form == MasterForm::kBf16Remainder) {
        a.remainder = reinterpret_cast<uint16_t*>(s.array[next++]);
      }
      a.m = s.array[next++];
      a.v = s.array[next++];
      a.grad = Grad(u) + p.begin * static_cast<int64_t>(gc_);
      a.n = static_cast<size_t>(p.n);
      a.rounding.first_index = regions_[u].first_index + static_cast<uint64_t>(p.begin);
      RETURN_IF_ERROR(RunAdamW(a, piece_ranges_, grad_scale));
      // The new parameters are the compact master's bf16 part.
      if (compact_master()) std::memcpy(piece_out, a.param, static_cast<size_t>(p.n) * c_);
    }
    RETURN_IF_ERROR(state->Release(k));
  }
  return absl::OkStatus();
}

absl::Status OffloadPipeline::Gather(int u, const Hooks& hooks, Times* times) {
  if (!options_.param_on_host) {
    RETURN_IF_ERROR(hooks.before_gather(chunk_out_[u % chunk_out_.size()]));
  }
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(hooks.gather(Unit(u)));
  times->gather_ms += MsSince(t0);
  return absl::OkStatus();
}

absl::Status OffloadPipeline::JoinUploads(Device::Stream stream) {
  if (options_.param_on_host) return absl::OkStatus();
  for (Device::Event e : chunk_out_) RETURN_IF_ERROR(dev_->Wait(stream, e));
  return absl::OkStatus();
}

}  // namespace offload
}  // namespace zerort
