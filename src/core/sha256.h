// SHA-256 (FIPS 180-4), used to fingerprint tokenizer files and corpus shards in manifests so that
// a training run can prove it reads the bytes the tokenizer wrote.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace marrow {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }
  // Lowercase hex of the digest; the object must not be updated afterwards.
  std::string hex_digest();

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> pending_;
  size_t pending_size_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view bytes);
// Digest of a whole file, read in large blocks; an unreadable file is an Error naming it.
std::string sha256_file(const std::string& path);

}  // namespace marrow
