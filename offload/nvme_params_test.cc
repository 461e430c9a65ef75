#include "offload/nvme_params.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace offload {
namespace {

std::string DiskDir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

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

  explicit Fixture(int buffer_count, int64_t base = 8192, int rank = 0) {
    dir = *SwapDir::Create(DiskDir(), "params", rank);
    file = *dir->CreateFile("params", base + NvmeParams::FileBytes(shards));
    AioOptions o;
    o.block_size = 4096;
    o.queue_depth = 2;
    o.thread_count = 2;
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
    for (int round = 0; round < 2; ++round) {
      for (size_t u = 0; u < f.shards.size(); ++u) {
        if (round == 1 && u + 1 < f.shards.size()) f.params->ReadAhead(static_cast<int>(u) + 1);
        auto back = ReadBack(f.params.get(), static_cast<int>(u), f.shards[u]);
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
  f.params->ReadAhead(3);  // holds a's first pieces
  REQUIRE(f.params->Write(3, b.data()).ok());
  auto back = ReadBack(f.params.get(), 3, 50000);
  REQUIRE(back.ok());
  CHECK(*back == b);
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
}  // namespace offload
}  // namespace zerort
