#include "zero/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace zerort {
namespace {

// DeepSpeed never warms up over fewer than 2 steps (log(1) would divide by zero).
int64_t WarmupSteps(const SchedulerConfig& c) { return std::max<int64_t>(2, c.warmup_num_steps); }

}  // namespace

double LrSchedule::WarmupGamma(int64_t iteration) const {
  const double w = static_cast<double>(WarmupSteps(c_));
  const double it = static_cast<double>(iteration);
  return c_.warmup_type == WarmupType::kLog ? std::log(it + 1) / std::log(w) : it / w;
}

double LrSchedule::WarmupLr(int64_t iteration) const {
  if (iteration < 0) return c_.warmup_min_lr;  // the rate set at construction
  double gamma = 1.0;
  const int64_t w = WarmupSteps(c_);
  if (iteration < w) {
    gamma = WarmupGamma(iteration);
  } else if (c_.type == SchedulerType::kWarmupDecayLR) {
    // Linear decay to 0 at total_num_steps, and 0 after it.
    gamma = std::max(0.0, static_cast<double>(c_.total_num_steps - iteration) /
                              std::max(1.0, static_cast<double>(c_.total_num_steps - w)));
  }
  return c_.warmup_min_lr + (c_.warmup_max_lr - c_.warmup_min_lr) * gamma;
}

double LrSchedule::CosineLr(int64_t iteration) const {
  if (iteration < 0) return 0.0;  // DeepSpeed's WarmupCosineLR starts at 0
  const int64_t w = WarmupSteps(c_);
  double ratio;
  if (iteration < w) {
    ratio = c_.warmup_min_ratio + WarmupGamma(iteration) * (1.0 - c_.warmup_min_ratio);
  } else {
    // Past total_num_steps the cosine rises again, as DeepSpeed's does. With total_num_steps
    // <= the warmup DeepSpeed divides by zero; here the rate then stays at cos_min_ratio.
    const double done = static_cast<double>(iteration - w + 1);
    const double span = static_cast<double>(c_.total_num_steps - w);
    const double cosine = span > 0 ? (1.0 + std::cos(M_PI * done / span)) / 2.0 : 0.0;
    ratio = std::max(0.0, c_.cos_min_ratio + (1.0 - c_.cos_min_ratio) * cosine);
  }
  return base_lr_ * ratio;
}

double LrSchedule::OneCycleLr(int64_t iteration) const {
  const double first = static_cast<double>(c_.cycle_first_step_size);
  const double second =
      c_.cycle_second_step_size > 0 ? static_cast<double>(c_.cycle_second_step_size) : first;
  const double total = first + second;
  if (static_cast<double>(iteration) < total) {
    // Up over the first step size, down over the second. DeepSpeed evaluates the cycle one
    // batch ahead (last_batch_iteration + 1); iteration -1 is its initial cycle_min_lr.
    const double step_ratio = first / total;
    const double at = static_cast<double>(iteration + 1) / total;
    const double x = 1.0 + at - std::floor(1.0 + at);
    const double scale = x <= step_ratio ? x / step_ratio : (x - 1.0) / (step_ratio - 1.0);
    return c_.cycle_min_lr + (c_.cycle_max_lr - c_.cycle_min_lr) * scale;
  }
  if (c_.decay_step_size == 0 || c_.decay_lr_rate == 0) return c_.cycle_min_lr;
  const double k = static_cast<double>(iteration) - total + 1.0;
  return c_.cycle_min_lr /
         (1.0 + c_.decay_lr_rate * k / static_cast<double>(c_.decay_step_size));
}

double LrSchedule::RangeTestLr(int64_t iteration) const {
  if (iteration < 0) return c_.lr_range_test_min_lr;  // the rate set at construction
  double interval =
      static_cast<double>(iteration) / static_cast<double>(c_.lr_range_test_step_size);
  if (c_.lr_range_test_staircase) interval = std::floor(interval);
  return c_.lr_range_test_min_lr * (1.0 + c_.lr_range_test_step_rate * interval);
}

double LrSchedule::LrAt(int64_t step) const {
  const int64_t iteration = step - 1;  // DeepSpeed's last_batch_iteration
  switch (c_.type) {
    case SchedulerType::kNone:
      return base_lr_;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      return WarmupLr(iteration);
    case SchedulerType::kWarmupCosineLR:
      return CosineLr(iteration);
    case SchedulerType::kOneCycle:
      return OneCycleLr(iteration);
    case SchedulerType::kLRRangeTest:
      return RangeTestLr(iteration);
  }
  return base_lr_;
}

}  // namespace zerort
