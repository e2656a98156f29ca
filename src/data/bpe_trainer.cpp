#include "data/bpe_trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <queue>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "core/errors.h"
#include "data/chunk_pipeline.h"

namespace marrow {
namespace {

// ByteLevel shows byte b as this code point; byte tokens get ids in this order, as `tokenizers` does.
uint32_t byte_level_code(int b) {
  bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  if (printable) return uint32_t(b);
  int rank = 0;
  for (int other = 0; other < b; ++other)
    if (!((other >= 33 && other <= 126) || (other >= 161 && other <= 172) || other >= 174)) ++rank;
  return 256 + uint32_t(rank);
}

std::vector<std::string> initial_tokens(const std::vector<std::string>& special_tokens) {
  std::vector<std::string> tokens = special_tokens;
  std::vector<int> bytes(256);
  for (int b = 0; b < 256; ++b) bytes[size_t(b)] = b;
  std::sort(bytes.begin(), bytes.end(), [](int a, int b) { return byte_level_code(a) < byte_level_code(b); });
  for (int b : bytes) tokens.emplace_back(1, char(b));
  return tokens;
}

std::vector<AddedToken> special_added_tokens(const std::vector<std::string>& special_tokens) {
  std::vector<AddedToken> added;
  for (size_t i = 0; i < special_tokens.size(); ++i) added.push_back({int32_t(i), special_tokens[i], true, false, false, false});
  return added;
}

uint64_t pair_key(int32_t left, int32_t right) { return uint64_t(uint32_t(left)) << 32 | uint32_t(right); }

struct Word {
  std::vector<int32_t> symbols;
  int64_t count;
};

}  // namespace

Tokenizer untrained_tokenizer(const std::vector<std::string>& special_tokens) {
  std::set<std::string> distinct(special_tokens.begin(), special_tokens.end());
  MARROW_CHECK(distinct.size() == special_tokens.size(), "the special tokens must be distinct");
  for (const std::string& token : special_tokens) MARROW_CHECK(!token.empty(), "a special token must not be empty");
  return Tokenizer(initial_tokens(special_tokens), {}, special_added_tokens(special_tokens), {{kQwenSplitPattern, false}}, true);
}

PieceCounts count_pieces(const BpeTrainOptions& options) {
  check_pipeline_threads(options.threads);
  std::vector<InputFile> files = find_input_files(options.inputs);
  MARROW_CHECK(!files.empty(), "no input files were given");
  Tokenizer splitter = untrained_tokenizer(options.special_tokens);
  std::vector<EncodeState> states(size_t(options.threads));
  struct TransparentHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Counts = std::unordered_map<std::string, int64_t, TransparentHash, std::equal_to<>>;
  std::vector<Counts> worker_counts(size_t(options.threads));
  ChunkReader reader(files);
  struct ChunkResult {
    std::vector<BadLine> bad_lines;
  };
  int64_t bad_lines = 0;
  auto start = std::chrono::steady_clock::now(), last_progress = start;
  bool tty = ::isatty(STDERR_FILENO);
  auto work = [&](const TextChunk& chunk, int worker) {
    ChunkResult result;
    auto& counts = worker_counts[size_t(worker)];
    chunk_documents(files[chunk.file_index], chunk, options.field, [&](std::string_view text, bool) {
      splitter.pre_tokenize(text, states[size_t(worker)], [&](std::string_view piece) {
        auto it = counts.find(piece);
        if (it == counts.end()) {
          counts.emplace(piece, 1);
        } else {
          ++it->second;
        }
      });
    }, result.bad_lines);
    return result;
  };
  auto consume = [&](ChunkResult& result) {
    for (const BadLine& bad : result.bad_lines) {
      std::string where = fmt::format("{}:{}", files[bad.file_index].path, bad.line);
      MARROW_CHECK(!options.strict, "{}: {} (--strict stops at the first bad line)", where, bad.reason);
      if (++bad_lines <= 20) std::fprintf(stderr, "warning: %s: %s, line skipped\n", where.c_str(), bad.reason.c_str());
    }
    auto now = std::chrono::steady_clock::now();
    if (options.progress && now - last_progress > std::chrono::seconds(tty ? 1 : 10)) {
      double seconds = std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "%strain-tokenizer: counted %.1f MB of text (%.1f MB/s)%s", tty ? "\r" : "", reader.bytes_read() / 1e6,
                   reader.bytes_read() / 1e6 / seconds, tty ? "" : "\n");
      last_progress = now;
    }
  };
  run_chunk_pipeline<ChunkResult>(reader, options.threads, work, consume);
  if (options.progress && tty) std::fprintf(stderr, "\n");
  if (bad_lines > 20) std::fprintf(stderr, "warning: %lld more bad lines were skipped\n", static_cast<long long>(bad_lines - 20));
  PieceCounts total;
  for (auto& counts : worker_counts) {
    for (auto& [piece, count] : counts) total[piece] += count;
    counts.clear();
  }
  MARROW_CHECK(!total.empty(), "the inputs ({} file{}) hold no text to train on", files.size(), files.size() == 1 ? "" : "s");
  return total;
}

