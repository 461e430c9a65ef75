// LossScaler: fp16 loss scaling with DeepSpeed's dynamic semantics.
//
// Dynamic scaling starts at 2^initial_scale_power. An overflow consumes one unit of hysteresis;
// when none is left the scale halves (never below min_loss_scale). After loss_scale_window
// consecutive steps without overflow the scale doubles and hysteresis is restored. An overflow
// while the scale already sits at min_loss_scale is an error (FailedPrecondition): DeepSpeed
// would skip steps forever. With a fixed scale (fp16.loss_scale > 0), or outside fp16, Update
// never changes the scale, but overflows are still reported to the caller by the engine.
//
// Thread safety: a plain value; one per engine.
#ifndef ZERORT_ZERO_LOSS_SCALER_H_
#define ZERORT_ZERO_LOSS_SCALER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "zero/config.h"

namespace zerort {

// The evolving part of the loss scaler, for checkpoints: restoring it makes the scale evolve
// as if training had not stopped. The settings (window, hysteresis, minimum) come from the
// config. The one copy of these fields: EngineState extends it, checkpoints store it under
// these names.
struct ScalerState {
  double loss_scale = 1;              // the current scale
  int scaler_hysteresis_left = 0;     // dynamic fp16 scaling: overflows left before halving
  int64_t scaler_iter = 0;            // boundaries the scaler has seen
  int64_t scaler_last_overflow = -1;  // scaler_iter of the last overflow, -1 if none
};

class LossScaler {
 public:
  // Dynamic when precision is fp16 and fp16.loss_scale == 0; fixed at fp16.loss_scale when that
  // is > 0; fixed at 1 otherwise.
  explicit LossScaler(const Config& config);

  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }

  // Records the outcome of one optimizer step (overflow = skipped).
  absl::Status Update(bool overflow);

  // The evolving part of the scaler (see ScalerState).
  using State = ScalerState;
  State state() const { return {scale_, hysteresis_left_, iter_, last_overflow_iter_}; }
  void set_state(const State& s) {
    scale_ = s.loss_scale;
    hysteresis_left_ = s.scaler_hysteresis_left;
    iter_ = s.scaler_iter;
    last_overflow_iter_ = s.scaler_last_overflow;
  }

 private:
  bool dynamic_ = false;
  double scale_ = 1;
  double min_scale_ = 1;
  int window_ = 1000;
  int hysteresis_ = 2;
  int hysteresis_left_ = 2;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
};

}  // namespace zerort

#endif  // ZERORT_ZERO_LOSS_SCALER_H_
