#include "base/bytes.h"

#include <catch2/catch.hpp>

namespace zerort {
namespace {

TEST_CASE("Bytes: sizes parse with decimal and binary units", "[base]") {
  CHECK(*ParseBytes("80GiB") == 80LL << 30);
  CHECK(*ParseBytes("16 GB") == 16000000000LL);
  CHECK(*ParseBytes("8e10") == 80000000000LL);
  CHECK(*ParseBytes("1.5KiB") == 1536);
  CHECK_FALSE(ParseBytes("lots").ok());
  CHECK_FALSE(ParseBytes("5 parsecs").ok());
  CHECK(HumanBytes(1536) == "1.50 KiB");
}

TEST_CASE("Bytes: fractions and negative exponents round to the nearest byte", "[base]") {
  CHECK(*ParseBytes("1e-3GiB") == 1073742);  // 1073741.824
  CHECK(*ParseBytes("1.5e-3 TiB") == 1649267442);  // 1649267441.664
  CHECK(*ParseBytes("2.5") == 3);  // halves round away from zero (llround)
  CHECK(*ParseBytes("0") == 0);
}

TEST_CASE("Bytes: refusals name the text", "[base]") {
  for (const char* bad : {"", "-5GB", "1e30", "12 furlongs", "0.4", "1e-10GiB", "1-3GiB", "1e-",
                          "--1", "1e+-3"}) {
    INFO(bad);
    absl::StatusOr<int64_t> b = ParseBytes(bad);
    REQUIRE_FALSE(b.ok());
    CHECK(b.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(b.status().message()).find(std::string("'") + bad) != std::string::npos);
  }
}

TEST_CASE("Bytes: human and grouped renderings", "[base]") {
  CHECK(HumanBytes(0) == "0 B");
  CHECK(HumanBytes(1023) == "1023 B");
  CHECK(HumanBytes(int64_t{80} << 30) == "80.00 GiB");
  CHECK(GroupedBytes(0) == "0");
  CHECK(GroupedBytes(999) == "999");
  CHECK(GroupedBytes(1000) == "1,000");
  CHECK(GroupedBytes(1234567) == "1,234,567");
}

}  // namespace
}  // namespace zerort
