#include "data/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/errors.h"
#include "core/progress.h"

namespace marrow {
namespace fs = std::filesystem;

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A bijection of [0, n) chosen by key, computed without a table: a balanced four-round Feistel
// network on the smallest even number of bits that covers n, repeated until it lands below n
// (cycle walking; fewer than four rounds of it on average).
uint64_t permute(uint64_t index, uint64_t n, uint64_t key) {
  int bits = std::max(2, int(std::bit_width(n - 1)));
  bits += bits & 1;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t(1) << half) - 1;
  do {
    uint64_t left = index >> half, right = index & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t next_right = left ^ (mix(right ^ mix(key + round)) & mask);
      left = right;
      right = next_right;
    }
    index = left << half | right;
  } while (index >= n);
  return index;
}

}  // namespace

TokenDataset::TokenDataset(const std::string& dir, int64_t seq_len, uint64_t seed, double validation_fraction, bool show_progress)
    : dir_(dir), manifest_(read_manifest(dir)), seq_len_(seq_len), seed_(seed) {
  MARROW_CHECK(seq_len > 0, "seq_len must be positive, got {}", seq_len);
  MARROW_CHECK(validation_fraction >= 0 && validation_fraction <= 0.5, "the validation fraction must be in [0, 0.5], got {}",
               validation_fraction);
  MARROW_CHECK(manifest_.tokens >= seq_len + 1, "corpus {} holds {} tokens, fewer than one sample of seq_len + 1 = {}", dir,
               manifest_.tokens, seq_len + 1);
  windows_ = (manifest_.tokens - 1) / seq_len;
  if (validation_fraction > 0 && windows_ >= 2)
    validation_windows_ = std::clamp<int64_t>(int64_t(double(windows_) * validation_fraction), 1, windows_ / 2);
  map_shards();
  check_shards(hash_shards(show_progress));
}

TokenDataset::~TokenDataset() {
  for (const Shard& shard : shards_)
    if (shard.tokens) ::munmap(const_cast<uint32_t*>(shard.tokens), shard.bytes);
}

void TokenDataset::map_shards() {
  int64_t offset = 0;
  for (const ShardInfo& info : manifest_.shards) {
    std::string path = (fs::path(dir_) / info.file).string();
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MARROW_CHECK(fd >= 0, "corpus {}: cannot open shard {}: {}", dir_, path, std::strerror(errno));
    struct stat status {};
    int rc = ::fstat(fd, &status);
    int saved = errno;
    if (rc != 0) ::close(fd);
    MARROW_CHECK(rc == 0, "corpus {}: cannot stat {}: {}", dir_, path, std::strerror(saved));
    auto expected = size_t(info.tokens) * sizeof(uint32_t);
    if (size_t(status.st_size) != expected) ::close(fd);
    MARROW_CHECK(size_t(status.st_size) == expected, "corpus {}: shard {} holds {} bytes but the manifest says {} tokens ({} bytes)",
                 dir_, info.file, status.st_size, info.tokens, expected);
    void* data = ::mmap(nullptr, expected, PROT_READ, MAP_PRIVATE, fd, 0);
    saved = errno;
    ::close(fd);
    MARROW_CHECK(data != MAP_FAILED, "corpus {}: cannot mmap {}: {}", dir_, path, std::strerror(saved));
    shards_.push_back({static_cast<const uint32_t*>(data), expected, offset});
    offset += info.tokens;
  }
}

std::vector<TokenDataset::ShardDigest> TokenDataset::hash_shards(bool show_progress) const {
  const uint32_t id_bits = manifest_.loss_mask.empty() ? ~0u : ~kNoLossBit;  // a loss mask's bit is no part of the id
  std::atomic<size_t> next_shard{0};
  std::atomic<uint64_t> hashed_bytes{0};
  std::vector<ShardDigest> digests(shards_.size());
  uint64_t total_bytes = 0;
  for (const Shard& shard : shards_) total_bytes += shard.bytes;
  auto hash_some = [&] {
    for (size_t i; (i = next_shard++) < shards_.size();) {
      Sha256 hash;
      const auto* bytes = reinterpret_cast<const char*>(shards_[i].tokens);
      for (size_t at = 0; at < shards_[i].bytes;) {
        size_t take = std::min<size_t>(shards_[i].bytes - at, size_t(64) << 20);
        hash.update(bytes + at, take);
        const uint32_t* ids = shards_[i].tokens + at / sizeof(uint32_t);
        for (const uint32_t* id = ids; id < ids + take / sizeof(uint32_t); ++id)
          digests[i].largest_id = std::max(digests[i].largest_id, *id & id_bits);
        hashed_bytes += take;
        at += take;
      }
      digests[i].sha256 = hash.hex_digest();
    }
  };
  std::vector<std::jthread> pool;
  unsigned threads = std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, unsigned(shards_.size()));
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(hash_some);
  Progress progress(fmt::format("dataset: checking sha256 of {}", dir_), total_bytes, show_progress);
  while (hashed_bytes < total_bytes) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    progress.set(hashed_bytes);
  }
  progress.set(total_bytes);
  progress.finish();
  pool.clear();  // joins: every digest is written
  return digests;
}

