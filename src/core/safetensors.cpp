#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace marrow {

namespace {

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::fp8_e4m3: return "F8_E4M3";
    case DType::u16: return "U16";
    case DType::u8: return "U8";
  }
  return "?";
}

bool parse_dtype(const std::string& s, DType& out) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::fp8_e4m3, DType::u16, DType::u8})
    if (s == safetensors_dtype(t)) {
      out = t;
      return true;
    }
  return false;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& e : entries) {
    expect_device("write_safetensors", e.name.c_str(), e.tensor, Device::cpu);
    std::vector<int64_t> shape(e.tensor.shape.begin(), e.tensor.shape.begin() + e.tensor.ndim);
    header[e.name] = {{"dtype", safetensors_dtype(e.tensor.dtype)}, {"shape", shape}, {"data_offsets", {offset, offset + e.tensor.bytes()}}};
    offset += e.tensor.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  MARROW_CHECK(out.good(), "cannot create {}", path);
  uint64_t n = text.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(text.data(), std::streamsize(text.size()));
  // nlohmann orders keys alphabetically, and data follows the order of the offsets given above.
  for (const auto& e : entries) out.write(static_cast<const char*>(e.tensor.data), std::streamsize(e.tensor.bytes()));
  out.flush();
  MARROW_CHECK(out.good(), "error while writing {} (disk full?)", path);
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  MARROW_CHECK(fd >= 0, "cannot open {}: {}", path, std::strerror(errno));
  struct stat st {};
  fstat(fd, &st);
  size_ = size_t(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    fail("{} is not a safetensors file: only {} bytes", path, size_);
  }
  map_ = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  MARROW_CHECK(map_ != MAP_FAILED, "cannot map {}: {}", path, std::strerror(errno));
  const char* base = static_cast<const char*>(map_);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  MARROW_CHECK(header_len <= size_ - 8, "{} is truncated or corrupt: header length {} exceeds the file size {}", path, header_len, size_);
  Json header;
  try {
    header = Json::parse(base + 8, base + 8 + header_len);
  } catch (const Json::parse_error& e) {
    fail("{} has a corrupt safetensors header: {}", path, e.what());
  }
  MARROW_CHECK(header.is_object(), "{} has a corrupt safetensors header: not a JSON object", path);
  const size_t data_start = 8 + header_len, data_size = size_ - data_start;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      for (auto& [k, v] : info.items())
        if (v.is_string()) metadata_[k] = v.get<std::string>();
      continue;
    }
    DType dtype;
    MARROW_CHECK(info.contains("dtype") && info["dtype"].is_string() && parse_dtype(info["dtype"].get<std::string>(), dtype),
                 "{}: tensor '{}' has an unsupported or missing dtype", path, name);
    const Json& shape = info.value("shape", Json());
    const Json& offsets = info.value("data_offsets", Json());
    MARROW_CHECK(shape.is_array() && shape.size() <= 4 && offsets.is_array() && offsets.size() == 2,
                 "{}: tensor '{}' has a malformed shape or data_offsets", path, name);
    Tensor t(nullptr, dtype, Device::cpu, {});
    t.ndim = int(shape.size());
    for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i].get<int64_t>();
    size_t begin = offsets[0].get<size_t>(), end = offsets[1].get<size_t>();
    MARROW_CHECK(begin <= end && end <= data_size, "{} is truncated or corrupt: tensor '{}' needs bytes [{}, {}) but the data holds {}",
                 path, name, begin, end, data_size);
    MARROW_CHECK(end - begin == t.bytes(), "{}: tensor '{}' has {} bytes for shape {} of {}", path, name, end - begin,
                 t.shape_string(), dtype_name(dtype));
    t.data = const_cast<char*>(base + data_start + begin);
    entries_[name] = t;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ && map_ != MAP_FAILED) munmap(map_, size_);
}

Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  MARROW_CHECK(it != entries_.end(), "{} has no tensor named '{}'", path_, name);
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (auto& [k, v] : entries_) out.push_back(k);
  return out;
}

}  // namespace marrow
