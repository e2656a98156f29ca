#include "data/bpe_trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <queue>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "core/errors.h"
#include "data/chunk_pipeline.h"

namespace marrow {
namespace {

// The special tokens, then the byte tokens in the order of their ByteLevel code points, as `tokenizers` does.
std::vector<std::string> initial_tokens(const std::vector<std::string>& special_tokens) {
  std::vector<std::string> tokens = special_tokens;
  std::vector<int> bytes(256);
  for (int b = 0; b < 256; ++b) bytes[size_t(b)] = b;
  std::sort(bytes.begin(), bytes.end(), [](int a, int b) { return byte_level_code(uint8_t(a)) < byte_level_code(uint8_t(b)); });
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

bool holds_pair(const std::vector<int32_t>& s, int32_t left, int32_t right) {
  for (size_t i = 0; i + 1 < s.size(); ++i)
    if (s[i] == left && s[i + 1] == right) return true;
  return false;
}

// Replaces every (left, right) in the word by merged, left to right.
void merge_pairs(std::vector<int32_t>& s, int32_t left, int32_t right, int32_t merged) {
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
}

// The pairs of adjacent symbols over all words: their counts (each word weighted by its count), the
// words that hold each, and a heap of candidates, most frequent first and among equals the smaller
// (left, right) ids, so the order is total. Heap entries go stale as counts change; a stale one is
// pushed again with its current count when it comes up.
class PairIndex {
 public:
  explicit PairIndex(const std::vector<Word>& words) {
    for (uint32_t w = 0; w < words.size(); ++w) {
      const auto& s = words[w].symbols;
      for (size_t i = 0; i + 1 < s.size(); ++i) add(pair_key(s[i], s[i + 1]), w, words[w].count);
    }
    for (const auto& [key, count] : counts_) heap_.push({count, key});
  }

  // The most frequent pair, if it occurs at least min_frequency times.
  std::optional<uint64_t> most_frequent(int64_t min_frequency) {
    while (!heap_.empty()) {
      const Candidate top = heap_.top();
      heap_.pop();
      const int64_t current = counts_[top.key];
      if (current == top.count) return top.count >= min_frequency ? std::optional(top.key) : std::nullopt;
      if (current > 0) heap_.push({current, top.key});
    }
    return std::nullopt;
  }

  // Merges pair `key` into the symbol `merged` in every word that holds it; the pairs that now
  // contain `merged` become candidates.
  void merge(std::vector<Word>& words, uint64_t key, int32_t merged) {
    const auto left = int32_t(key >> 32), right = int32_t(uint32_t(key));
    std::unordered_set<uint64_t> grown;
    const std::vector<uint32_t> affected = std::move(words_with_[key]);
    words_with_.erase(key);
    for (uint32_t w : affected) {
      auto& s = words[w].symbols;
      const int64_t count = words[w].count;
      if (!holds_pair(s, left, right)) continue;  // a stale entry of the list
      for (size_t i = 0; i + 1 < s.size(); ++i) counts_[pair_key(s[i], s[i + 1])] -= count;
      merge_pairs(s, left, right, merged);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t pair = pair_key(s[i], s[i + 1]);
        counts_[pair] += count;
        if (s[i] == merged || s[i + 1] == merged) {
          grown.insert(pair);
          add(pair, w, 0);
        }
      }
    }
    counts_.erase(key);
    std::vector<uint64_t> grown_keys(grown.begin(), grown.end());
    std::sort(grown_keys.begin(), grown_keys.end());
    for (uint64_t pair : grown_keys) heap_.push({counts_[pair], pair});
  }

 private:
  struct Candidate {
    int64_t count;
    uint64_t key;
    bool operator<(const Candidate& other) const { return count != other.count ? count < other.count : key > other.key; }
  };
  void add(uint64_t key, uint32_t word, int64_t count) {
    counts_[key] += count;
    auto& list = words_with_[key];
    if (list.empty() || list.back() != word) list.push_back(word);
  }

  std::unordered_map<uint64_t, int64_t> counts_;
  std::unordered_map<uint64_t, std::vector<uint32_t>> words_with_;
  std::priority_queue<Candidate> heap_;
};

}  // namespace

Tokenizer untrained_tokenizer(const std::vector<std::string>& special_tokens) {
  std::set<std::string> distinct(special_tokens.begin(), special_tokens.end());
  MARROW_CHECK(distinct.size() == special_tokens.size(), "the special tokens must be distinct");
  for (const std::string& token : special_tokens) MARROW_CHECK(!token.empty(), "a special token must not be empty");
  return Tokenizer(initial_tokens(special_tokens), {}, special_added_tokens(special_tokens), {{kQwenSplitPattern, false}}, true);
}

namespace {

struct TransparentHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
// One worker's counts, looked up by string_view without building a string.
using WorkerCounts = std::unordered_map<std::string, int64_t, TransparentHash, std::equal_to<>>;

void count_piece(WorkerCounts& counts, std::string_view piece) {
  auto it = counts.find(piece);
  if (it == counts.end()) counts.emplace(piece, 1);
  else ++it->second;
}

// "train-tokenizer: counted N MB of text", every second on a terminal (overwriting), else every 10.
class CountProgress {
 public:
  CountProgress(const ChunkReader& reader, bool enabled) : reader_(reader), enabled_(enabled) {}
  bool overwrites() const { return enabled_ && tty_; }
  void update() {
    const auto now = std::chrono::steady_clock::now();
    if (!enabled_ || now - last_ <= std::chrono::seconds(tty_ ? 1 : 10)) return;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "%strain-tokenizer: counted %.1f MB of text (%.1f MB/s)%s", tty_ ? "\r" : "", reader_.bytes_read() / 1e6,
                 reader_.bytes_read() / 1e6 / seconds, tty_ ? "" : "\n");
    last_ = now;
  }
  void finish() const {
    if (overwrites()) std::fprintf(stderr, "\n");
  }

