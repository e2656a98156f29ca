#include "data/token_corpus.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/errors.h"
#include "core/json.h"
#include "data/chunk_pipeline.h"
#include "data/tokenizer.h"

namespace marrow {
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "shards are little-endian uint32 and are written as in memory");

CorpusManifest read_manifest(const std::string& dir) {
  std::string path = (fs::path(dir) / kManifestFile).string();
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

namespace {

// Removes a directory only when it holds nothing but what `marrow tokenize` writes, so a mistyped
// --out never deletes the user's files.
void remove_corpus_directory(const std::string& dir, bool check_only = false) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    bool ours = entry.is_regular_file() &&
                (name == kManifestFile || name == kCorpusTokenizerFile || (name.starts_with("shard-") && name.ends_with(".bin")));
    MARROW_CHECK(ours, "{} holds {}, which 'marrow tokenize' did not write; remove the directory yourself or choose another --out",
                 dir, name);
  }
  if (check_only) return;
  std::error_code error;
  fs::remove_all(dir, error);
  MARROW_CHECK(!error, "cannot remove {}: {}", dir, error.message());
}

struct ChunkTokens {
  std::vector<uint32_t> tokens;
  std::vector<size_t> document_ends;  // offsets into tokens
  std::vector<BadLine> bad_lines;
  uint64_t bytes = 0;
};

std::string format_count(double value) {
  if (value >= 1e9) return fmt::format("{:.2f}G", value / 1e9);
  if (value >= 1e6) return fmt::format("{:.2f}M", value / 1e6);
  if (value >= 1e3) return fmt::format("{:.1f}k", value / 1e3);
  return fmt::format("{:.0f}", value);
}

}  // namespace

