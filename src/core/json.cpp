#include "core/json.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace marrow {

Json read_json_file(const std::string& path) {
  std::error_code ec;
  MARROW_CHECK(!std::filesystem::is_directory(path, ec), "{} is a directory where a JSON file was expected", path);
  std::ifstream in(path);
  MARROW_CHECK(in.good(), "cannot open {}: no such file or it is not readable", path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return Json::parse(text.str());
  } catch (const Json::parse_error& e) {
    fail("{} is not valid JSON: {}", path, e.what());
  }
}

void write_json_file(const std::string& path, const Json& value) {
  std::ofstream out(path);
  MARROW_CHECK(out.good(), "cannot write {}", path);
  out << value.dump(2) << "\n";
  out.flush();  // a full disk shows at the flush, not at <<
  MARROW_CHECK(out.good(), "error while writing {} (is the disk full?)", path);
}

JsonFields::JsonFields(const Json& object, std::string source) : object_(object), source_(std::move(source)) {
  MARROW_CHECK(object_.is_object(), "{}: expected a JSON object at the top level", source_);
}

const Json& JsonFields::raw(const std::string& key) const {
  MARROW_CHECK(has(key), "{}: required key '{}' is missing", source_, key);
  return object_[key];
}

int64_t JsonFields::integer(const std::string& key) const {
  const Json& v = raw(key);
  MARROW_CHECK(v.is_number_integer(), "{}: key '{}' must be an integer, got {}", source_, key, v.dump());
  return v.get<int64_t>();
}

int64_t JsonFields::positive(const std::string& key) const {
  const Json& v = raw(key);
  MARROW_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, "{}: key '{}' must be a positive integer, got {}", source_, key,
               v.dump());
  return v.get<int64_t>();
}

double JsonFields::number(const std::string& key) const {
  const Json& v = raw(key);
  MARROW_CHECK(v.is_number(), "{}: key '{}' must be a number, got {}", source_, key, v.dump());
  return v.get<double>();
}

bool JsonFields::boolean(const std::string& key) const {
  const Json& v = raw(key);
  MARROW_CHECK(v.is_boolean(), "{}: key '{}' must be true or false, got {}", source_, key, v.dump());
  return v.get<bool>();
}

std::string JsonFields::string(const std::string& key) const {
  const Json& v = raw(key);
  MARROW_CHECK(v.is_string(), "{}: key '{}' must be a string, got {}", source_, key, v.dump());
  return v.get<std::string>();
}

}  // namespace marrow
