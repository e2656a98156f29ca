// Byte-level BPE tokenizer that reads and writes Hugging Face tokenizer.json files (Qwen2/Qwen3,
// GPT-2 families) and encodes exactly as `tokenizers` does: added tokens are cut out first
// (leftmost, longest); the rest is NFC-normalised, split by the pre-tokenizer's regexes (PCRE2 JIT),
// mapped by ByteLevel and merged by BPE, lowest rank first, leftmost on ties. Immutable, shared by
// threads; each encoding thread brings its own EncodeState (match buffers, a cache of pieces).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/json.h"

namespace marrow {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = true;
  bool normalized = false;  // matched in normalised text rather than in the raw text
  bool lstrip = false;      // swallows ASCII whitespace on its left
  bool rstrip = false;      // swallows ASCII whitespace on its right
};

// One regex split step of the pre-tokenizer. Isolated keeps matches and the text between them as
// pieces; Removed drops the matches.
struct SplitRule {
  std::string pattern;
  bool remove_matches = false;
};

// The pre-tokenizer used by Qwen2/Qwen3 (and by `marrow train-tokenizer`).
extern const char* const kQwenSplitPattern;
// GPT-2's ByteLevel alphabet: the code point that stands for byte b in a token's text.
char32_t byte_level_code(uint8_t b);

struct EncodeScratch;
class EncodeState {
 public:
  EncodeState();
  ~EncodeState();
  EncodeState(EncodeState&&) noexcept;
  EncodeState& operator=(EncodeState&&) noexcept;

 private:
  friend class Tokenizer;
  std::unique_ptr<EncodeScratch> scratch_;
};

struct CompiledRegex;
struct CompiledRegexFree {
  void operator()(CompiledRegex* regex) const;
};

class Tokenizer {
 public:
  // Reads a Hugging Face tokenizer.json; anything it cannot encode exactly as `tokenizers` does
  // (another model type, normaliser or pre-tokenizer) is an Error naming the file and the field.
  static Tokenizer load(const std::string& path);
  static Tokenizer from_json(const Json& json, const std::string& source);

  // A byte-level BPE tokenizer from its parts: `tokens[id]` holds a token's bytes, `merges` pairs
  // of ids in rank order (each pair's concatenation must be a token), `added` the special tokens.
  Tokenizer(std::vector<std::string> tokens, const std::vector<std::pair<int32_t, int32_t>>& merges,
            std::vector<AddedToken> added, std::vector<SplitRule> splits, bool nfc);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // The tokenizer.json form (vocab ordered by id, merges as pairs), loadable by `tokenizers`.
  nlohmann::ordered_json to_json() const;
  void save(const std::string& path) const;

  // One more than the largest id of the vocabulary and the added tokens.
  int64_t vocab_size() const { return vocab_size_; }
  // The id of an added token or vocabulary entry written as in tokenizer.json.
  std::optional<int32_t> token_id(std::string_view content) const;

  // Appends the ids of valid UTF-8 `text` to `ids` (invalid UTF-8 is an Error).
  void encode(std::string_view text, std::vector<int32_t>& ids, EncodeState& state) const;
  std::vector<int32_t> encode(std::string_view text) const;
  // The bytes the ids stand for; ids that cut a character in two give its bytes as they are.
  std::string decode(std::span<const int32_t> ids) const;

  // Pieces of `text` after added-token extraction, normalisation and pre-tokenisation, as raw
  // bytes; added tokens are left out. This is what BPE training counts.
  void pre_tokenize(std::string_view text, EncodeState& state,
                    const std::function<void(std::string_view piece)>& visit) const;

 private:
  Tokenizer();
  // from_json's parts, tokenizer.json's sections in order.
  void read_vocab(const Json& model, const std::string& source);
  std::vector<std::pair<int32_t, int32_t>> read_merges(const Json& model, const std::string& source) const;
  void read_added_tokens(const Json& json, const std::string& source);
  void read_normalizer(const Json& json, const std::string& source);
  void read_pre_tokenizer(const Json& json, const std::string& source);
  void build_tables(const std::vector<std::pair<int32_t, int32_t>>& merges, const std::string& source);
  void split_added(std::string_view text, bool normalized_set,
                   const std::function<void(std::string_view, const AddedToken*)>& visit) const;
  void split_pieces(size_t rule, std::string_view text, EncodeScratch& scratch,
                    const std::function<void(std::string_view)>& visit) const;
  void encode_segment(std::string_view raw, std::vector<int32_t>& ids, EncodeScratch& scratch) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& ids, EncodeScratch& scratch) const;
  void merge_short_word(std::vector<int32_t>& symbols) const;
  void merge_long_word(std::vector<int32_t>& symbols) const;
  bool find_merge(int32_t left, int32_t right, uint32_t& rank, int32_t& merged) const;

  std::vector<std::string> token_bytes_;  // by id; added tokens hold their content
  std::vector<std::string> token_text_;   // by id, as written in tokenizer.json
  std::unordered_map<std::string, int32_t> id_by_text_;
  std::unordered_map<std::string, int32_t> id_by_bytes_;  // for ignore_merges
  std::vector<std::pair<int32_t, int32_t>> merges_;
  // (left << 32 | right) -> (rank << 32 | merged id), open addressing, power-of-two size.
  std::vector<uint64_t> merge_keys_, merge_values_;
  int32_t byte_ids_[256];
  std::vector<AddedToken> added_;
  std::vector<SplitRule> splits_;
  std::vector<std::unique_ptr<CompiledRegex, CompiledRegexFree>> regexes_;
  bool nfc_ = false;
  // ByteLevel comes after the first byte_level_rule_ split rules: it may put a space before each
  // piece (add_prefix_space) and, with use_regex, adds GPT-2's split rule after them.
  size_t byte_level_rule_ = 0;
  bool prefix_space_ = false;
  bool ignore_merges_ = false;
  std::optional<int32_t> unknown_id_;
  bool fuse_unknown_ = false;
  int64_t vocab_size_ = 0;
  bool has_normalized_added_ = false, has_raw_added_ = false;
  // [normalized][byte]: some added token of that set starts with the byte.
  bool added_starts_with_[2][256] = {};
};

}  // namespace marrow
