// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the one checksum of the project (checkpoint files, peer agreement): the
// SSE4.2 crc32 instruction where the CPU has it, slice-by-8 tables otherwise. Both give the
// same values; the test checks them against a bitwise reference and the standard check value
// crc32c("123456789") = 0xE3069283.
//
// Thread safety: pure functions.
#ifndef ZERORT_BASE_CRC32C_H_
#define ZERORT_BASE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace zerort {

// Extends `crc` (0 for an empty prefix) with `n` bytes: Crc32c(Crc32c(0, a), b) == Crc32c(0, ab).
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);
// The table path, whatever the CPU (for tests).
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);

}  // namespace zerort

#endif  // ZERORT_BASE_CRC32C_H_
