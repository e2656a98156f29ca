#include "engine/event_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/crc32c.h"
#include "core/errors.h"

namespace fs = std::filesystem;

namespace marrow {
namespace {

// Protobuf wire types (https://protobuf.dev/programming-guides/encoding/).
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };
constexpr uint64_t kDtString = 7;  // tensorflow.DataType DT_STRING

void put_varint(std::string& out, uint64_t value) {
  for (; value >= 0x80; value >>= 7) out += char(0x80 | (value & 0x7f));
  out += char(value);
}

void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, uint64_t(field) << 3 | wire); }

void put_little_endian(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out += char((value >> (8 * i)) & 0xff);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, uint32_t field, double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed64);
  put_little_endian(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed32);
  put_little_endian(out, bits, 4);
}

// Event{wall_time, step} with a summary (field 5) of the given encoded Summary.Value messages.
std::string summary_event(double wall_time, int64_t step, const std::vector<std::string>& values) {
  std::string summary, event;
  for (const std::string& value : values) put_bytes(summary, 1, value);
  put_double(event, 1, wall_time);
  put_key(event, 2, kVarint);
  put_varint(event, uint64_t(step));
  put_bytes(event, 5, summary);
  return event;
}

uint64_t read_little_endian(const char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t(uint8_t(p[i])) << (8 * i);
  return value;
}

// Reads a varint at event[at], advancing at; false when the bytes end first.
bool get_varint(std::string_view event, size_t& at, uint64_t& value) {
  value = 0;
  for (int shift = 0; at < event.size() && shift < 64; shift += 7) {
    const auto byte = uint8_t(event[at++]);
    value |= uint64_t(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MARROW_CHECK(in.good(), "cannot open {}: {}", path, std::strerror(errno));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  MARROW_CHECK(!in.bad(), "cannot read {}", path);
  return bytes.str();
}

}  // namespace

std::string file_version_event(double wall_time) {
  std::string event;
  put_double(event, 1, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  std::vector<std::string> values;
  for (const auto& [tag, number] : scalars) {
    std::string value;
    put_bytes(value, 1, tag);
    put_float(value, 2, number);
    values.push_back(std::move(value));
  }
  return summary_event(wall_time, step, values);
}

std::string text_event(double wall_time, int64_t step, const std::string& tag, std::string_view markdown) {
  std::string plugin_data, metadata, tensor, value;
  put_bytes(plugin_data, 1, "text");
  put_bytes(metadata, 1, plugin_data);
  put_key(tensor, 1, kVarint);
  put_varint(tensor, kDtString);
  put_bytes(tensor, 2, "");  // TensorShapeProto with no dimensions: a scalar
  put_bytes(tensor, 8, markdown);
  put_bytes(value, 1, tag);
  put_bytes(value, 9, metadata);
  put_bytes(value, 8, tensor);
  return summary_event(wall_time, step, {value});
}

int64_t event_step(std::string_view event, const std::string& where) {
  int64_t step = 0;
  for (size_t at = 0; at < event.size();) {
    uint64_t key = 0, value = 0;
    bool ok = get_varint(event, at, key);
    switch (key & 7) {
      case kVarint: ok = ok && get_varint(event, at, value); break;
      case kFixed64: at += 8; break;
      case kFixed32: at += 4; break;
      case kLengthDelimited: ok = ok && get_varint(event, at, value) && value <= event.size(); at += value; break;
      default: ok = false;
    }
    MARROW_CHECK(ok && at <= event.size(), "{} holds a record that is not a TensorBoard Event", where);
    if (key == (uint64_t(2) << 3 | kVarint)) step = int64_t(value);
  }
  return step;
}

EventFileWriter::EventFileWriter(std::string path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "wb");
  MARROW_CHECK(file_ != nullptr, "cannot create {}: {}", path_, std::strerror(errno));
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::write(std::string_view event) {
  MARROW_CHECK(file_ != nullptr, "internal: {} was written after it was closed", path_);
  std::string record;
  put_little_endian(record, event.size(), 8);
  put_little_endian(record, masked_crc32c(record.data(), 8), 4);
  record += event;
  put_little_endian(record, masked_crc32c(event.data(), event.size()), 4);
  const bool written = std::fwrite(record.data(), 1, record.size(), file_) == record.size() && std::fflush(file_) == 0;
  MARROW_CHECK(written, "cannot write {}: {}", path_, std::strerror(errno));
}

void EventFileWriter::close() {
  std::FILE* file = file_;
  file_ = nullptr;
  MARROW_CHECK(file && std::fclose(file) == 0, "cannot write {}: {}", path_, std::strerror(errno));
}

EventRecords read_event_file(const std::string& path) {
  const std::string bytes = read_whole_file(path);
  EventRecords out;
  size_t at = 0;
  while (at + 12 <= bytes.size()) {
    const uint64_t length = read_little_endian(bytes.data() + at, 8);
    if (uint32_t(read_little_endian(bytes.data() + at + 8, 4)) != masked_crc32c(bytes.data() + at, 8)) {
      std::fprintf(stderr, "warning: %s is damaged at byte %zu (its length's checksum is wrong); the events after it are dropped\n",
                   path.c_str(), at);
      break;
    }
    if (length > bytes.size() - at - 12 || bytes.size() - at - 12 - length < 4) break;  // cut short by a killed writer
    const std::string_view event(bytes.data() + at + 12, length);
    if (uint32_t(read_little_endian(event.data() + length, 4)) != masked_crc32c(event.data(), length)) {
      std::fprintf(stderr, "warning: %s is damaged at byte %zu (an event's checksum is wrong); the events after it are dropped\n",
                   path.c_str(), at);
      break;
    }
    out.events.emplace_back(event);
    at += 12 + length + 4;
  }
  out.whole = at == bytes.size();
  return out;
}

void keep_events_through(const std::string& path, int64_t step) {
  const EventRecords records = read_event_file(path);
  std::vector<const std::string*> kept;
  for (const std::string& event : records.events)
    if (event_step(event, path) <= step) kept.push_back(&event);
  if (records.whole && kept.size() == records.events.size()) return;
  {
    EventFileWriter out(path + ".tmp");
    for (const std::string* event : kept) out.write(*event);
    out.close();
  }
  std::error_code ec;
  fs::rename(path + ".tmp", path, ec);
  MARROW_CHECK(!ec, "cannot rename {}.tmp to {}: {}", path, path, ec.message());
}

}  // namespace marrow
