// OneThreadCpuDevice: the CPU device most tests run on, with one kernel thread so that a test
// leaves the other cores of a shared CI machine to the tests running beside it (results do not
// depend on the thread count). Streams run inline; tests of asynchronous streams build their
// own CpuDeviceOptions.
//
// Thread safety: as CreateCpuDevice's device.
#ifndef ZERORT_DEVICE_TESTING_ONE_THREAD_H_
#define ZERORT_DEVICE_TESTING_ONE_THREAD_H_

#include <memory>

#include "device/cpu_device.h"
#include "device/device.h"

namespace zerort {
namespace testing {

inline std::unique_ptr<Device> OneThreadCpuDevice() {
  CpuDeviceOptions options;
  options.threads = 1;
  return CreateCpuDevice(options);
}

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_DEVICE_TESTING_ONE_THREAD_H_
