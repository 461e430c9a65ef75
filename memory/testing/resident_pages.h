// What the kernel says is resident, for tests of Decommit and Park: an allocator's own counts
// could agree with themselves while the pages stayed, so the tests ask mincore(2).
#ifndef ZERORT_MEMORY_TESTING_RESIDENT_PAGES_H_
#define ZERORT_MEMORY_TESTING_RESIDENT_PAGES_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace memory {
namespace testing {

// How many of the pages of [p, p + bytes) are resident. REQUIRES: `p` is page-aligned.
inline size_t ResidentPages(const void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  REQUIRE(mincore(const_cast<void*>(p), bytes, vec.data()) == 0);
  size_t n = 0;
  for (unsigned char c : vec) n += c & 1;
  return n;
}

}  // namespace testing
}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_TESTING_RESIDENT_PAGES_H_
