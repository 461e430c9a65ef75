// A host buffer of fp32, bf16 or fp16 elements for communicator tests: raw bytes to hand to a
// collective, with float get/set through base/dtype.h's reference conversions so that tests can
// build inputs and serial references in fp32.
#ifndef ZERORT_COMM_TESTING_TYPED_BUFFER_H_
#define ZERORT_COMM_TESTING_TYPED_BUFFER_H_

#include <cstdint>
#include <cstring>
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
  float get(size_t i) const {
    if (t == DType::kF32) {
      float f;
      std::memcpy(&f, &bytes[4 * i], 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, &bytes[2 * i], 2);
    return t == DType::kBF16 ? Bf16ToFloat(h) : HalfToFloat(h);
  }
  void set(size_t i, float v) {
    if (t == DType::kF32) {
      std::memcpy(&bytes[4 * i], &v, 4);
      return;
    }
    const uint16_t h = t == DType::kBF16 ? FloatToBf16(v) : FloatToHalf(v);
    std::memcpy(&bytes[2 * i], &h, 2);
  }
  void* data() { return bytes.data(); }
  char* at(size_t elem) { return bytes.data() + elem * DTypeSize(t); }
  const char* at(size_t elem) const { return bytes.data() + elem * DTypeSize(t); }
};

}  // namespace testing
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_TESTING_TYPED_BUFFER_H_
