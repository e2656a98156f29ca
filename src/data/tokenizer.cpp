// Encoding and decoding. Loading and saving tokenizer.json is in tokenizer_json.cpp.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <cstring>
#include <queue>

#include "core/errors.h"
#include "data/unicode.h"

namespace marrow {

const char* const kQwenSplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  int got = pcre2_get_error_message(code, buffer, sizeof buffer);
  return got < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<char*>(buffer));
}

// Words that do not fit the cache are merged every time; long ones are rare.
constexpr size_t kMaxCachedPieceBytes = 256;
// Up to this many symbols, merging rescans a rank array; longer words use a heap.
constexpr size_t kShortWordSymbols = 64;

uint64_t hash_bytes(std::string_view bytes) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ bytes.size();
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, 8);
    h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, bytes.data() + i, bytes.size() - i);
  h = (h ^ tail) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

// The ids of pieces already encoded: open addressing over a byte arena for the keys and an id
// arena for the values, emptied whole when full (the frequent pieces come straight back). The
// slots are allocated on first use, so a state made for one short text costs little.
class PieceCache {
 public:
  const int32_t* find(std::string_view piece, uint64_t hash, size_t& count) const {
    if (slots_.empty()) return nullptr;
    for (size_t at = hash & (kSlots - 1);; at = (at + 1) & (kSlots - 1)) {
      const Slot& slot = slots_[at];
      if (slot.hash == 0) return nullptr;
      if (slot.hash == (hash | 1) && slot.key_size == piece.size() &&
          std::memcmp(keys_.data() + slot.key_offset, piece.data(), piece.size()) == 0) {
        count = slot.id_count;
        return ids_.data() + slot.ids_offset;
      }
    }
  }

  void insert(std::string_view piece, uint64_t hash, const std::vector<int32_t>& ids) {
    if (slots_.empty()) slots_.resize(kSlots);
    if (entries_ == kSlots / 2) clear();
    size_t at = hash & (kSlots - 1);
    while (slots_[at].hash != 0) at = (at + 1) & (kSlots - 1);
    slots_[at] = {hash | 1, uint32_t(keys_.size()), uint32_t(ids_.size()), uint16_t(piece.size()), uint16_t(ids.size())};
    keys_.append(piece);
    ids_.insert(ids_.end(), ids.begin(), ids.end());
    ++entries_;
  }

  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    entries_ = 0;
  }

 private:
  static constexpr size_t kSlots = size_t(1) << 18;
  struct Slot {
    uint64_t hash = 0;  // with the low bit set, so that 0 marks an empty slot
    uint32_t key_offset = 0, ids_offset = 0;
    uint16_t key_size = 0, id_count = 0;
  };
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t entries_ = 0;
};

}  // namespace

struct CompiledRegex {
  pcre2_code* code = nullptr;
  ~CompiledRegex() { pcre2_code_free(code); }
};

void CompiledRegexFree::operator()(CompiledRegex* regex) const { delete regex; }

std::unique_ptr<CompiledRegex, CompiledRegexFree> compile_split_regex(const std::string& pattern, const std::string& source) {
  std::unique_ptr<CompiledRegex, CompiledRegexFree> regex(new CompiledRegex);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  regex->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                              &error, &error_offset, nullptr);
  MARROW_CHECK(regex->code, "{}: the pre-tokenizer regex does not compile with PCRE2 at offset {}: {} (regex: {})",
               source, error_offset, pcre2_message(error), pattern);
  int jit = pcre2_jit_compile(regex->code, PCRE2_JIT_COMPLETE);
  if (jit != 0) fail_call(__FILE__, __LINE__, "pcre2_jit_compile", pcre2_message(jit));
  return regex;
}

struct EncodeScratch {
  const Tokenizer* owner = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* match_context = nullptr;
  std::vector<pcre2_match_data*> match_data;
  std::string normalized;
  std::string prefixed;
  std::vector<int32_t> symbols;
  PieceCache cache;

  EncodeScratch() {
    jit_stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
    match_context = pcre2_match_context_create(nullptr);
    if (!jit_stack || !match_context) fail_call(__FILE__, __LINE__, "pcre2_jit_stack_create", "out of memory");
    pcre2_jit_stack_assign(match_context, nullptr, jit_stack);
  }
  ~EncodeScratch() {
    for (pcre2_match_data* data : match_data) pcre2_match_data_free(data);
    pcre2_match_context_free(match_context);
    pcre2_jit_stack_free(jit_stack);
  }

