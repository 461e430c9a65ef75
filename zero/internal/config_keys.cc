#include "zero/internal/config_keys.h"

#include <vector>

namespace zerort {
namespace config_internal {

KeyDef KeyDef::Alias(const char* a) const {
  KeyDef k = *this;
  k.alias = a;
  return k;
}

KeyDef KeyDef::Auto(AutoRule rule) const {
  KeyDef k = *this;
  k.auto_rule = rule;
  return k;
}

KeyDef KeyDef::NoEffect(const char* reason, const char* off) const {
  KeyDef k = *this;
  k.role = Role::kNoEffect;
  k.why = reason;
  k.turned_off = off;
  return k;
}

KeyDef KeyDef::Input() const {
  KeyDef k = *this;
  k.role = Role::kInput;
  return k;
}

KeyDef Int(const char* path, Member<int> m, int64_t lo, int64_t hi) {
  KeyDef k = Scalar(path, m);
  k.int_lo = lo;
  k.int_hi = hi;
  return k;
}

KeyDef Int64(const char* path, Member<int64_t> m, int64_t lo) {
  KeyDef k = Scalar(path, m);
  k.int_lo = lo;
  return k;
}

KeyDef Real(const char* path, Member<double> m, DoubleRange range) {
  KeyDef k = Scalar(path, m);
  k.real = range;
  return k;
}

KeyDef Hand(const char* path, Custom custom) {
  KeyDef k{path};
  k.custom = custom;
  return k;
}

KeyDef Foreign(const char* path, const char* why, const char* only_value) {
  KeyDef k{path};
  k.role = Role::kForeign;
  k.why = why;
  k.only_value = only_value;
  return k;
}

absl::string_view ParentPath(absl::string_view path) {
  size_t dot = path.rfind('.');
  return dot == absl::string_view::npos ? absl::string_view() : path.substr(0, dot);
}

absl::string_view LeafName(absl::string_view path) {
  size_t dot = path.rfind('.');
  return dot == absl::string_view::npos ? path : path.substr(dot + 1);
}

namespace {

#define M ZERORT_CONFIG_MEMBER

// Why DeepSpeed keys change nothing here, said once for the keys that share a reason.
constexpr char kNvmeTuning[] =
    "a tuning switch of DeepSpeed's NVMe swapper, which zerort's nvme offload does not have";
constexpr char kMonitoring[] = "monitoring belongs to the trainer";
constexpr char kCheckpointing[] = "checkpointing belongs to the trainer";
constexpr char kTrainerFeature[] =
    "a DeepSpeed feature of the training loop or model, not of "
    "the optimizer runtime; the trainer implements it or not";
constexpr char kCollective[] = "the reduction collective follows from the stage";
constexpr char kReuse[] = "stage-3 release is driven by the trainer's Release calls";
constexpr char kCasting[] = "casting the model's inputs belongs to the trainer";
constexpr char kOneAdamW[] = "zerort has one AdamW implementation per device";
// What zerort always does in place of three DeepSpeed switches (docs/config.md says the same).
constexpr char kOverlapWhy[] =
    "zerort always overlaps gradient reduction with backward: each unit is reduced as soon as "
    "GradReady has been called for all its parameters, while backward goes on";
constexpr char kContiguousWhy[] =
    "zerort always keeps gradients in contiguous buffers: one flat buffer for the whole model in "
    "stages 0-1, one flat bucket per unit in stages 2-3, which every reduction reads in place";
constexpr char kAllgatherWhy[] =
    "zerort all-gathers parameters one unit at a time, and units are sized by "
    "zero_optimization.reduce_bucket_size";

// The tables are function-local statics: built on first use, never seen half made by a static
// initializer in another file.
absl::Span<const KeyDef> ZeroKeys() {
  static const KeyDef kKeys[] = {
      Hand("zero_optimization.stage", Custom::kStage),
      Int64("zero_optimization.reduce_bucket_size", M(zero.reduce_bucket_size), 0)
          .Auto(AutoRule::kUnitSize),
      Scalar("zero_optimization.overlap_comm", M(zero.overlap_comm))
          .NoEffect(kOverlapWhy, "overlap"),
      Scalar("zero_optimization.contiguous_gradients", M(zero.contiguous_gradients))
          .NoEffect(kContiguousWhy, "contiguous gradients"),
      Int64("zero_optimization.allgather_bucket_size", M(zero.allgather_bucket_size), 0)
          .NoEffect(kAllgatherWhy),
      Scalar("zero_optimization.offload_optimizer.device", M(zero.offload_optimizer.device)),
      Scalar("zero_optimization.offload_optimizer.pin_memory",
             M(zero.offload_optimizer.pin_memory)),
      Int("zero_optimization.offload_optimizer.buffer_count",
          M(zero.offload_optimizer.buffer_count), 0),
      Scalar("zero_optimization.offload_optimizer.nvme_path", M(zero.offload_optimizer.nvme_path)),
      Foreign("zero_optimization.offload_optimizer.pipeline_read", kNvmeTuning),
      Foreign("zero_optimization.offload_optimizer.pipeline_write", kNvmeTuning),
      Foreign("zero_optimization.offload_optimizer.fast_init", kNvmeTuning),
      Real("zero_optimization.offload_optimizer.ratio", M(zero.offload_optimizer.ratio),
           DoubleRange{0, false, 1, false}),
      Foreign("zero_optimization.offload_optimizer.super_offload",
              "SuperOffload's Superchip scheduling is DeepSpeed's; zerort's offloaded step always "
              "runs its host AdamW between the device-to-host and host-to-device streams"),
      Foreign("zero_optimization.offload_optimizer.cpuadam_cores_perc",
              "the host AdamW's threads are set by cpu_threads"),
      Scalar("zero_optimization.offload_param.device", M(zero.offload_param.device)),
      Scalar("zero_optimization.offload_param.pin_memory", M(zero.offload_param.pin_memory)),
      Scalar("zero_optimization.offload_param.nvme_path", M(zero.offload_param.nvme_path)),
      Int("zero_optimization.offload_param.buffer_count", M(zero.offload_param.buffer_count), 0),
      Int64("zero_optimization.offload_param.buffer_size", M(zero.offload_param.buffer_size), 0),
      Foreign("zero_optimization.offload_param.max_in_cpu", kNvmeTuning),
      Int64("zero_optimization.stage3_prefetch_bucket_size", M(zero.stage3_prefetch_bucket_size), 0)
          .Auto(AutoRule::kUnitSize)
          .Alias("prefetch_bucket_size"),
      Int64("zero_optimization.stage3_param_persistence_threshold",
            M(zero.stage3_param_persistence_threshold), 0)
          .Auto(AutoRule::kUnitSize)
          .Alias("param_persistence_threshold"),
      // OpenRLHF-style configs write "auto" here too; ResolveAuto gives DeepSpeed's default.
      Int64("zero_optimization.stage3_max_live_parameters", M(zero.stage3_max_live_parameters), 0)
          .Auto(AutoRule::kRecorded)
          .Alias("max_live_parameters"),
      Int64("zero_optimization.memory_budget.device_bytes", M(zero.memory_budget.device_bytes), 0),
      Int64("zero_optimization.memory_budget.host_bytes", M(zero.memory_budget.host_bytes), 0),
      Hand("zero_optimization.cpu_offload", Custom::kCpuOffload).Input(),
      Hand("zero_optimization.cpu_offload_param", Custom::kCpuOffloadParam).Input(),
      Hand("zero_optimization.cpu_offload_use_pin_memory", Custom::kCpuOffloadPinned).Input(),
      Foreign("zero_optimization.allgather_partitions",
              "parameters are always all-gathered per unit"),
      Foreign("zero_optimization.reduce_scatter", kCollective),
      Foreign("zero_optimization.use_multi_rank_bucket_allreduce", kCollective),
      Foreign("zero_optimization.round_robin_gradients", "host gradient copies follow unit order"),
      Foreign("zero_optimization.ignore_unused_parameters",
              "every parameter needs GradReady each micro-step (Step names a missing one); hand an "
              "unused parameter's gradient over as zeros"),
      Foreign("zero_optimization.sub_group_size",
              "the host optimizer already steps one unit shard at a time"),
      Foreign("zero_optimization.stage3_max_reuse_distance", kReuse).Alias("max_reuse_distance"),
      Foreign("zero_optimization.stage3_model_persistence_threshold",
              "persistence follows stage3_param_persistence_threshold alone")
          .Alias("model_persistence_threshold"),
      Foreign("zero_optimization.stage3_module_granularity_threshold",
              "the trainer gathers whole units")
          .Alias("module_granularity_threshold"),
      Foreign("zero_optimization.stage3_use_all_reduce_for_fetch_params",
              "units are gathered with all-gather")
          .Alias("use_all_reduce_for_fetch_params"),
      Foreign("zero_optimization.stage3_gather_16bit_weights_on_model_save", kCheckpointing)
          .Alias("gather_16bit_weights_on_model_save"),
      Foreign("zero_optimization.stage3_gather_fp16_weights_on_model_save", kCheckpointing),
      Foreign("zero_optimization.elastic_checkpoint", kCheckpointing),
      Foreign("zero_optimization.load_from_fp32_weights", kCheckpointing),
      Foreign("zero_optimization.pipeline_loading_checkpoint", kCheckpointing),
      Foreign("zero_optimization.memory_efficient_linear", kTrainerFeature),
      Foreign("zero_optimization.override_module_apply", kTrainerFeature),
      Foreign("zero_optimization.legacy_stage1", "the old stage-1 implementation", "false"),
      Foreign("zero_optimization.zero_quantized_weights", "quantized communication", "false"),
      Foreign("zero_optimization.zero_quantized_nontrainable_weights", "quantized weights",
              "false"),
      Foreign("zero_optimization.zero_quantized_gradients", "quantized communication", "false"),
      Foreign("zero_optimization.zeropp_loco_param", "quantized communication", "null"),
      Int("zero_optimization.mics_shard_size", M(zero.mics_shard_size), -1),
      Scalar("zero_optimization.mics_hierarchical_params_gather",
             M(zero.mics_hierarchical_params_gather)),
      Int("zero_optimization.zero_hpz_partition_size", M(zero.zero_hpz_partition_size), 1),
      Foreign("zero_optimization.zenflow",
              "ZenFlow, DeepSpeed's split of the offloaded update between device and host, is not "
              "zerort's: its offloaded step updates every owned shard with the host AdamW"),
      Foreign("zero_optimization.stage3_allgather_sequential",
              "zerort already all-gathers stage-3 parameters one unit at a time")
          .Alias("allgather_sequential"),
      Foreign("zero_optimization.leaf_module",
              "zerort hooks no modules: the trainer gathers and releases whole units"),
      Foreign("zero_optimization.log_trace_cache_warnings",
              "zerort keeps no parameter-fetch trace to warn about: the trainer's Gather calls "
              "order the fetches"),
      Foreign("zero_optimization.save_muon_momentum_buffer_in_memory",
              "zerort's optimizer is AdamW; it has no Muon momentum buffer", "false"),
      Foreign("zero_optimization.enable_sanity_checks",
              "zerort's checks always run: every rank agrees on model and config in Create, and "
              "Step names a gradient that was never handed over"),
  };
  return kKeys;
}

absl::Span<const KeyDef> PrecisionAndOptimizerKeys() {
  static const KeyDef kKeys[] = {
      Hand("bf16.enabled", Custom::kBf16Enabled),
      Foreign("bf16.immediate_grad_update", "gradients are accumulated in the unit buckets"),
      // DeepSpeed's default (true since v0.19.3) skips a step with a non-finite gradient; so does
      // zerort, and it keeps doing so with false: a NaN written into the fp32 masters and
      // moments cannot be undone, a skipped step costs one step.
      // Compact optimizer state (docs/compact_state.md): bf16 parameters only (config.cc).
      Scalar("bf16.bf16_master_weights_and_grads", M(bf16_master_weights_and_grads)),
      Scalar("bf16.bf16_optimizer_states", M(bf16_optimizer_states)),
      Foreign("bf16.check_grad_overflow",
              "a step with a non-finite gradient is always skipped, in every dtype: applied, it "
              "would write NaN or Inf into the fp32 master weights and Adam moments for good"),
      Hand("fp16.enabled", Custom::kFp16Enabled),
      Real("fp16.loss_scale", M(fp16.loss_scale), kNonNegative),
      // 2^127 is the largest power of two a float holds.
      Int("fp16.initial_scale_power", M(fp16.initial_scale_power), 0, 127),
      Int("fp16.loss_scale_window", M(fp16.loss_scale_window), 1),
      Int("fp16.hysteresis", M(fp16.hysteresis), 1),
      Real("fp16.min_loss_scale", M(fp16.min_loss_scale), kPositive),
      Foreign("fp16.consecutive_hysteresis", "hysteresis refill", "false"),
      Foreign("fp16.auto_cast", kCasting),
      Foreign("fp16.fp16_master_weights_and_grads", "master weights are always fp32", "false"),
      Hand("optimizer.type", Custom::kOptimizerType, M(optimizer.type)),
      Real("optimizer.params.lr", M(optimizer.lr), kNonNegative).Auto(AutoRule::kRecorded),
      Hand("optimizer.params.betas", Custom::kBetas),
      Real("optimizer.params.eps", M(optimizer.eps), kPositive).Auto(AutoRule::kRecorded),
      Real("optimizer.params.weight_decay", M(optimizer.weight_decay), kNonNegative)
          .Auto(AutoRule::kRecorded),
      Foreign("optimizer.params.adam_w_mode", "Adam with coupled L2 weight decay", "true"),
      Foreign("optimizer.params.bias_correction", "Adam without bias correction", "true"),
      Foreign("optimizer.params.amsgrad", "AMSGrad", "false"),
      Foreign("optimizer.params.torch_adam", kOneAdamW),
      Foreign("optimizer.params.fused", kOneAdamW),
      Foreign("optimizer.legacy_fusion", kOneAdamW, "false"),
      Hand("scheduler", Custom::kScheduler),
  };
  return kKeys;
}

absl::Span<const KeyDef> TopKeys() {
  static const KeyDef kKeys[] = {
      Real("gradient_clipping", M(gradient_clipping), kNonNegative).Auto(AutoRule::kRecorded),
      Int("gradient_accumulation_steps", M(gradient_accumulation_steps), 1)
          .Auto(AutoRule::kRecordedNamed),
      Scalar("prescale_gradients", M(prescale_gradients)),
      Real("gradient_predivide_factor", M(gradient_predivide_factor), kPositive),
      Hand("train_batch_size", Custom::kBatchSize, M(train_batch_size)).Input(),
      Hand("train_micro_batch_size_per_gpu", Custom::kBatchSize, M(train_micro_batch_size_per_gpu))
          .Input(),
      Scalar("communication_data_type", M(communication_dtype)),
      Scalar("data_types.grad_accum_dtype", M(grad_accum_dtype)),
      Foreign("data_types.param_dtype",
              "parameters are in the compute dtype that bf16/fp16.enabled select", "null"),
      Foreign("data_types.buffer_dtype", "the model's buffers belong to the trainer"),
      Int64("aio.block_size", M(aio.block_size), 4096),  // and a multiple of 4096 (config.cc)
      Int("aio.queue_depth", M(aio.queue_depth), 1),
      Scalar("aio.single_submit", M(aio.single_submit)),
      Scalar("aio.overlap_events", M(aio.overlap_events)),
      // DeepSpeed renamed thread_count to intra_op_parallelism.
      Int("aio.thread_count", M(aio.thread_count), 1).Alias("intra_op_parallelism"),
      Foreign("aio.use_gds", "GPUDirect Storage", "false"),
      Int64("comm_timeout_ms", M(comm_timeout_ms), 1),
      Int("cpu_threads", M(cpu_threads), 0),
      Scalar("zerort.strict", M(strict)),
      Hand("zerort.param_groups", Custom::kParamGroups),
      Scalar("zerort.frozen_params", M(frozen_params)),
      Scalar("zerort.local_grad_accumulation", M(local_grad_accumulation)),
      Int("zerort.ranks_per_node", M(ranks_per_node), 0),
      Scalar("zerort.store_param_remainders", M(store_param_remainders)),
      Int64("zerort.stochastic_rounding_seed", M(stochastic_rounding_seed), 0),
      Int64("zerort.reserves.cuda_context_bytes", M(reserves.cuda_context_bytes), 0),
      Int64("zerort.reserves.nccl_communicator_bytes", M(reserves.nccl_communicator_bytes), 0),
      Int64("zerort.reserves.nccl_buffsize", M(reserves.nccl_buffsize), 0),
      Int("zerort.reserves.nccl_channels", M(reserves.nccl_channels), 0),
      Int64("zerort.reserves.cublas_workspace_bytes", M(reserves.cublas_workspace_bytes), 0),
      Real("zerort.reserves.fragmentation_fraction", M(reserves.fragmentation_fraction),
           kNonNegative),
      Foreign("steps_per_print", kMonitoring),
      Foreign("wall_clock_breakdown", kMonitoring),
      Foreign("memory_breakdown", kMonitoring),
      Foreign("dump_state", kMonitoring),
      Foreign("tensorboard", kMonitoring),
      Foreign("wandb", kMonitoring),
      Foreign("csv_monitor", kMonitoring),
      Foreign("comet", kMonitoring),
      Foreign("comms_logger", kMonitoring),
      Foreign("flops_profiler", kMonitoring),
      Foreign("timers", kMonitoring),
      Foreign("zero_allow_untested_optimizer", "the optimizer is always zerort's AdamW"),
      Foreign("zero_force_ds_cpu_optimizer", "offloaded steps always run zerort's host AdamW"),
      Foreign("activation_checkpointing", "activation checkpointing belongs to the trainer"),
      Foreign("checkpoint", kCheckpointing),
      Foreign("load_universal_checkpoint", kCheckpointing),
      Foreign("dataloader_drop_last", "data loading belongs to the trainer"),
      Foreign("data_efficiency", kTrainerFeature),
      Foreign("curriculum_learning", kTrainerFeature),
      Foreign("progressive_layer_drop", kTrainerFeature),
      Foreign("sparse_attention", kTrainerFeature),
      Foreign("pipeline", kTrainerFeature),
      Foreign("compression_training", kTrainerFeature),
      Foreign("quantize_training", kTrainerFeature),
      Foreign("eigenvalue", kTrainerFeature),
      Foreign("elasticity", kTrainerFeature),
      Foreign("autotuning", kTrainerFeature),
      Foreign("nebula", kCheckpointing),
      Foreign("compile", kTrainerFeature),
      Foreign("torch_autocast", kCasting),
      Foreign("seq_parallel_communication_data_type", "zerort has no sequence parallelism"),
      Foreign(
          "tensor_parallel",
          "zerort has no tensor parallelism: the trainer's model code shards its layers or not"),
      Foreign("managed_gradient_accumulation",
              "zerort manages accumulation itself: gradients add up over "
              "gradient_accumulation_steps micro-steps, and the last Step of each window updates"),
      Foreign("sparse_gradients", "sparse gradients", "false"),
      Foreign("disable_allgather", "broadcast instead of all-gather", "false"),
      Foreign("amp", "Apex AMP", "{\"enabled\": false}"),
      // Keys of DeepSpeed v0.19.5's runtime/config.py that the table above lacked.
      Foreign("gradient_allreduce_op",
              "a sum of the ranks' gradients instead of their mean (zerort always averages)",
              "\"mean\""),
      Foreign("graph_harvesting", kTrainerFeature),
      Foreign("log_level", kMonitoring),
      Foreign("datastates_ckpt", kCheckpointing),
      Foreign("weight_quantization", kTrainerFeature),
      Foreign("expert_parallel", "zerort has no expert parallelism"),
      Foreign("use_data_before_expert_parallelism", "zerort has no expert parallelism"),
      Foreign("vocabulary_size", kTrainerFeature),
      Foreign("hybrid_engine", "the RLHF hybrid engine", "{\"enabled\": false}"),
  };
  return kKeys;
}

#undef M

}  // namespace

absl::Span<const KeyDef> ConfigKeys() {
  static const std::vector<KeyDef>* keys = [] {
    auto* all = new std::vector<KeyDef>;
    for (absl::Span<const KeyDef> part : {ZeroKeys(), PrecisionAndOptimizerKeys(), TopKeys()}) {
      all->insert(all->end(), part.begin(), part.end());
    }
    return all;
  }();
  return *keys;
}

absl::Span<const BlockAlias> ConfigBlockAliases() {
  static constexpr BlockAlias kAliases[] = {{"bf16", "bfloat16"}};
  return kAliases;
}

}  // namespace config_internal
}  // namespace zerort