TokenizeReport tokenize_corpus(const TokenizeOptions& options) {
  auto start = std::chrono::steady_clock::now();
  MARROW_CHECK(options.threads >= 1, "--threads must be at least 1, got {}", options.threads);
  MARROW_CHECK(!options.out_dir.empty(), "an output directory is needed (--out)");
  std::string out_dir = fs::path(options.out_dir).lexically_normal().string();
  if (out_dir.size() > 1 && out_dir.ends_with('/')) out_dir.pop_back();
  if (fs::exists(out_dir)) {
    MARROW_CHECK(options.overwrite, "output directory {} already exists; pass --overwrite to replace it", out_dir);
    MARROW_CHECK(fs::is_directory(out_dir), "output {} exists and is not a directory", out_dir);
    remove_corpus_directory(out_dir, true);
  }
  std::vector<InputFile> files = find_input_files(options.inputs);
  MARROW_CHECK(!files.empty(), "no input files were given");
  Tokenizer tokenizer = Tokenizer::load(options.tokenizer_path);
  std::optional<int32_t> eos = tokenizer.token_id(options.eos_token);
  MARROW_CHECK(eos.has_value(), "tokenizer {} has no token '{}' to end documents with; name one with --eos-token",
               options.tokenizer_path, options.eos_token);

  std::string work_dir = out_dir + ".incomplete";
  if (fs::exists(work_dir)) remove_corpus_directory(work_dir);
  std::error_code error;
  fs::create_directories(work_dir, error);
  MARROW_CHECK(!error, "cannot create {}: {}", work_dir, error.message());
  struct RemoveOnFailure {
    std::string dir;
    bool keep = false;
    ~RemoveOnFailure() {
      std::error_code ignored;
      if (!keep) fs::remove_all(dir, ignored);
    }
  } cleanup{work_dir};

  CorpusManifest manifest;
  manifest.tokenizer_sha256 = sha256_file(options.tokenizer_path);
  fs::copy_file(options.tokenizer_path, fs::path(work_dir) / kCorpusTokenizerFile, error);
  MARROW_CHECK(!error, "cannot copy {} into {}: {}", options.tokenizer_path, work_dir, error.message());
  manifest.vocab_size = tokenizer.vocab_size();
  manifest.eos_id = *eos;
  manifest.eos_token = options.eos_token;
  for (const InputFile& file : files) manifest.inputs.push_back(file.path);

  ChunkReader reader(files, options.chunk_bytes);
  ShardWriter writer(work_dir, options.shard_tokens);
  std::vector<EncodeState> states(size_t(options.threads));
  const auto eos_token = uint32_t(*eos);
  int64_t open_document_tokens = 0, reported_bad_lines = 0;
  uint64_t text_bytes = 0;
  auto last_progress = start;
  bool tty = ::isatty(STDERR_FILENO);
  auto progress = [&](bool final) {
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "%stokenize: %s documents (%s/s), %.1f MB (%.1f MB/s), %s tokens, %lld bad lines%s",
                 tty ? "\r" : "", format_count(double(manifest.documents)).c_str(),
                 format_count(manifest.documents / std::max(seconds, 1e-9)).c_str(), text_bytes / 1e6,
                 text_bytes / 1e6 / std::max(seconds, 1e-9), format_count(double(manifest.tokens)).c_str(),
                 static_cast<long long>(manifest.bad_lines), final || !tty ? "\n" : "");
  };

  auto work = [&](const TextChunk& chunk, int worker) {
    ChunkTokens out;
    out.bytes = chunk.bytes.size();
    std::vector<int32_t> ids;
    chunk_documents(files[chunk.file_index], chunk, options.field, [&](std::string_view text, bool ends_document) {
      ids.clear();
      tokenizer.encode(text, ids, states[size_t(worker)]);
      out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
      if (ends_document) out.document_ends.push_back(out.tokens.size());
    }, out.bad_lines);
    return out;
  };
  auto consume = [&](ChunkTokens& result) {
    for (const BadLine& bad : result.bad_lines) {
      std::string where = fmt::format("{}:{}", files[bad.file_index].path, bad.line);
      MARROW_CHECK(!options.strict, "{}: {} (--strict stops at the first bad line)", where, bad.reason);
      ++manifest.bad_lines;
      if (++reported_bad_lines <= 20) std::fprintf(stderr, "%swarning: %s: %s, line skipped\n", tty && options.progress ? "\n" : "", where.c_str(), bad.reason.c_str());
    }
    size_t begin = 0;
    auto append = [&](size_t end) {
      writer.append(std::span<const uint32_t>(result.tokens).subspan(begin, end - begin));
      open_document_tokens += int64_t(end - begin);
      manifest.tokens += int64_t(end - begin);
      begin = end;
    };
    for (size_t end : result.document_ends) {
      append(end);
      if (open_document_tokens == 0) continue;
      writer.append(std::span<const uint32_t>(&eos_token, 1));
      writer.end_document();
      ++manifest.tokens;
      ++manifest.documents;
      open_document_tokens = 0;
    }
    append(result.tokens.size());
    text_bytes += result.bytes;
    auto now = std::chrono::steady_clock::now();
    if (options.progress && now - last_progress > std::chrono::seconds(tty ? 1 : 10)) {
      progress(false);
      last_progress = now;
    }
  };
  run_chunk_pipeline<ChunkTokens>(reader, options.threads, work, consume);

  if (reported_bad_lines > 20)
    std::fprintf(stderr, "warning: %lld more bad lines were skipped\n", static_cast<long long>(reported_bad_lines - 20));
  MARROW_CHECK(manifest.documents > 0, "the inputs ({} file{}) hold no documents{}", files.size(), files.size() == 1 ? "" : "s",
               manifest.bad_lines ? fmt::format(" ({} bad lines were skipped)", manifest.bad_lines) : "");
  manifest.shards = writer.finish();
  write_manifest(work_dir, manifest);
  if (options.progress) progress(true);
  if (fs::exists(out_dir)) remove_corpus_directory(out_dir);
  fs::rename(work_dir, out_dir, error);
  MARROW_CHECK(!error, "cannot rename {} to {}: {}", work_dir, out_dir, error.message());
  cleanup.keep = true;
  TokenizeReport report;
  report.manifest = std::move(manifest);
  report.text_bytes = text_bytes;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace marrow
