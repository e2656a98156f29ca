#include "data/tokenize_corpus.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/errors.h"
#include "data/chunk_pipeline.h"
#include "data/tokenizer.h"

namespace marrow {
namespace fs = std::filesystem;

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

// --out, normalised; an existing directory is replaced only with --overwrite, and only when it holds
// nothing but what `marrow tokenize` writes.
std::string checked_output_dir(const TokenizeOptions& options) {
  MARROW_CHECK(!options.out_dir.empty(), "an output directory is needed (--out)");
  std::string out_dir = fs::path(options.out_dir).lexically_normal().string();
  if (out_dir.size() > 1 && out_dir.ends_with('/')) out_dir.pop_back();
  if (fs::exists(out_dir)) {
    MARROW_CHECK(options.overwrite, "output directory {} already exists; pass --overwrite to replace it", out_dir);
    MARROW_CHECK(fs::is_directory(out_dir), "output {} exists and is not a directory", out_dir);
    remove_corpus_directory(out_dir, true);
  }
  return out_dir;
}

// <out>.incomplete, where the corpus is written: removed on failure, renamed to <out> when complete,
// so a crash never leaves a directory that looks like a corpus.
class WorkDirectory {
 public:
  explicit WorkDirectory(std::string dir) : dir_(std::move(dir)) {
    if (fs::exists(dir_)) remove_corpus_directory(dir_);
    std::error_code error;
    fs::create_directories(dir_, error);
    MARROW_CHECK(!error, "cannot create {}: {}", dir_, error.message());
  }
  WorkDirectory(const WorkDirectory&) = delete;
  WorkDirectory& operator=(const WorkDirectory&) = delete;
  ~WorkDirectory() {
    std::error_code ignored;
    if (!kept_) fs::remove_all(dir_, ignored);
  }
  const std::string& dir() const { return dir_; }
  // Replaces out_dir (what `marrow tokenize` wrote there) with this directory.
  void rename_to(const std::string& out_dir) {
    if (fs::exists(out_dir)) remove_corpus_directory(out_dir);
    std::error_code error;
    fs::rename(dir_, out_dir, error);
    MARROW_CHECK(!error, "cannot rename {} to {}: {}", dir_, out_dir, error.message());
    kept_ = true;
  }

 private:
  std::string dir_;
  bool kept_ = false;
};

// The manifest's header (tokenizer, its sha256, end-of-document token, inputs), with tokenizer.json
// copied into the corpus.
CorpusManifest start_manifest(const TokenizeOptions& options, const Tokenizer& tokenizer, int32_t eos, const std::vector<InputFile>& files,
                              const std::string& dir) {
  CorpusManifest manifest;
  manifest.tokenizer_sha256 = sha256_file(options.tokenizer_path);
  std::error_code error;
  fs::copy_file(options.tokenizer_path, fs::path(dir) / kCorpusTokenizerFile, error);
  MARROW_CHECK(!error, "cannot copy {} into {}: {}", options.tokenizer_path, dir, error.message());
  manifest.vocab_size = tokenizer.vocab_size();
  manifest.eos_id = eos;
  manifest.eos_token = options.eos_token;
  manifest.loss_mask = options.loss_mask;
  for (const InputFile& file : files) manifest.inputs.push_back(file.path);
  return manifest;
}

// Takes the chunks' tokens in input order into the shards: each document's tokens, then the
// end-of-document token (empty documents are dropped); counts documents, tokens and bad lines (the
// first 20 printed, --strict stops at one) and prints a progress line.
class CorpusSink {
 public:
  CorpusSink(const TokenizeOptions& options, const std::vector<InputFile>& files, const std::string& dir, CorpusManifest& manifest,
             uint32_t eos, std::chrono::steady_clock::time_point start)
      : options_(options), files_(files), writer_(dir, options.shard_tokens), manifest_(manifest), eos_(eos), start_(start),
        last_progress_(start), tty_(::isatty(STDERR_FILENO)), bad_lines_(files, options.strict, tty_ && options.progress) {}

