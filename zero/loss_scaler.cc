#include "zero/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace zerort {

LossScaler::LossScaler(const Config& config) {
  if (config.compute_dtype != DType::kF16) return;
  const Fp16Config& f = config.fp16;
  if (f.loss_scale > 0) {
    scale_ = f.loss_scale;
    return;
  }
  dynamic_ = true;
  scale_ = std::ldexp(1.0, f.initial_scale_power);
  min_scale_ = f.min_loss_scale;
  window_ = f.loss_scale_window;
  hysteresis_ = hysteresis_left_ = f.hysteresis;
}

absl::Status LossScaler::Update(bool overflow) {
  if (!dynamic_) {
    ++iter_;
    return absl::OkStatus();
  }
  if (overflow) {
    if (hysteresis_left_ <= 1) {
      if (scale_ <= min_scale_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "fp16 gradients overflowed at step ", iter_, " with the loss scale already at "
            "fp16.min_loss_scale = ", min_scale_, ": the model diverged or min_loss_scale is too "
            "high; training cannot continue by skipping steps"));
      }
      scale_ = std::max(scale_ / 2, min_scale_);
    } else {
      --hysteresis_left_;
    }
    last_overflow_iter_ = iter_;
  } else if ((iter_ - last_overflow_iter_) % window_ == 0) {
    hysteresis_left_ = hysteresis_;
    scale_ *= 2;
  }
  ++iter_;
  return absl::OkStatus();
}

}  // namespace zerort
