#include "nvme/params.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "base/testing/temp_dir.h"

namespace zerort {
namespace nvme {
namespace {

std::vector<char> Pattern(int64_t n, int seed) {
  std::vector<char> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 31 + seed * 17 + (i >> 9)) & 0xff);
  return v;
}

// Reads unit u back into a vector through the sink, checking the pieces arrive in order.
absl::StatusOr<std::vector<char>> ReadBack(NvmeParams* p, int u, int64_t bytes) {
  std::vector<char> out;
  absl::Status s = p->Read(u, [&](int64_t offset, const char* data, int64_t n) {
    if (offset != static_cast<int64_t>(out.size())) return absl::InternalError("out of order");
    out.insert(out.end(), data, data + n);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (static_cast<int64_t>(out.size()) != bytes) return absl::InternalError("wrong size");
  return out;
}

struct Fixture {
  std::vector<int64_t> shards = {10000, 0, 3 * 4096, 50000, 8191};
  std::unique_ptr<SwapDir> dir;
  std::unique_ptr<SwapFile> file;
  std::unique_ptr<AioEngine> io;
  IoBuffer buffers;
  std::unique_ptr<NvmeParams> params;

  explicit Fixture(int buffer_count, int64_t base = 8192, int rank = 0,
                   std::vector<int64_t> shard_sizes = {}, IoFaultHook fault = nullptr) {
    if (!shard_sizes.empty()) shards = std::move(shard_sizes);
    dir = *SwapDir::Create(testing::TestTmpDir(), "params", rank);
    file = *dir->CreateFile("params", base + NvmeParams::FileBytes(shards));
    AioOptions o;
    o.block_size = 4096;
    o.queue_depth = 2;
    o.thread_count = 2;
    o.fault = std::move(fault);
    io = *AioEngine::Create(o);
    buffers = *IoBuffer::Allocate(buffer_count * 8192);
    params = *NvmeParams::Create(io.get(), file.get(), base, shards, buffers.data(),
                                 buffer_count, 8192 + 100);  // rounded down to 8192
  }
  ~Fixture() {
    params.reset();
    file.reset();
  }
};

TEST_CASE("NvmeParams: shards written read back, with and without read-ahead", "[nvme]") {
  for (int count : {1, 2, 4}) {
    Fixture f(count);
    REQUIRE(f.params->piece_bytes() == 8192);
    REQUIRE(NvmeParams::FileBytes(f.shards) == 12288 + 0 + 12288 + 53248 + 8192);
    std::vector<std::vector<char>> data;
    for (size_t u = 0; u < f.shards.size(); ++u) {
      data.push_back(Pattern(f.shards[u], static_cast<int>(u) + count));
      REQUIRE(f.params->Write(static_cast<int>(u), data[u].data()).ok());
    }
    f.params->Invalidate();  // nothing cached: every byte below comes from the file
    const int n = static_cast<int>(f.shards.size());
    for (int round = 0; round < 3; ++round) {
      for (int k = 0; k < n; ++k) {
        const int u = round == 2 ? n - 1 - k : k;  // round 2 in reverse, reading ahead down
        const int d = round == 2 ? -1 : 1;
        if (round > 0 && u + d >= 0 && u + d < n) f.params->ReadAhead(u + d, d);
        auto back = ReadBack(f.params.get(), u, f.shards[u]);
        REQUIRE(back.ok());
        CHECK(*back == data[u]);
      }
    }
    CHECK(f.params->reads_ahead_used() > 0);
  }
}

TEST_CASE("NvmeParams: a write drops the unit's older read-ahead", "[nvme]") {
  Fixture f(3);
  const std::vector<char> a = Pattern(50000, 1), b = Pattern(50000, 2);
  REQUIRE(f.params->Write(3, a.data()).ok());
  f.params->Invalidate();
  f.params->ReadAhead(3);  // holds a's first pieces (direction 0: unit 3 only)
  REQUIRE(f.params->Write(3, b.data()).ok());
  auto back = ReadBack(f.params.get(), 3, 50000);
  REQUIRE(back.ok());
  CHECK(*back == b);
}

// Units of one piece each (8192 bytes at most, some padded) and the unit each read of the file
// was for, recorded by the I/O threads; Invalidate() waits for every read, so a check after it
// sees them all.
struct OnePieceUnits {
  static constexpr int kUnits = 8;
  absl::Mutex mu;
  std::vector<int> reads ABSL_GUARDED_BY(mu);
  std::vector<std::vector<char>> data;
  Fixture f;

  OnePieceUnits()
      : f(4, 8192, 0, Sizes(), [this](IoOp op, const std::string&, int64_t offset, int64_t) {
          if (op == IoOp::kRead && (offset - 8192) % 8192 == 0) {  // a piece is 2 blocks
            absl::MutexLock lock(&mu);
            reads.push_back(static_cast<int>((offset - 8192) / 8192));
          }
          return std::optional<int>();
        }) {
    for (int u = 0; u < kUnits; ++u) {
      data.push_back(Pattern(f.shards[u], 40 + u));
      REQUIRE(f.params->Write(u, data[u].data()).ok());
    }
    f.params->Invalidate();
  }
  static std::vector<int64_t> Sizes() {
    std::vector<int64_t> s;
    for (int u = 0; u < kUnits; ++u) s.push_back(8192 - 1000 * (u % 3));
    return s;
  }
  // The units read since the last call, sorted (after waiting for every read in flight).
  std::vector<int> TakeReads() {
    f.params->Invalidate();
    absl::MutexLock lock(&mu);
    std::vector<int> r = std::move(reads);
    reads.clear();
    std::sort(r.begin(), r.end());
    return r;
  }
  void ReadChecked(int u) {
    auto back = ReadBack(f.params.get(), u, f.shards[u]);
    REQUIRE(back.ok());
    CHECK(*back == data[u]);
  }
};

TEST_CASE("NvmeParams: read-ahead fills every free buffer, in either direction", "[nvme]") {
  for (int d : {1, -1}) {
    OnePieceUnits t;
    const int first = d > 0 ? 0 : OnePieceUnits::kUnits - 1;
    t.ReadChecked(first);
    t.f.params->ReadAhead(first + d, d);
    // The unit read, then the next 4 in the gather direction (one per buffer), nothing more.
    std::vector<int> want;
    for (int k = 0; k < 5; ++k) want.push_back(first + k * d);
    std::sort(want.begin(), want.end());
    CHECK(t.TakeReads() == want);
    CHECK(t.f.params->reads_ahead_used() == 0);
    // A whole pass as the gatherer makes it: every unit after the first is found read ahead,
    // and each is read from the file exactly once.
    for (int k = 0; k < OnePieceUnits::kUnits; ++k) {
      const int u = first + k * d;
      t.ReadChecked(u);
      if (k + 1 < OnePieceUnits::kUnits) t.f.params->ReadAhead(u + d, d);
    }
    CHECK(t.f.params->reads_ahead_used() == OnePieceUnits::kUnits - 1);
    CHECK(t.TakeReads() == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  }
}

TEST_CASE("NvmeParams: a read-ahead never evicts a nearer one", "[nvme]") {
  OnePieceUnits t;
  t.f.params->ReadAhead(2, 1);  // 2, 3, 4, 5
  t.f.params->ReadAhead(2, 1);  // 6 ranks after all of them: nothing
  t.f.params->ReadAhead(1, 1);  // 1 is nearer than 5: 5 gives way, nothing else
  CHECK(t.TakeReads() == std::vector<int>{1, 2, 3, 4, 5});
  t.f.params->ReadAhead(2, 1);
  t.f.params->ReadAhead(1, 1);
  for (int u = 1; u <= 4; ++u) t.ReadChecked(u);
  CHECK(t.f.params->reads_ahead_used() == 4);
  t.TakeReads();
  // Turning round: the units behind the new position give way first.
  t.f.params->ReadAhead(1, 1);  // 1, 2, 3, 4
  t.f.params->ReadAhead(3, -1);  // 3, 2, 1 held; 0 takes 4's buffer
  CHECK(t.TakeReads() == std::vector<int>{0, 1, 2, 3, 4});
  t.f.params->ReadAhead(1, 1);
  t.f.params->ReadAhead(3, -1);
  for (int u = 3; u >= 0; --u) t.ReadChecked(u);
  CHECK(t.f.params->reads_ahead_used() == 8);
}

TEST_CASE("NvmeParams: a write of a unit read ahead drops it", "[nvme]") {
  OnePieceUnits t;
  t.ReadChecked(0);
  t.f.params->ReadAhead(1, 1);  // 1..4 read ahead with the old bytes
  t.data[2] = Pattern(t.f.shards[2], 99);
  REQUIRE(t.f.params->Write(2, t.data[2].data()).ok());  // its bytes stay in a buffer too
  for (int u = 1; u < OnePieceUnits::kUnits; ++u) {
    t.ReadChecked(u);
    if (u + 1 < OnePieceUnits::kUnits) t.f.params->ReadAhead(u + 1, 1);
  }
}

TEST_CASE("NvmeParams: an I/O error names the file and offset", "[nvme]") {
  Fixture f(2, 0);
  const std::vector<char> d = Pattern(50000, 3);
  REQUIRE(f.params->Write(3, d.data()).ok());
  f.params->Invalidate();
  // Unit 3 starts at 12288 + 12288 = 24576; its second piece at 32768.
  SetIoFaultForTesting([](IoOp op, const std::string&, int64_t offset, int64_t) {
    return op == IoOp::kRead && offset == 32768 ? std::optional<int>(-EIO) : std::nullopt;
  });
  Fixture g(2, 0, 1);
  SetIoFaultForTesting(nullptr);
  REQUIRE(g.params->Write(3, d.data()).ok());
  g.params->Invalidate();
  auto back = ReadBack(g.params.get(), 3, 50000);
  REQUIRE_FALSE(back.ok());
  const std::string msg(back.status().message());
  CHECK(msg.find(g.file->path()) != std::string::npos);
  CHECK(msg.find("offset 32768") != std::string::npos);
  // The other file (created before the hook) is unaffected.
  auto ok = ReadBack(f.params.get(), 3, 50000);
  REQUIRE(ok.ok());
  CHECK(*ok == d);
}

TEST_CASE("NvmeParams: WriteFrom fills the pieces in order in aligned buffers; a fill error "
          "stops the write there",
          "[nvme]") {
  Fixture f(2);
  const std::vector<char> a = Pattern(50000, 5), b = Pattern(50000, 6);
  std::vector<int64_t> offsets, sizes;
  auto fill_from = [&](const std::vector<char>& src, int64_t fail_at) {
    return [&src, fail_at, &offsets, &sizes](int64_t offset, char* buffer, int64_t bytes) {
      if (offset == fail_at) return absl::DataLossError("device copy failed");
      offsets.push_back(offset);
      sizes.push_back(bytes);
      if (reinterpret_cast<uintptr_t>(buffer) % kIoAlignment != 0) {
        return absl::InternalError("unaligned buffer");
      }
      std::memcpy(buffer, src.data() + offset, static_cast<size_t>(bytes));
      return absl::OkStatus();
    };
  };
  REQUIRE(f.params->WriteFrom(3, fill_from(a, -1)).ok());
  CHECK(offsets == std::vector<int64_t>({0, 8192, 16384, 24576, 32768, 40960, 49152}));
  CHECK(sizes == std::vector<int64_t>({8192, 8192, 8192, 8192, 8192, 8192, 848}));
  f.params->Invalidate();
  auto back = ReadBack(f.params.get(), 3, 50000);
  REQUIRE(back.ok());
  CHECK(*back == a);
  // The fill of the third piece fails: its error comes back as is, nothing after it is filled,
  // the two pieces before it are on the file and no buffer claims the unit.
  offsets.clear();
  const absl::Status failed = f.params->WriteFrom(3, fill_from(b, 16384));
  CHECK(failed.code() == absl::StatusCode::kDataLoss);
  CHECK(failed.message() == "device copy failed");
  CHECK(offsets == std::vector<int64_t>({0, 8192}));
  back = ReadBack(f.params.get(), 3, 50000);
  REQUIRE(back.ok());
  CHECK(std::equal(back->begin(), back->begin() + 16384, b.begin()));
  CHECK(std::equal(back->begin() + 16384, back->end(), a.begin() + 16384));
}

}  // namespace
}  // namespace nvme
}  // namespace zerort
