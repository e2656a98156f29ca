#include "data/corpus_reader.h"

#include <fcntl.h>
#include <glob.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/errors.h"
#include "core/json.h"
#include "data/unicode.h"

namespace marrow {
namespace fs = std::filesystem;

namespace {

// The input kind a file name announces, or false when it is not one Marrow reads.
bool classify(const std::string& path, InputFile& file) {
  std::string name = fs::path(path).filename().string();
  file.path = path;
  file.zstd = false;
  for (const char* suffix : {".zst", ".zstd"}) {
    if (name.size() > std::strlen(suffix) && name.ends_with(suffix)) {
      name.resize(name.size() - std::strlen(suffix));
      file.zstd = true;
      break;
    }
  }
  if (name.ends_with(".jsonl")) {
    file.jsonl = true;
    return true;
  }
  file.jsonl = false;
  return name.ends_with(".txt");
}

constexpr const char* kKnownKinds = ".txt, .jsonl, .jsonl.zst or .jsonl.zstd";

}  // namespace

std::vector<InputFile> find_input_files(const std::vector<std::string>& specs) {
  std::vector<InputFile> files;
  std::set<std::string> seen;
  auto add = [&](const InputFile& file) {
    if (seen.insert(fs::weakly_canonical(file.path).string()).second) files.push_back(file);
  };
  for (const std::string& spec : specs) {
    std::error_code error;
    if (fs::is_directory(spec, error)) {
      std::vector<InputFile> found;
      for (auto it = fs::recursive_directory_iterator(spec, fs::directory_options::follow_directory_symlink, error);
           !error && it != fs::recursive_directory_iterator(); it.increment(error)) {
        InputFile file;
        if (it->is_regular_file() && classify(it->path().string(), file)) found.push_back(file);
      }
      MARROW_CHECK(!error, "cannot list directory {}: {}", spec, error.message());
      MARROW_CHECK(!found.empty(), "directory {} holds no {} files", spec, kKnownKinds);
      std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
      for (const InputFile& file : found) add(file);
      continue;
    }
    if (fs::exists(spec, error)) {
      InputFile file;
      MARROW_CHECK(classify(spec, file), "input {} is not a {} file", spec, kKnownKinds);
      add(file);
      continue;
    }
    glob_t matches{};
    int rc = ::glob(spec.c_str(), 0, nullptr, &matches);
    std::vector<std::string> paths(matches.gl_pathv, matches.gl_pathv + (rc == 0 ? matches.gl_pathc : 0));
    globfree(&matches);
    MARROW_CHECK(rc == 0 || rc == GLOB_NOMATCH, "glob({}) failed with code {}", spec, rc);
    MARROW_CHECK(!paths.empty(), "input {} does not exist and matches no files", spec);
    size_t accepted = 0;
    for (const std::string& path : paths) {
      InputFile file;
      if (fs::is_regular_file(path, error) && classify(path, file)) {
        add(file);
        ++accepted;
      }
    }
    MARROW_CHECK(accepted > 0, "input {} matches no {} files", spec, kKnownKinds);
  }
  return files;
}

struct ChunkReader::Zstd {
  ZSTD_DStream* stream = nullptr;
  std::vector<char> input = std::vector<char>(ZSTD_DStreamInSize());
  ZSTD_inBuffer in{nullptr, 0, 0};
  size_t last_result = 0;  // 0 once a frame is complete: a stream ending elsewhere is truncated
  bool input_done = false;
  Zstd() {
    stream = ZSTD_createDStream();
    if (!stream) fail_call(__FILE__, __LINE__, "ZSTD_createDStream", "out of memory");
  }
  ~Zstd() { ZSTD_freeDStream(stream); }
};

ChunkReader::ChunkReader(std::vector<InputFile> files, size_t chunk_bytes)
    : files_(std::move(files)), chunk_bytes_(chunk_bytes) {}

ChunkReader::~ChunkReader() { close_current(); }

void ChunkReader::open_current() {
  const InputFile& file = files_[current_];
  fd_ = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
  MARROW_CHECK(fd_ >= 0, "cannot open {}: {}", file.path, std::strerror(errno));
  at_end_of_file_ = false;
  next_line_ = 1;
  pending_.clear();
  if (file.zstd) {
    if (!zstd_) zstd_ = std::make_unique<Zstd>();
    size_t rc = ZSTD_initDStream(zstd_->stream);
    if (ZSTD_isError(rc)) fail_call(__FILE__, __LINE__, "ZSTD_initDStream", ZSTD_getErrorName(rc));
    zstd_->in = {zstd_->input.data(), 0, 0};
    zstd_->last_result = 0;
    zstd_->input_done = false;
  }
}

void ChunkReader::close_current() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool ChunkReader::fill() {
  const InputFile& file = files_[current_];
  auto read_some = [&](char* into, size_t size) {
    for (;;) {
      ssize_t got = ::read(fd_, into, size);
      if (got >= 0) return size_t(got);
      MARROW_CHECK(errno == EINTR, "cannot read {}: {}", file.path, std::strerror(errno));
    }
  };
  constexpr size_t kBlock = size_t(1) << 20;
  if (!file.zstd) {
    size_t old_size = pending_.size();
    pending_.resize(old_size + kBlock);
    size_t got = read_some(pending_.data() + old_size, kBlock);
    pending_.resize(old_size + got);
    bytes_read_ += got;
    return got > 0;
  }
  Zstd& z = *zstd_;
  for (;;) {
    if (z.in.pos == z.in.size && !z.input_done) {
      z.in.size = read_some(z.input.data(), z.input.size());
      z.in.pos = 0;
      z.input_done = z.in.size == 0;
    }
    if (z.input_done && z.in.pos == z.in.size) {
      MARROW_CHECK(z.last_result == 0, "{}: the zstd stream is truncated (the file ends inside a compressed frame)", file.path);
      return false;
    }
    size_t old_size = pending_.size();
    pending_.resize(old_size + kBlock);
    ZSTD_outBuffer out{pending_.data() + old_size, kBlock, 0};
    size_t rc = ZSTD_decompressStream(z.stream, &out, &z.in);
    pending_.resize(old_size + out.pos);
    MARROW_CHECK(!ZSTD_isError(rc), "{}: corrupt zstd data: {}", file.path, ZSTD_getErrorName(rc));
    z.last_result = rc;
    bytes_read_ += out.pos;
    if (out.pos > 0) return true;
  }
}

bool ChunkReader::next(TextChunk& chunk) {
  for (;;) {
    if (current_ >= files_.size()) return false;
    if (fd_ < 0) open_current();
    while (!at_end_of_file_ && pending_.size() < chunk_bytes_)
      if (!fill()) at_end_of_file_ = true;
    const InputFile& file = files_[current_];
    size_t cut = pending_.size();
    if (!at_end_of_file_) {
      // The last safe cut: after a newline, and for text before an ASCII letter or digit.
      cut = 0;
      for (size_t i = pending_.size(); i-- > 0;) {
        if (pending_[i] == '\n' && (file.jsonl || (i + 1 < pending_.size() && std::isalnum(uint8_t(pending_[i + 1]))))) {
          cut = i + 1;
          break;
        }
      }
      if (cut == 0) {
        // No safe cut yet (a very long line): read on until there is one or the file ends.
        if (!fill()) at_end_of_file_ = true;
        continue;
      }
    }
    chunk.file_index = current_;
    chunk.first_line = next_line_;
    chunk.bytes.assign(pending_, 0, cut);
    pending_.erase(0, cut);
    next_line_ += std::count(chunk.bytes.begin(), chunk.bytes.end(), '\n');
    chunk.ends_file = at_end_of_file_ && pending_.empty();
    if (chunk.ends_file) {
      close_current();
      ++current_;
    }
    return true;
  }
}

namespace {

using DocumentVisitor = std::function<void(std::string_view text, bool ends_document, bool no_loss)>;

std::string invalid_utf8_reason(size_t invalid) { return fmt::format("invalid UTF-8 at byte {} of the line", invalid + 1); }

// Plain text: the chunk is a piece of its file's one document; lines that are not UTF-8 are left out.
void chunk_text(const TextChunk& chunk, const DocumentVisitor& visit, std::vector<BadLine>& bad_lines) {
  std::string_view bytes = chunk.bytes;
  if (find_invalid_utf8(bytes) == std::string_view::npos) {
    visit(bytes, chunk.ends_file, false);
    return;
  }
  std::string valid;
  int64_t line = chunk.first_line;
  for (size_t start = 0; start < bytes.size(); ++line) {
    size_t end = bytes.find('\n', start);
    end = end == std::string_view::npos ? bytes.size() : end + 1;
    std::string_view text = bytes.substr(start, end - start);
    size_t invalid = find_invalid_utf8(text);
    if (invalid == std::string_view::npos) valid += text;
    else bad_lines.push_back({chunk.file_index, line, invalid_utf8_reason(invalid)});
    start = end;
  }
  visit(valid, chunk.ends_file, false);
}

// One JSONL line (no newline): visits the string of `field` as a whole document, or returns why the
// line is bad; a blank line is neither.
std::string visit_jsonl_line(std::string_view text, const std::string& field, const DocumentVisitor& visit, const std::string& no_loss_field) {
  if (text.ends_with('\r')) text.remove_suffix(1);
  if (text.find_first_not_of(" \t") == std::string_view::npos) return "";
  size_t invalid = find_invalid_utf8(text);
  if (invalid != std::string_view::npos) return invalid_utf8_reason(invalid);
  Json object;
  try {
    object = Json::parse(text);
  } catch (const Json::parse_error& e) {
    std::string what = e.what();
    size_t at = what.find("column");
    return "invalid JSON: " + (at == std::string::npos ? what : what.substr(at));
  }
  auto value = object.is_object() ? object.find(field) : object.end();
  if (!object.is_object() || value == object.end() || value->is_null()) return fmt::format("missing field '{}'", field);
  if (!value->is_string()) return fmt::format("field '{}' is not a string", field);
  const std::string& document = value->get_ref<const std::string&>();
  if (!no_loss_field.empty()) {
    auto prompt = object.find(no_loss_field);
    if (prompt == object.end() || !prompt->is_string()) return fmt::format("field '{}' is missing or not a string", no_loss_field);
    visit(prompt->get_ref<const std::string&>(), false, true);
  }
  if (!document.empty() || !no_loss_field.empty()) visit(document, true, false);
  return "";
}

}  // namespace

void chunk_documents(const InputFile& file, const TextChunk& chunk, const std::string& field, const DocumentVisitor& visit,
                     std::vector<BadLine>& bad_lines, const std::string& no_loss_field) {
  MARROW_CHECK(file.jsonl || no_loss_field.empty(), "{}: a loss mask (--loss-mask) needs JSONL inputs", file.path);
  if (!file.jsonl) return chunk_text(chunk, visit, bad_lines);
  std::string_view bytes = chunk.bytes;
  int64_t line = chunk.first_line;
  for (size_t start = 0; start < bytes.size(); ++line) {
    size_t end = bytes.find('\n', start);
    if (end == std::string_view::npos) end = bytes.size();
    std::string error = visit_jsonl_line(bytes.substr(start, end - start), field, visit, no_loss_field);
    if (!error.empty()) bad_lines.push_back({chunk.file_index, line, std::move(error)});
    start = end + 1;
  }
}

namespace {
constexpr int64_t kBadLinesShown = 20;
}  // namespace

void BadLineReport::skip(const std::vector<BadLine>& bad_lines) {
  for (const BadLine& bad : bad_lines) {
    const std::string where = fmt::format("{}:{}", files_[bad.file_index].path, bad.line);
    MARROW_CHECK(!strict_, "{}: {} (--strict stops at the first bad line)", where, bad.reason);
    if (++count_ <= kBadLinesShown)
      std::fprintf(stderr, "%swarning: %s: %s, line skipped\n", newline_first_ ? "\n" : "", where.c_str(), bad.reason.c_str());
  }
}

void BadLineReport::finish() const {
  if (count_ > kBadLinesShown)
    std::fprintf(stderr, "warning: %lld more bad lines were skipped\n", static_cast<long long>(count_ - kBadLinesShown));
}

}  // namespace marrow
