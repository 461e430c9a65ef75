// A host buffer of fp32, bf16 or fp16 elements for communicator tests: raw bytes to hand to a
// collective, with float get/set through base/dtype.h's reference conversions so that tests can
// build inputs and serial references in fp32.
#ifndef ZERORT_COMM_TESTING_TYPED_BUFFER_H_
#define ZERORT_COMM_TESTING_TYPED_BUFFER_H_

#include <cstdint>
#include <vector>

#include "base/dtype.h"

namespace zerort {
namespace comm {
namespace testing {

struct Buf {
  DType t;
  std::vector<char> bytes;
  Buf(DType type, size_t count) : t(type), bytes(count * DTypeSize(type)) {}
  size_t count() const { return bytes.size() / DTypeSize(t); }
  float get(size_t i) const { return LoadAs(t, bytes.data(), i); }
  void set(size_t i, float v) { StoreAs(t, bytes.data(), i, v); }
  void* data() { return bytes.data(); }
  char* at(size_t elem) { return bytes.data() + elem * DTypeSize(t); }
  const char* at(size_t elem) const { return bytes.data() + elem * DTypeSize(t); }
};

}  // namespace testing
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_TESTING_TYPED_BUFFER_H_
