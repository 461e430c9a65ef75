// LrSchedule: the learning rate of DeepSpeed's schedules (the config's `scheduler` block) at
// each optimizer step, with DeepSpeed's formulas: WarmupLR, WarmupDecayLR, WarmupCosineLR,
// OneCycle (learning rate only: momentum cycling is not done, the config notes it) and
// LRRangeTest. Without a scheduler the rate is optimizer.params.lr throughout.
//
//   LrSchedule schedule(config.scheduler, config.optimizer.lr);
//   for (int64_t step = 0; ...; ++step) engine.Step(schedule.LrAt(step));
//
// Steps count as DeepSpeed's engine does: it runs the optimizer, then advances its scheduler,
// so optimizer step `step` (0-based) uses the rate DeepSpeed's scheduler holds after `step`
// calls of its step(), i.e. at its last_batch_iteration = step - 1. LrAt(0) is the rate the
// scheduler sets when it is built (WarmupLR: warmup_min_lr; WarmupCosineLR: 0, as DeepSpeed).
//
// The schedule is a pure function of the step: its whole state for resume is the step count
// the checkpoint already holds; nothing else needs saving.
//
// Thread safety: immutable after construction; LrAt is const and thread-safe.
#ifndef ZERORT_ZERO_LR_SCHEDULE_H_
#define ZERORT_ZERO_LR_SCHEDULE_H_

#include <cstdint>

#include "zero/config.h"

namespace zerort {

class LrSchedule {
 public:
  // `base_lr` is optimizer.params.lr: the rate without a scheduler, and what WarmupCosineLR's
  // ratios multiply. REQUIRES: `config` as ParseConfig returns it, with any "auto" scheduler
  // values filled (ResolveAuto in zero/auto_fill.h).
  LrSchedule(const SchedulerConfig& config, double base_lr) : c_(config), base_lr_(base_lr) {}

  // The learning rate of optimizer step `step` (>= 0; counted from 0).
  double LrAt(int64_t step) const;

 private:
  double WarmupGamma(int64_t iteration) const;  // 0..1 over the warmup
  double WarmupLr(int64_t iteration) const;     // WarmupLR, WarmupDecayLR
  double CosineLr(int64_t iteration) const;
  double OneCycleLr(int64_t iteration) const;
  double RangeTestLr(int64_t iteration) const;

  SchedulerConfig c_;
  double base_lr_;
};

}  // namespace zerort

#endif  // ZERORT_ZERO_LR_SCHEDULE_H_