void TokenDataset::check_shards(const std::vector<ShardDigest>& digests) const {
  for (size_t i = 0; i < shards_.size(); ++i)
    MARROW_CHECK(digests[i].sha256 == manifest_.shards[i].sha256,
                 "corpus {}: shard {} is corrupt: its sha256 is {} but the manifest says {}", dir_, manifest_.shards[i].file,
                 digests[i].sha256, manifest_.shards[i].sha256);
  // An id outside the vocabulary would index past the embeddings, or (0xFFFFFF9C) read as the
  // ignore index -100 and silently train on nothing.
  for (size_t i = 0; i < shards_.size(); ++i)
    MARROW_CHECK(int64_t(digests[i].largest_id) < manifest_.vocab_size,
                 "corpus {}: shard {} holds token id {} but the manifest's vocab_size is {}: the shard or manifest.json was changed",
                 dir_, manifest_.shards[i].file, digests[i].largest_id, manifest_.vocab_size);
  std::string tokenizer = (fs::path(dir_) / kCorpusTokenizerFile).string();
  if (fs::exists(tokenizer))
    MARROW_CHECK(sha256_file(tokenizer) == manifest_.tokenizer_sha256,
                 "corpus {}: {} is not the tokenizer the corpus was made with (its sha256 differs from the manifest's)", dir_, tokenizer);
}

void TokenDataset::set_samples_per_step(int64_t samples_per_step) {
  MARROW_CHECK(samples_per_step > 0, "samples per step must be positive, got {}", samples_per_step);
  samples_per_step_ = samples_per_step;
}

void TokenDataset::require_train_samples(int64_t needed, int64_t max_epochs) const {
  MARROW_CHECK(needed <= max_epochs * train_samples(),
               "corpus {} holds {} training samples of {} tokens but the run needs {} (steps x global batch){}; "
               "tokenize more text, or lower the steps, the batch or seq_len, or allow more passes (data.max_epochs)",
               dir_, train_samples(), seq_len_ + 1, needed,
               max_epochs > 1 ? fmt::format(", more than data.max_epochs = {} passes", max_epochs) : "");
}

void TokenDataset::require_vocab_fits(int64_t model_vocab_size) const {
  MARROW_CHECK(manifest_.vocab_size <= model_vocab_size,
               "corpus {} was tokenized with a vocabulary of {} tokens but the model has only {} embeddings", dir_,
               manifest_.vocab_size, model_vocab_size);
}

// Validation window j is floor((2j+1) * W / (2V)) for W windows and V held out: one in the middle
// of each of V equal stretches of the corpus.
int64_t TokenDataset::validation_window(int64_t index) const {
  MARROW_CHECK(index >= 0 && index < validation_windows_, "validation sample {} is out of range (the corpus holds {})", index,
               validation_windows_);
  return int64_t((__int128(2 * index + 1) * windows_) / (2 * __int128(validation_windows_)));
}

int64_t TokenDataset::validation_before(int64_t window) const {
  if (validation_windows_ == 0) return 0;
  // Count of j >= 0 with (2j+1) * W < 2 V w, i.e. (2j+1) <= (2 V w - 1) / W.
  __int128 limit = 2 * __int128(validation_windows_) * window - 1;
  if (limit < windows_) return 0;
  auto odd_max = int64_t(limit / windows_);
  return std::min<int64_t>((odd_max - 1) / 2 + 1, validation_windows_);
}

bool TokenDataset::is_validation_window(int64_t window) const {
  int64_t before = validation_before(window);
  return before < validation_windows_ && validation_window(before) == window;
}

int64_t TokenDataset::train_window(int64_t train_index) const {
  // The smallest w whose prefix [0, w] holds train_index + 1 training windows.
  int64_t low = train_index, high = std::min(train_index + validation_windows_, windows_ - 1);
  while (low < high) {
    int64_t mid = low + (high - low) / 2;
    if (mid + 1 - validation_before(mid + 1) >= train_index + 1) high = mid;
    else low = mid + 1;
  }
  return low;
}

