// The safetensors file format (Hugging Face): an 8-byte little-endian header length, a JSON header
// mapping each tensor name to {dtype, shape, data_offsets}, then the raw little-endian data.
// Reading maps the file and checks every offset against the file size, so a truncated or corrupt
// file is an error naming the file and tensor, never an out-of-bounds read.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/json.h"
#include "core/tensor.h"

namespace marrow {

struct SafetensorsEntry {
  std::string name;
  Tensor tensor;  // host memory; dtype f32, bf16, i32 or i64
};

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // A read-only host view of the named tensor; an Error names the file if it is absent.
  Tensor get(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, Tensor> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace marrow
