#include "zero/internal/device_step_timer.h"

#include <algorithm>

#include "base/status.h"

namespace zerort {
namespace zero_internal {

absl::StatusOr<std::unique_ptr<DeviceStepTimer>> DeviceStepTimer::Create(Device* device) {
  std::unique_ptr<DeviceStepTimer> t(new DeviceStepTimer(device));
  for (Device::Event& e : t->events_) {
    ASSIGN_OR_RETURN(e, device->CreateTimingEvent());
  }
  return t;
}

DeviceStepTimer::~DeviceStepTimer() {
  for (Device::Event e : events_) {
    if (e != nullptr) dev_->DestroyEvent(e);
  }
}

absl::Status DeviceStepTimer::Mark(Point point, Device::Stream stream) {
  return dev_->Record(events_[point], stream);
}

absl::StatusOr<DevicePhaseTimes> DeviceStepTimer::Read(int64_t* step) {
  if (step_ < 0) {
    return absl::FailedPreconditionError(
        "DeviceTimes(): no optimizer step has run since device timing was enabled");
  }
  RETURN_IF_ERROR(dev_->WaitHost(events_[kDoneCompute]));
  RETURN_IF_ERROR(dev_->WaitHost(events_[kDoneSide]));
  auto since = [this](Point from, Point to) { return dev_->ElapsedMs(events_[from], events_[to]); };
  DevicePhaseTimes t;
  ASSIGN_OR_RETURN(t.norm_ms, since(kStart, kNormDone));
  ASSIGN_OR_RETURN(t.update_ms, since(kUpdateStart, kUpdateDone));
  ASSIGN_OR_RETURN(const double to_update_done, since(kStart, kUpdateDone));
  ASSIGN_OR_RETURN(const double to_compute_done, since(kStart, kDoneCompute));
  ASSIGN_OR_RETURN(const double to_side_done, since(kStart, kDoneSide));
  t.total_ms = std::max(to_compute_done, to_side_done);
  t.gather_ms = std::max(0.0, t.total_ms - to_update_done);
  *step = step_;
  return t;
}

}  // namespace zero_internal
}  // namespace zerort