  void prepare(const Tokenizer* tokenizer, size_t regex_count, const std::vector<std::unique_ptr<CompiledRegex, CompiledRegexFree>>& regexes) {
    if (owner == tokenizer) return;
    owner = tokenizer;
    cache.clear();
    for (pcre2_match_data* data : match_data) pcre2_match_data_free(data);
    match_data.clear();
    for (size_t i = 0; i < regex_count; ++i) {
      match_data.push_back(pcre2_match_data_create_from_pattern(regexes[i]->code, nullptr));
      if (!match_data.back()) fail_call(__FILE__, __LINE__, "pcre2_match_data_create_from_pattern", "out of memory");
    }
  }
};

EncodeState::EncodeState() : scratch_(std::make_unique<EncodeScratch>()) {}
EncodeState::~EncodeState() = default;
EncodeState::EncodeState(EncodeState&&) noexcept = default;
EncodeState& EncodeState::operator=(EncodeState&&) noexcept = default;

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

void Tokenizer::build_tables(const std::vector<std::pair<int32_t, int32_t>>& merges, const std::string& source) {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  for (size_t id = 0; id < token_bytes_.size(); ++id) {
    const std::string& bytes = token_bytes_[id];
    if (bytes.empty() || token_text_[id].empty()) continue;
    id_by_bytes_.emplace(bytes, int32_t(id));
    if (bytes.size() == 1 && byte_ids_[uint8_t(bytes[0])] < 0) byte_ids_[uint8_t(bytes[0])] = int32_t(id);
  }
  merges_ = merges;
  size_t capacity = 16;
  while (capacity < merges.size() * 2) capacity *= 2;
  merge_keys_.assign(capacity, ~uint64_t(0));
  merge_values_.assign(capacity, 0);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    auto [left, right] = merges[rank];
    std::string joined = token_bytes_.at(size_t(left)) + token_bytes_.at(size_t(right));
    auto merged = id_by_bytes_.find(joined);
    MARROW_CHECK(merged != id_by_bytes_.end(), "{}: merge number {} ('{}' '{}') makes '{}', which is not in the vocabulary",
                 source, rank, token_text_[size_t(left)], token_text_[size_t(right)],
                 token_text_[size_t(left)] + token_text_[size_t(right)]);
    uint64_t key = uint64_t(uint32_t(left)) << 32 | uint32_t(right);
    size_t slot = (key * 0x9E3779B97F4A7C15ull) >> 40 & (capacity - 1);
    while (merge_keys_[slot] != ~uint64_t(0) && merge_keys_[slot] != key) slot = (slot + 1) & (capacity - 1);
    // A repeated pair takes its later rank, as `tokenizers` does.
    merge_keys_[slot] = key;
    merge_values_[slot] = uint64_t(rank) << 32 | uint32_t(merged->second);
  }
  for (const AddedToken& token : added_) {
    MARROW_CHECK(!token.content.empty() && token.id >= 0, "{}: added token {} must have content and a non-negative id", source, token.id);
    (token.normalized ? has_normalized_added_ : has_raw_added_) = true;
    added_starts_with_[token.normalized][uint8_t(token.content[0])] = true;
  }
  for (const SplitRule& rule : splits_) regexes_.push_back(compile_split_regex(rule.pattern, source));
  vocab_size_ = int64_t(token_bytes_.size());
  for (const AddedToken& token : added_) vocab_size_ = std::max<int64_t>(vocab_size_, token.id + 1);
  token_bytes_.resize(size_t(vocab_size_));
  token_text_.resize(size_t(vocab_size_));
  for (const AddedToken& token : added_)
    if (token_text_[size_t(token.id)].empty()) token_bytes_[size_t(token.id)] = token.content;
}

std::optional<int32_t> Tokenizer::token_id(std::string_view content) const {
  for (const AddedToken& token : added_)
    if (token.content == content) return token.id;
  auto it = id_by_text_.find(std::string(content));
  if (it == id_by_text_.end()) return std::nullopt;
  return it->second;
}

// Cuts `text` at the added tokens of one set (those matched in raw or in normalised text):
// at each position the longest token that starts there, the leftmost position first.
void Tokenizer::split_added(std::string_view text, bool normalized_set,
                            const std::function<void(std::string_view, const AddedToken*)>& visit) const {
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
  const bool* starts = added_starts_with_[normalized_set];
  size_t start = 0;
  for (size_t pos = 0; pos < text.size(); ++pos) {
    if (!starts[uint8_t(text[pos])]) continue;
    const AddedToken* best = nullptr;
    for (const AddedToken& token : added_) {
      if (token.normalized != normalized_set || token.content.empty() || token.content[0] != text[pos]) continue;
      if ((!best || token.content.size() > best->content.size()) && text.substr(pos).starts_with(token.content))
        best = &token;
    }
    if (!best) continue;
    size_t match_start = pos, match_end = pos + best->content.size();
    if (best->lstrip)
      while (match_start > start && is_space(text[match_start - 1])) --match_start;
    if (best->rstrip)
      while (match_end < text.size() && is_space(text[match_end])) ++match_end;
    if (match_start > start) visit(text.substr(start, match_start - start), nullptr);
    visit(text.substr(match_start, match_end - match_start), best);
    start = match_end;
    pos = match_end - 1;
  }
  if (start < text.size()) visit(text.substr(start), nullptr);
}