  void consume(const ChunkTokens& result) {
    bad_lines_.skip(result.bad_lines);
    manifest_.bad_lines = bad_lines_.count();
    size_t begin = 0;
    for (size_t end : result.document_ends) {
      append(result.tokens, begin, end);
      begin = end;
      if (open_document_tokens_ > 0) end_document();
    }
    append(result.tokens, begin, result.tokens.size());
    text_bytes_ += result.bytes;
    const auto now = std::chrono::steady_clock::now();
    if (options_.progress && now - last_progress_ > std::chrono::seconds(tty_ ? 1 : 10)) {
      progress(false);
      last_progress_ = now;
    }
  }
  // After the last chunk: the shards' list into the manifest.
  void finish() {
    bad_lines_.finish();
    MARROW_CHECK(manifest_.documents > 0, "the inputs ({} file{}) hold no documents{}", files_.size(), files_.size() == 1 ? "" : "s",
                 manifest_.bad_lines ? fmt::format(" ({} bad lines were skipped)", manifest_.bad_lines) : "");
    manifest_.shards = writer_.finish();
    if (options_.progress) progress(true);
  }
  uint64_t text_bytes() const { return text_bytes_; }

 private:
  void append(const std::vector<uint32_t>& tokens, size_t begin, size_t end) {
    writer_.append(std::span<const uint32_t>(tokens).subspan(begin, end - begin));
    open_document_tokens_ += int64_t(end - begin);
    manifest_.tokens += int64_t(end - begin);
  }
  void end_document() {
    writer_.append(std::span<const uint32_t>(&eos_, 1));
    writer_.end_document();
    ++manifest_.tokens;
    ++manifest_.documents;
    open_document_tokens_ = 0;
  }
  void progress(bool final) const {
    const double seconds = std::max(std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(), 1e-9);
    std::fprintf(stderr, "%stokenize: %s documents (%s/s), %.1f MB (%.1f MB/s), %s tokens, %lld bad lines%s", tty_ ? "\r" : "",
                 format_count(double(manifest_.documents)).c_str(), format_count(manifest_.documents / seconds).c_str(),
                 text_bytes_ / 1e6, text_bytes_ / 1e6 / seconds, format_count(double(manifest_.tokens)).c_str(),
                 static_cast<long long>(manifest_.bad_lines), final || !tty_ ? "\n" : "");
  }

  const TokenizeOptions& options_;
  const std::vector<InputFile>& files_;
  ShardWriter writer_;
  CorpusManifest& manifest_;
  const uint32_t eos_;
  const std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_progress_;
  const bool tty_;
  BadLineReport bad_lines_;
  int64_t open_document_tokens_ = 0;
  uint64_t text_bytes_ = 0;
};

}  // namespace

TokenizeReport tokenize_corpus(const TokenizeOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  check_pipeline_threads(options.threads);
  const std::string out_dir = checked_output_dir(options);
  const std::vector<InputFile> files = find_input_files(options.inputs);
  MARROW_CHECK(!files.empty(), "no input files were given");
  const Tokenizer tokenizer = Tokenizer::load(options.tokenizer_path);
  const std::optional<int32_t> eos = tokenizer.token_id(options.eos_token);
  MARROW_CHECK(eos.has_value(), "tokenizer {} has no token '{}' to end documents with; name one with --eos-token",
               options.tokenizer_path, options.eos_token);

  WorkDirectory work(out_dir + ".incomplete");
  CorpusManifest manifest = start_manifest(options, tokenizer, *eos, files, work.dir());
  CorpusSink sink(options, files, work.dir(), manifest, uint32_t(*eos), start);
  std::vector<EncodeState> states(size_t(options.threads));
  auto encode = [&](const TextChunk& chunk, int worker) {
    ChunkTokens out;
    out.bytes = chunk.bytes.size();
    std::vector<int32_t> ids;
    chunk_documents(files[chunk.file_index], chunk, options.field, [&](std::string_view text, bool ends_document, bool no_loss) {
      ids.clear();
      tokenizer.encode(text, ids, states[size_t(worker)]);
      for (const int32_t id : ids) out.tokens.push_back(no_loss ? uint32_t(id) | kNoLossBit : uint32_t(id));
      if (ends_document) out.document_ends.push_back(out.tokens.size());
    }, out.bad_lines, options.loss_mask);
    return out;
  };
  ChunkReader reader(files, options.chunk_bytes);
  run_chunk_pipeline<ChunkTokens>(reader, options.threads, encode, [&](ChunkTokens& result) { sink.consume(result); });
  sink.finish();
  write_manifest(work.dir(), manifest);
  work.rename_to(out_dir);

  TokenizeReport report;
  report.manifest = std::move(manifest);
  report.text_bytes = sink.text_bytes();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace marrow
