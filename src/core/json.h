// Reading JSON files whose every error is one sentence naming the file and the key:
// "configs/tiny.json: key 'num_experts' must be a positive integer, got -3".
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "core/errors.h"

namespace marrow {

using Json = nlohmann::json;

// Parses a whole JSON file; a missing or malformed file is an Error naming it.
Json read_json_file(const std::string& path);
void write_json_file(const std::string& path, const Json& value);

class JsonFields {
 public:
  JsonFields(const Json& object, std::string source);

  bool has(const std::string& key) const { return object_.contains(key) && !object_[key].is_null(); }
  int64_t integer(const std::string& key) const;
  int64_t integer(const std::string& key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  int64_t positive(const std::string& key) const;
  int64_t positive(const std::string& key, int64_t fallback) const { return has(key) ? positive(key) : fallback; }
  double number(const std::string& key) const;
  double number(const std::string& key, double fallback) const { return has(key) ? number(key) : fallback; }
  bool boolean(const std::string& key) const;
  bool boolean(const std::string& key, bool fallback) const { return has(key) ? boolean(key) : fallback; }
  std::string string(const std::string& key) const;
  std::string string(const std::string& key, const std::string& fallback) const { return has(key) ? string(key) : fallback; }
  const Json& raw(const std::string& key) const;
  const std::string& source() const { return source_; }

 private:
  const Json& object_;
  std::string source_;
};

}  // namespace marrow
