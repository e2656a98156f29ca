// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TensorFlow's record files
// (engine/event_file.h), and its "masked" form, which those files store so that a CRC computed
// over data that itself holds CRCs stays well distributed. crc32c("123456789") = 0xE3069283.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace marrow {

// The CRC-32C of size bytes; crc continues a checksum of earlier bytes (0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
inline uint32_t crc32c(std::string_view bytes) { return crc32c(bytes.data(), bytes.size()); }

// TensorFlow's mask: rotate right by 15 bits, add a constant.
inline uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace marrow
