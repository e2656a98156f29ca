#include "data/token_corpus.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/errors.h"
#include "core/json.h"

namespace marrow {
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "shards are little-endian uint32 and are written as in memory");

CorpusManifest read_manifest(const std::string& dir) {
  std::string path = (fs::path(dir) / kManifestFile).string();
  std::error_code ec;
  MARROW_CHECK(fs::exists(dir, ec), "{} is not a tokenized corpus: it does not exist{}", dir,
               fs::path(dir).is_relative() ? fmt::format(" (a relative path resolves against the working directory, {})", fs::current_path(ec).string()) : "");
  MARROW_CHECK(fs::exists(path), "{} is not a tokenized corpus: it has no {} (make one with 'marrow tokenize')", dir, kManifestFile);
  Json json = read_json_file(path);
  JsonFields fields(json, path);
  MARROW_CHECK(fields.string("format") == "marrow-token-corpus", "{}: format must be \"marrow-token-corpus\"", path);
  MARROW_CHECK(fields.integer("version") == 1, "{}: version {} is not one this build reads (1)", path, fields.integer("version"));
  MARROW_CHECK(fields.string("token_dtype") == "uint32", "{}: token_dtype must be \"uint32\"", path);
  CorpusManifest m;
  m.tokenizer_sha256 = fields.string("tokenizer_sha256");
  m.vocab_size = fields.positive("vocab_size");
  m.eos_id = int32_t(fields.integer("eos_id"));
  MARROW_CHECK(m.eos_id >= 0 && m.eos_id < m.vocab_size, "{}: eos_id {} is outside the vocabulary of {}", path, m.eos_id, m.vocab_size);
  m.eos_token = fields.string("eos_token", "");
  m.documents = fields.integer("documents");
  m.tokens = fields.integer("tokens");
  m.bad_lines = fields.integer("bad_lines", 0);
  m.loss_mask = fields.string("loss_mask", "");
  const Json& shards = fields.raw("shards");
  MARROW_CHECK(shards.is_array() && !shards.empty(), "{}: shards must be a non-empty array", path);
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    JsonFields shard(shards[i], fmt::format("{} shards[{}]", path, i));
    m.shards.push_back({shard.string("file"), shard.positive("tokens"), shard.integer("documents"), shard.string("sha256")});
    MARROW_CHECK(fs::path(m.shards.back().file).filename() == m.shards.back().file, "{}: shard file '{}' must be a plain file name",
                 path, m.shards.back().file);
    total += m.shards.back().tokens;
  }
  MARROW_CHECK(total == m.tokens, "{}: the shards hold {} tokens but the manifest says {}", path, total, m.tokens);
  if (json.contains("inputs") && json["inputs"].is_array())
    for (const Json& input : json["inputs"]) m.inputs.push_back(input.get<std::string>());
  return m;
}

void write_manifest(const std::string& dir, const CorpusManifest& m) {
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const ShardInfo& s : m.shards)
    shards.push_back({{"file", s.file}, {"tokens", s.tokens}, {"documents", s.documents}, {"sha256", s.sha256}});
  nlohmann::ordered_json json = {{"format", "marrow-token-corpus"},
                                 {"version", 1},
                                 {"token_dtype", "uint32"},
                                 {"tokenizer", kCorpusTokenizerFile},
                                 {"tokenizer_sha256", m.tokenizer_sha256},
                                 {"vocab_size", m.vocab_size},
                                 {"eos_id", m.eos_id},
                                 {"eos_token", m.eos_token},
                                 {"documents", m.documents},
                                 {"tokens", m.tokens},
                                 {"bad_lines", m.bad_lines},
                                 {"loss_mask", m.loss_mask},
                                 {"inputs", m.inputs},
                                 {"shards", shards}};
  std::string path = (fs::path(dir) / kManifestFile).string();
  FILE* out = std::fopen(path.c_str(), "wb");
  MARROW_CHECK(out, "cannot write {}: {}", path, std::strerror(errno));
  std::string text = json.dump(2) + "\n";
  bool ok = std::fwrite(text.data(), 1, text.size(), out) == text.size();
  ok = std::fclose(out) == 0 && ok;
  MARROW_CHECK(ok, "cannot write {}: {}", path, std::strerror(errno));
}

ShardWriter::ShardWriter(std::string dir, int64_t shard_tokens) : dir_(std::move(dir)), shard_tokens_(shard_tokens) {
  MARROW_CHECK(shard_tokens > 0, "shard size must be positive, got {} tokens", shard_tokens);
  buffer_.reserve(size_t(1) << 20);
}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void ShardWriter::flush() {
  if (buffer_.empty()) return;
  hash_.update(buffer_.data(), buffer_.size() * sizeof(uint32_t));
  const char* bytes = reinterpret_cast<const char*>(buffer_.data());
  size_t left = buffer_.size() * sizeof(uint32_t);
  while (left > 0) {
    ssize_t wrote = ::write(fd_, bytes, left);
    if (wrote < 0 && errno == EINTR) continue;
    MARROW_CHECK(wrote > 0, "cannot write {}: {}", path_, std::strerror(errno));
    bytes += wrote;
    left -= size_t(wrote);
  }
  buffer_.clear();
}

void ShardWriter::close_shard() {
  if (fd_ < 0) return;
  flush();
  MARROW_CHECK(::close(fd_) == 0, "cannot close {}: {}", path_, std::strerror(errno));
  fd_ = -1;
  current_.sha256 = hash_.hex_digest();
  done_.push_back(current_);
}

void ShardWriter::append(std::span<const uint32_t> tokens) {
  while (!tokens.empty()) {
    if (fd_ >= 0 && current_.tokens == shard_tokens_) close_shard();
    if (fd_ < 0) {
      current_ = {fmt::format("shard-{:05d}.bin", done_.size()), 0, 0, ""};
      path_ = (fs::path(dir_) / current_.file).string();
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      MARROW_CHECK(fd_ >= 0, "cannot create {}: {}", path_, std::strerror(errno));
      hash_ = Sha256();
    }
    size_t take = size_t(std::min<int64_t>(int64_t(tokens.size()), shard_tokens_ - current_.tokens));
    buffer_.insert(buffer_.end(), tokens.begin(), tokens.begin() + take);
    if (buffer_.size() >= (size_t(1) << 20)) flush();
    current_.tokens += int64_t(take);
    tokens = tokens.subspan(take);
  }
}

void ShardWriter::end_document() {
  MARROW_CHECK(fd_ >= 0, "a document must end after at least one token");
  ++current_.documents;
}

std::vector<ShardInfo> ShardWriter::finish() {
  close_shard();
  return std::move(done_);
}

}  // namespace marrow
