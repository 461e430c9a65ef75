// OneThreadCpuDevice: the CPU device most tests run on, with one kernel thread so that a test
// leaves the other cores of a shared CI machine to the tests running beside it (results do not
// depend on the thread count). Its streams run inline; AsyncOneThreadCpuDevice's run on
// threads of their own, for tests of stream and event order.
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

// The same with asynchronous streams (a worker thread each), every operation on them starting
// `stream_delay_us` late: a missing event wait then gives a wrong result, not a rare one.
inline std::unique_ptr<Device> AsyncOneThreadCpuDevice(int stream_delay_us = 0) {
  CpuDeviceOptions options;
  options.threads = 1;
  options.async_streams = true;
  options.stream_delay_us = stream_delay_us;
  return CreateCpuDevice(options);
}

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_DEVICE_TESTING_ONE_THREAD_H_