int64_t TokenDataset::train_window_at(int64_t position) const {
  const int64_t n = train_samples();
  int64_t epoch = position / n;
  uint64_t key = mix(seed_ ^ mix(uint64_t(epoch) + 0x5EED));
  return train_window(int64_t(permute(uint64_t(position % n), uint64_t(n), key)));
}

void TokenDataset::copy_tokens(int64_t begin, int64_t count, int32_t* out) const {
  auto shard = std::upper_bound(shards_.begin(), shards_.end(), begin,
                                [](int64_t offset, const Shard& s) { return offset < s.first_token; }) - 1;
  while (count > 0) {
    int64_t in_shard = begin - shard->first_token;
    int64_t take = std::min<int64_t>(count, int64_t(shard->bytes / sizeof(uint32_t)) - in_shard);
    std::memcpy(out, shard->tokens + in_shard, size_t(take) * sizeof(uint32_t));
    out += take;
    begin += take;
    count -= take;
    ++shard;
  }
}

void document_positions(int32_t* positions, const int32_t* tokens, int64_t count, int32_t eos) {
  for (int64_t i = 0; i < count; ++i) positions[i] = i == 0 || tokens[i - 1] == eos ? 0 : positions[i - 1] + 1;
}

int64_t sample_tokens(const std::vector<TokenSpan>& spans, int64_t seq_len) {
  if (spans.empty()) return seq_len + 1;
  int64_t sum = 0;
  for (const TokenSpan& s : spans) {
    MARROW_CHECK(s.first >= 0 && s.count >= 0 && s.first + s.count <= seq_len + 1, "tokens [{}, {}) are not within a sample of {}",
                 s.first, s.first + s.count, seq_len + 1);
    sum += s.count;
  }
  return sum;
}

void TokenDataset::copy_window(int64_t window, int32_t* out, const std::vector<TokenSpan>& spans) const {
  if (spans.empty()) return copy_tokens(window * seq_len_, seq_len_ + 1, out);
  for (const TokenSpan& s : spans) {
    copy_tokens(window * seq_len_ + s.first, s.count, out);
    out += s.count;
  }
}

void TokenDataset::train_batch(int64_t step, int64_t micro, int64_t count, int32_t* tokens, int dp_rank, int dp_size,
                               const std::vector<TokenSpan>& spans) const {
  MARROW_CHECK(samples_per_step_ > 0, "TokenDataset::train_batch needs set_samples_per_step(global batch) first");
  MARROW_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "data-parallel rank {} of {} is invalid", dp_rank, dp_size);
  const int64_t round = count * dp_size;  // samples of one micro-batch over all ranks
  MARROW_CHECK(step >= 0 && micro >= 0 && count >= 0 && (micro + 1) * round <= samples_per_step_,
               "micro-batch {} of {} samples on {} data-parallel ranks does not fit a global batch of {}", micro, count, dp_size,
               samples_per_step_);
  const int64_t base = step * samples_per_step_ + micro * round + dp_rank * count, sample = sample_tokens(spans, seq_len_);
  for (int64_t i = 0; i < count; ++i) copy_window(train_window_at(base + i), tokens + i * sample, spans);
}

int64_t TokenDataset::window_loss_targets(int64_t window) const {
  std::vector<int32_t> tokens(size_t(seq_len_ + 1));
  copy_window(window, tokens.data(), {});
  return std::count_if(tokens.begin() + 1, tokens.end(), [](int32_t t) { return !(uint32_t(t) & kNoLossBit); });
}

int64_t TokenDataset::loss_targets(int64_t step) const {
  int64_t count = 0;
  for (int64_t i = 0; i < samples_per_step_; ++i) count += window_loss_targets(train_window_at(step * samples_per_step_ + i));
  return count;
}

int64_t TokenDataset::validation_loss_targets(int64_t count) const {
  int64_t targets = 0;
  for (int64_t i = 0; i < count; ++i) targets += window_loss_targets(validation_window(i));
  return targets;
}

void TokenDataset::validation_batch(int64_t first, int64_t count, int32_t* tokens, const std::vector<TokenSpan>& spans) const {
  MARROW_CHECK(first >= 0 && count >= 0 && first + count <= validation_windows_,
               "validation samples {}..{} are outside the {} the corpus holds", first, first + count - 1, validation_windows_);
  const int64_t sample = sample_tokens(spans, seq_len_);
  for (int64_t i = 0; i < count; ++i) copy_window(validation_window(first + i), tokens + i * sample, spans);
}

}  // namespace marrow
