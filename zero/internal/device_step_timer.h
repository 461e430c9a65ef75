// DeviceStepTimer: the optimizer step's phases timed on the device's own clock, by timing events
// recorded on the engine's streams (EngineOptions::device_timing, Engine::DeviceTimes).
//
// Why: on a stream-ordered device Step() returns once its work is enqueued, so StepStats' host
// timings hold the enqueueing, not the kernels (on a GPU, AdamW runs after Step() returns).
//
// The points, in step order, all on the compute stream unless said:
//   kStart        before the window's norm and finite checks are enqueued
//   kNormDone     after them (recorded before the norm's host wait, so the rank agreement that
//                 follows is not counted)
//   kUpdateStart  before the update (AdamW on the device, or the offload pipeline's transfers)
//   kUpdateDone   after it, joined back to the compute stream
//   kDoneCompute  after the parameter gathers are joined, the step's last device work ...
//   kDoneSide     ... and the same point on side(), where collectives run
// A skipped step records the update and gather points at once (zero-length phases).
//
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_DEVICE_STEP_TIMER_H_
#define ZERORT_ZERO_INTERNAL_DEVICE_STEP_TIMER_H_

#include <array>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "device/device.h"

namespace zerort {
namespace zero_internal {

// Milliseconds of device time of one optimizer step's phases.
struct DevicePhaseTimes {
  double norm_ms = 0;    // norm and finite checks of the window's gradients
  double update_ms = 0;  // AdamW (device), or the offload pipeline up to its uploads (host AdamW)
  double gather_ms = 0;  // from the end of the update to the end of the parameter gathers
  double total_ms = 0;   // from kStart to the later of kDoneCompute and kDoneSide
};

class DeviceStepTimer {
 public:
  enum Point { kStart, kNormDone, kUpdateStart, kUpdateDone, kDoneCompute, kDoneSide, kPoints };

  // Unimplemented when `device` has no timing events. Both must outlive the timer.
  static absl::StatusOr<std::unique_ptr<DeviceStepTimer>> Create(Device* device);
  ~DeviceStepTimer();
  DeviceStepTimer(const DeviceStepTimer&) = delete;
  DeviceStepTimer& operator=(const DeviceStepTimer&) = delete;

  absl::Status Mark(Point point, Device::Stream stream);
  Device::Event event(Point point) const { return events_[point]; }
  // After kDoneSide of some step: that step is the one Read reports.
  void StepMarked(int64_t step) { step_ = step; }
  // The last marked step's phases; waits for its last device work. FailedPrecondition before
  // any step was marked.
  absl::StatusOr<DevicePhaseTimes> Read(int64_t* step);

 private:
  explicit DeviceStepTimer(Device* device) : dev_(device) {}

  Device* const dev_;
  std::array<Device::Event, kPoints> events_{};
  int64_t step_ = -1;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_DEVICE_STEP_TIMER_H_