void Tokenizer::split_pieces(size_t rule, std::string_view text, EncodeScratch& scratch,
                             const std::function<void(std::string_view)>& visit) const {
  if (text.empty()) return;
  if (rule == byte_level_rule_ && prefix_space_ && text[0] != ' ') {
    std::string prefixed(1, ' ');
    prefixed += text;
    split_pieces(rule, prefixed, scratch, visit);
    return;
  }
  if (rule == splits_.size()) {
    visit(text);
    return;
  }
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  pcre2_match_data* match = scratch.match_data[rule];
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
  size_t gap_start = 0, offset = 0;
  while (offset < text.size()) {
    int rc = pcre2_jit_match(regexes_[rule]->code, subject, text.size(), offset, 0, match, scratch.match_context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail_call(__FILE__, __LINE__, "pcre2_jit_match", pcre2_message(rc));
    size_t match_start = ovector[0], match_end = ovector[1];
    if (match_end == match_start) {
      // An empty match splits nothing; step over one character and search on.
      offset = match_start + 1;
      while (offset < text.size() && (uint8_t(text[offset]) & 0xC0) == 0x80) ++offset;
      continue;
    }
    if (match_start > gap_start) split_pieces(rule + 1, text.substr(gap_start, match_start - gap_start), scratch, visit);
    if (!splits_[rule].remove_matches) split_pieces(rule + 1, text.substr(match_start, match_end - match_start), scratch, visit);
    gap_start = offset = match_end;
  }
  if (gap_start < text.size()) split_pieces(rule + 1, text.substr(gap_start), scratch, visit);
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& ids, EncodeScratch& scratch) const {
  if (piece.size() == 1 && byte_ids_[uint8_t(piece[0])] >= 0) {
    ids.push_back(byte_ids_[uint8_t(piece[0])]);
    return;
  }
  bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  uint64_t hash = cacheable ? hash_bytes(piece) : 0;
  if (cacheable) {
    size_t count = 0;
    if (const int32_t* cached = scratch.cache.find(piece, hash, count)) {
      ids.insert(ids.end(), cached, cached + count);
      return;
    }
  }
  std::vector<int32_t>& symbols = scratch.symbols;
  symbols.clear();
  auto whole = ignore_merges_ ? id_by_bytes_.find(std::string(piece)) : id_by_bytes_.end();
  if (whole != id_by_bytes_.end()) {
    symbols.push_back(whole->second);
  } else {
    bool last_unknown = false;
    for (char byte : piece) {
      int32_t id = byte_ids_[uint8_t(byte)];
      // Without an unknown token `tokenizers` drops a symbol missing from the vocabulary.
      if (id < 0 && unknown_id_ && !(fuse_unknown_ && last_unknown)) symbols.push_back(*unknown_id_);
      if (id >= 0) symbols.push_back(id);
      last_unknown = id < 0;
    }
    if (symbols.size() > kShortWordSymbols) merge_long_word(symbols);
    else merge_short_word(symbols);
  }
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  if (cacheable) scratch.cache.insert(piece, hash, symbols);
}

bool Tokenizer::find_merge(int32_t left, int32_t right, uint32_t& rank, int32_t& merged) const {
  uint64_t key = uint64_t(uint32_t(left)) << 32 | uint32_t(right);
  size_t mask = merge_keys_.size() - 1;
  for (size_t slot = (key * 0x9E3779B97F4A7C15ull) >> 40 & mask;; slot = (slot + 1) & mask) {
    uint64_t found = merge_keys_[slot];
    if (found == key) {
      rank = uint32_t(merge_values_[slot] >> 32);
      merged = int32_t(uint32_t(merge_values_[slot]));
      return true;
    }
    if (found == ~uint64_t(0)) return false;
  }
}

// Repeatedly merges the adjacent pair of lowest rank, leftmost first. ranks[i] belongs to the pair
// (i, i+1); only the two pairs next to a merge change, so each merge costs one scan.
void Tokenizer::merge_short_word(std::vector<int32_t>& symbols) const {
  constexpr uint32_t kNone = ~uint32_t(0);
  uint32_t ranks[kShortWordSymbols];
  int32_t merged_ids[kShortWordSymbols];
  size_t n = symbols.size();
  if (n < 2) return;
  auto lookup = [&](size_t i) {
    if (!find_merge(symbols[i], symbols[i + 1], ranks[i], merged_ids[i])) ranks[i] = kNone;
  };
  for (size_t i = 0; i + 1 < n; ++i) lookup(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNone) break;
    symbols[best] = merged_ids[best];
    for (size_t i = best + 1; i + 1 < n; ++i) {
      symbols[i] = symbols[i + 1];
      if (i + 1 < n - 1) {
        ranks[i] = ranks[i + 1];
        merged_ids[i] = merged_ids[i + 1];
      }
    }
    --n;
    if (best + 1 < n) lookup(best);
    if (best > 0) lookup(best - 1);
  }
  symbols.resize(n);
}

