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

}  // namespace

TokenizeReport tokenize_corpus(const TokenizeOptions& options) {
  auto start = std::chrono::steady_clock::now();
  check_pipeline_threads(options.threads);
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