 private:
  const ChunkReader& reader_;
  const bool enabled_, tty_ = ::isatty(STDERR_FILENO);
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

}  // namespace

PieceCounts count_pieces(const BpeTrainOptions& options) {
  check_pipeline_threads(options.threads);
  std::vector<InputFile> files = find_input_files(options.inputs);
  MARROW_CHECK(!files.empty(), "no input files were given");
  Tokenizer splitter = untrained_tokenizer(options.special_tokens);
  std::vector<EncodeState> states(size_t(options.threads));
  std::vector<WorkerCounts> worker_counts(size_t(options.threads));
  ChunkReader reader(files);
  CountProgress progress(reader, options.progress);
  BadLineReport bad_lines(files, options.strict, progress.overwrites());
  auto work = [&](const TextChunk& chunk, int worker) {
    std::vector<BadLine> bad;
    auto count = [&](std::string_view piece) { count_piece(worker_counts[size_t(worker)], piece); };
    chunk_documents(files[chunk.file_index], chunk, options.field,
                    [&](std::string_view text, bool, bool) { splitter.pre_tokenize(text, states[size_t(worker)], count); }, bad);
    return bad;
  };
  auto consume = [&](std::vector<BadLine>& bad) {
    bad_lines.skip(bad);
    progress.update();
  };
  run_chunk_pipeline<std::vector<BadLine>>(reader, options.threads, work, consume);
  progress.finish();
  bad_lines.finish();
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

  PairIndex pairs(words);
  std::vector<std::pair<int32_t, int32_t>> merges;
  auto start = std::chrono::steady_clock::now(), last_progress = start;
  bool tty = ::isatty(STDERR_FILENO);
  const int64_t min_frequency = std::max<int64_t>(options.min_frequency, 1);
  while (int64_t(tokens.size()) < options.vocab_size) {
    const std::optional<uint64_t> key = pairs.most_frequent(min_frequency);
    if (!key) break;
    const auto left = int32_t(*key >> 32), right = int32_t(uint32_t(*key));
    const std::string joined = tokens[size_t(left)] + tokens[size_t(right)];
    auto [existing, fresh] = id_of_token.emplace(joined, int32_t(tokens.size()));
    if (fresh) tokens.push_back(joined);
    merges.emplace_back(left, right);
    pairs.merge(words, *key, existing->second);

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
