#include "comm/internal/reduce.h"

#include <cstdint>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace comm {
namespace internal {
namespace {

// The contract spelled out one element at a time, independently of reduce.cc's chunking.
float ToF(const std::vector<uint32_t>& v, size_t i, DType t) {
  if (t == DType::kF32) return BitsToFloat(v[i]);
  if (t == DType::kBF16) return Bf16ToFloat(static_cast<uint16_t>(v[i]));
  return HalfToFloat(static_cast<uint16_t>(v[i]));
}

uint32_t FromF(float f, DType t) {
  if (t == DType::kF32) return FloatBits(f);
  if (t == DType::kBF16) return FloatToBf16(f);
  return FloatToHalf(f);
}

std::vector<uint32_t> Reference(const std::vector<std::vector<uint32_t>>& in, DType t,
                                ReduceOp op) {
  std::vector<uint32_t> out(in[0].size());
  for (size_t i = 0; i < out.size(); ++i) {
    float acc = ToF(in[0], i, t);
    for (size_t r = 1; r < in.size(); ++r) {
      const float x = ToF(in[r], i, t);
      if (op == ReduceOp::kMax) {
        // Documented tie rule: equal values (including +0 / -0) take the later rank's value.
        if (std::isnan(acc)) continue;
        if (std::isnan(x) || x >= acc) acc = x;
      } else {
        acc = acc + x;
      }
    }
    if (op == ReduceOp::kAvg) acc = acc / static_cast<float>(in.size());
    if (std::isnan(acc)) {
      out[i] = t == DType::kF32 ? 0x7fc00000u : (t == DType::kBF16 ? 0x7fc0u : 0x7e00u);
    } else {
      out[i] = FromF(acc, t);
    }
  }
  return out;
}

// Packs 32-bit "values" into the dtype's storage.
std::vector<char> Pack(const std::vector<uint32_t>& v, DType t) {
  std::vector<char> out(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

std::vector<uint32_t> Unpack(const std::vector<char>& b, DType t) {
  std::vector<uint32_t> out(b.size() / DTypeSize(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(&out[i], b.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      out[i] = h;
    }
  }
  return out;
}

// Mostly ordinary numbers, with a sprinkling of NaN, inf, zeros of both signs and subnormals
// (the cases where SIMD conversions most easily diverge from the scalar reference).
uint32_t RandomValue(std::mt19937& rng, DType t) {
  std::uniform_int_distribution<int> kind(0, 19);
  std::uniform_real_distribution<float> real(-4.0f, 4.0f);
  std::uniform_int_distribution<uint32_t> bits;
  switch (kind(rng)) {
    case 0:
      return t == DType::kF32 ? 0x7fc00001u : (t == DType::kBF16 ? 0x7fc1u : 0x7e01u);
    case 1:
      return t == DType::kF32 ? 0xff800000u : (t == DType::kBF16 ? 0xff80u : 0xfc00u);
    case 2:
      return t == DType::kF32 ? 0x80000000u : 0x8000u;
    case 3:
      return t == DType::kF32 ? (bits(rng) & 0x807fffffu) : (bits(rng) & 0x80ffu);  // subnormal
    case 4:
      return t == DType::kF32 ? bits(rng) : (bits(rng) & 0xffffu);  // any bit pattern
    default:
      return FromF(real(rng), t);
  }
}

TEST_CASE("Reduce: scalar path matches the element-by-element contract", "[comm]") {
  std::mt19937 rng(7);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (int n : {1, 2, 3, 5, 8}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1031}, size_t{2053}}) {
          std::vector<std::vector<uint32_t>> in(n, std::vector<uint32_t>(count));
          std::vector<std::vector<char>> packed;
          std::vector<const void*> srcs;
          for (auto& v : in) {
            for (auto& x : v) x = RandomValue(rng, t);
            packed.push_back(Pack(v, t));
          }
          for (auto& p : packed) srcs.push_back(p.data());
          std::vector<char> out(count * DTypeSize(t));
          ReduceBlocksWith(ReducePath::kScalar, false, srcs.data(), n, out.data(), count, t, op);
          INFO("dtype " << DTypeName(t) << " op " << ReduceOpName(op) << " n " << n
                        << " count " << count);
          CHECK(Unpack(out, t) == Reference(in, t, op));
        }
      }
    }
  }
}