// The same order of merges for long words (e.g. a line of CJK text), with a heap of candidate
// pairs keyed by (rank, position) and a linked list of symbols. A candidate is stale once either
// of its symbols has merged into something else.
void Tokenizer::merge_long_word(std::vector<int32_t>& symbols) const {
  struct Candidate {
    uint32_t rank;
    uint32_t position;
    int32_t left, right, merged;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  size_t n = symbols.size();
  std::vector<int32_t> next(n), previous(n);
  for (size_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? int32_t(i + 1) : -1;
    previous[i] = int32_t(i) - 1;
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t position) {
    if (position < 0 || next[size_t(position)] < 0) return;
    Candidate c{0, uint32_t(position), symbols[size_t(position)], symbols[size_t(next[size_t(position)])], 0};
    if (find_merge(c.left, c.right, c.rank, c.merged)) heap.push(c);
  };
  for (size_t i = 0; i + 1 < n; ++i) push(int32_t(i));
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    int32_t right = next[c.position];
    if (!alive[c.position] || right < 0 || symbols[c.position] != c.left || symbols[size_t(right)] != c.right) continue;
    symbols[c.position] = c.merged;
    alive[size_t(right)] = false;
    next[c.position] = next[size_t(right)];
    if (next[c.position] >= 0) previous[size_t(next[c.position])] = int32_t(c.position);
    push(previous[c.position]);
    push(int32_t(c.position));
  }
  size_t kept = 0;
  for (int32_t i = 0; i >= 0; i = next[size_t(i)]) symbols[kept++] = symbols[size_t(i)];
  symbols.resize(kept);
}

void Tokenizer::encode_segment(std::string_view raw, std::vector<int32_t>& ids, EncodeScratch& scratch) const {
  std::string_view text = raw;
  if (nfc_) {
    scratch.normalized.clear();
    append_nfc(raw, scratch.normalized);
    text = scratch.normalized;
  }
  auto encode_pieces = [&](std::string_view part) {
    split_pieces(0, part, scratch, [&](std::string_view piece) { encode_piece(piece, ids, scratch); });
  };
  if (!has_normalized_added_) {
    encode_pieces(text);
    return;
  }
  split_added(text, true, [&](std::string_view part, const AddedToken* token) {
    if (token) ids.push_back(token->id);
    else encode_pieces(part);
  });
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& ids, EncodeState& state) const {
  size_t invalid = find_invalid_utf8(text);
  MARROW_CHECK(invalid == std::string_view::npos, "text to encode is not valid UTF-8 (at byte {} of {})", invalid, text.size());
  EncodeScratch& scratch = *state.scratch_;
  scratch.prepare(this, regexes_.size(), regexes_);
  if (!has_raw_added_) {
    encode_segment(text, ids, scratch);
    return;
  }
  split_added(text, false, [&](std::string_view part, const AddedToken* token) {
    if (token) ids.push_back(token->id);
    else encode_segment(part, ids, scratch);
  });
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  EncodeState state;
  std::vector<int32_t> ids;
  encode(text, ids, state);
  return ids;
}

void Tokenizer::pre_tokenize(std::string_view text, EncodeState& state,
                             const std::function<void(std::string_view piece)>& visit) const {
  size_t invalid = find_invalid_utf8(text);
  MARROW_CHECK(invalid == std::string_view::npos, "text to split is not valid UTF-8 (at byte {} of {})", invalid, text.size());
  EncodeScratch& scratch = *state.scratch_;
  scratch.prepare(this, regexes_.size(), regexes_);
  auto normalize_and_split = [&](std::string_view raw) {
    std::string normalized = nfc_ ? to_nfc(raw) : std::string(raw);
    split_added(normalized, true, [&](std::string_view part, const AddedToken* token) {
      if (!token) split_pieces(0, part, scratch, visit);
    });
  };
  split_added(text, false, [&](std::string_view part, const AddedToken* token) {
    if (!token) normalize_and_split(part);
  });
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (int32_t id : ids) {
    MARROW_CHECK(id >= 0 && id < vocab_size_, "token id {} is outside the vocabulary (size {})", id, vocab_size_);
    text += token_bytes_[size_t(id)];
  }
  return text;
}

}  // namespace marrow