Tokenizer train_bpe(const PieceCounts& counts, const BpeTrainOptions& options) {
  std::vector<std::string> tokens = initial_tokens(options.special_tokens);
  MARROW_CHECK(options.vocab_size >= int64_t(tokens.size()),
               "--vocab-size {} is too small: the {} special tokens and 256 bytes alone need {}", options.vocab_size,
               options.special_tokens.size(), tokens.size());
  int32_t byte_ids[256];
  for (size_t id = options.special_tokens.size(); id < tokens.size(); ++id) byte_ids[uint8_t(tokens[id][0])] = int32_t(id);
  std::unordered_map<std::string, int32_t> id_of_token;
  for (size_t id = options.special_tokens.size(); id < tokens.size(); ++id) id_of_token.emplace(tokens[id], int32_t(id));

  std::vector<Word> words;
  words.reserve(counts.size());
  for (const auto& [piece, count] : counts) {
    Word word{{}, count};
    for (char byte : piece) word.symbols.push_back(byte_ids[uint8_t(byte)]);
    words.push_back(std::move(word));
  }

  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<uint32_t>> words_with_pair;
  for (uint32_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w].symbols;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      uint64_t key = pair_key(s[i], s[i + 1]);
      pair_counts[key] += words[w].count;
      auto& list = words_with_pair[key];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  }
  // Most frequent first; among equals the smaller (left, right) ids, so the order is total.
  struct Candidate {
    int64_t count;
    uint64_t key;
    bool operator<(const Candidate& other) const { return count != other.count ? count < other.count : key > other.key; }
  };
  std::priority_queue<Candidate> heap;
  for (const auto& [key, count] : pair_counts) heap.push({count, key});

  std::vector<std::pair<int32_t, int32_t>> merges;
  auto start = std::chrono::steady_clock::now(), last_progress = start;
  bool tty = ::isatty(STDERR_FILENO);
  const int64_t min_frequency = std::max<int64_t>(options.min_frequency, 1);
  while (int64_t(tokens.size()) < options.vocab_size && !heap.empty()) {
    Candidate top = heap.top();
    heap.pop();
    int64_t current = pair_counts[top.key];
    if (current != top.count) {
      if (current > 0) heap.push({current, top.key});
      continue;
    }
    if (top.count < min_frequency) break;
    auto left = int32_t(top.key >> 32), right = int32_t(uint32_t(top.key));
    std::string joined = tokens[size_t(left)] + tokens[size_t(right)];
    auto [existing, fresh] = id_of_token.emplace(joined, int32_t(tokens.size()));
    if (fresh) tokens.push_back(joined);
    int32_t merged = existing->second;
    merges.emplace_back(left, right);

    std::unordered_set<uint64_t> grown;
    std::vector<uint32_t> affected = std::move(words_with_pair[top.key]);
    words_with_pair.erase(top.key);
    for (uint32_t w : affected) {
      Word& word = words[w];
      auto& s = word.symbols;
      bool found = false;
      for (size_t i = 0; i + 1 < s.size(); ++i) found = found || (s[i] == left && s[i + 1] == right);
      if (!found) continue;
      for (size_t i = 0; i + 1 < s.size(); ++i) pair_counts[pair_key(s[i], s[i + 1])] -= word.count;
      size_t kept = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == left && s[i + 1] == right) {
          s[kept++] = merged;
          ++i;
        } else {
          s[kept++] = s[i];
        }
      }
      s.resize(kept);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        uint64_t key = pair_key(s[i], s[i + 1]);
        pair_counts[key] += word.count;
        if (s[i] == merged || s[i + 1] == merged) {
          grown.insert(key);
          auto& list = words_with_pair[key];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
    }
    pair_counts.erase(top.key);
    std::vector<uint64_t> grown_keys(grown.begin(), grown.end());
    std::sort(grown_keys.begin(), grown_keys.end());
    for (uint64_t key : grown_keys) heap.push({pair_counts[key], key});

    auto now = std::chrono::steady_clock::now();
    if (options.progress && now - last_progress > std::chrono::seconds(tty ? 1 : 10)) {
      std::fprintf(stderr, "%strain-tokenizer: vocabulary %zu of %lld%s", tty ? "\r" : "", tokens.size(),
                   static_cast<long long>(options.vocab_size), tty ? "" : "\n");
      last_progress = now;
    }
  }
  if (options.progress && tty) std::fprintf(stderr, "\n");
  return Tokenizer(std::move(tokens), merges, special_added_tokens(options.special_tokens), {{kQwenSplitPattern, false}}, true);
}

}  // namespace marrow