TEST_CASE("Reduce: every SIMD path is bitwise identical to the scalar path", "[comm]") {
  std::mt19937 rng(11);
  int compared = 0;
  for (ReducePath path : {ReducePath::kAvx2, ReducePath::kAvx512}) {
    if (!ReducePathSupported(path)) {
      WARN("SKIPPED: this CPU lacks the " << ReducePathName(path) << " path");
      continue;
    }
    for (bool stream : {false, true}) {
      for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          for (int n : {1, 2, 4, 7}) {
            // Odd counts and a destination one element off a 64-byte boundary exercise the
            // masked tail and the unaligned head before the streamed body.
            for (size_t count : {size_t{1}, size_t{8}, size_t{13}, size_t{31}, size_t{1024},
                                 size_t{4099}}) {
              for (size_t dst_offset : {size_t{0}, size_t{1}}) {
                std::vector<std::vector<char>> packed;
                std::vector<const void*> srcs;
                for (int r = 0; r < n; ++r) {
                  std::vector<uint32_t> v(count);
                  for (auto& x : v) x = RandomValue(rng, t);
                  packed.push_back(Pack(v, t));
                }
                for (auto& p : packed) srcs.push_back(p.data());
                const size_t es = DTypeSize(t);
                // 64-byte aligned storage, so dst_offset decides the alignment.
                std::vector<uint64_t> storage((count + 1) * es / 8 + 16);
                char* base = reinterpret_cast<char*>(storage.data());
                base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
                char* simd = base + dst_offset * es;
                std::vector<char> scalar(count * es);
                ReduceBlocksWith(path, stream, srcs.data(), n, simd, count, t, op);
                ReduceBlocksWith(ReducePath::kScalar, false, srcs.data(), n, scalar.data(),
                                 count, t, op);
                INFO("path " << ReducePathName(path) << " stream " << stream << " dtype "
                             << DTypeName(t) << " op " << ReduceOpName(op) << " n " << n
                             << " count " << count << " dst offset " << dst_offset);
                CHECK(std::memcmp(simd, scalar.data(), scalar.size()) == 0);
                ++compared;
              }
            }
          }
        }
      }
    }
  }
  if (compared == 0) WARN("SKIPPED: no SIMD path on this CPU; ReduceBlocks is the scalar path");
}

TEST_CASE("Reduce: ReduceBlocks dispatches to the best supported path", "[comm]") {
  const ReducePath best = ReduceBestPath();
  CHECK(ReducePathSupported(best));
  if (ReducePathSupported(ReducePath::kAvx512)) CHECK(best == ReducePath::kAvx512);
  // Large enough to take the streaming branch; compared with the scalar path.
  const size_t count = kStreamMinBytes / 2 + 37;
  std::mt19937 rng(5);
  for (DType t : {DType::kF32, DType::kBF16}) {
    std::vector<std::vector<char>> packed;
    std::vector<const void*> srcs;
    for (int r = 0; r < 3; ++r) {
      std::vector<uint32_t> v(count);
      for (auto& x : v) x = RandomValue(rng, t);
      packed.push_back(Pack(v, t));
    }
    for (auto& p : packed) srcs.push_back(p.data());
    std::vector<char> fast(count * DTypeSize(t)), scalar(fast.size());
    ReduceBlocks(srcs.data(), 3, fast.data(), count, t, ReduceOp::kSum);
    ReduceBlocksWith(ReducePath::kScalar, false, srcs.data(), 3, scalar.data(), count, t,
                     ReduceOp::kSum);
    INFO("dtype " << DTypeName(t));
    CHECK(fast == scalar);
  }
}

TEST_CASE("Reduce: in place on one source gives the same bits as out of place", "[comm]") {
  std::mt19937 rng(3);
  const size_t count = 1500;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<std::vector<char>> packed;
    for (int r = 0; r < 3; ++r) {
      std::vector<uint32_t> v(count);
      for (auto& x : v) x = RandomValue(rng, t);
      packed.push_back(Pack(v, t));
    }
    std::vector<const void*> srcs = {packed[0].data(), packed[1].data(), packed[2].data()};
    std::vector<char> out(count * DTypeSize(t));
    ReduceBlocks(srcs.data(), 3, out.data(), count, t, ReduceOp::kSum);
    ReduceBlocks(srcs.data(), 3, packed[1].data(), count, t, ReduceOp::kSum);
    CHECK(packed[1] == out);
  }
}

}  // namespace
}  // namespace internal
}  // namespace comm
}  // namespace zerort
