// Training a byte-level BPE tokenizer: count the pre-tokenizer's pieces over a corpus (in parallel),
// then repeatedly merge the most frequent adjacent pair of tokens. The result has the Qwen
// pre-tokenizer, NFC, the special tokens first (ids 0..), then the 256 bytes, then one token per
// merge; it is a pure function of the text and the options, whatever the thread count.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace marrow {

struct BpeTrainOptions {
  std::vector<std::string> inputs;  // files, directories or globs, as for `marrow tokenize`
  std::string field = "text";
  int64_t vocab_size = 0;  // special tokens and the 256 bytes included
  std::vector<std::string> special_tokens = {"<|endoftext|>"};
  int64_t min_frequency = 2;  // a pair seen fewer times is never merged
  int threads = 1;
  bool strict = false;
  bool progress = false;
};

// Pieces (raw bytes) and how often each occurs.
using PieceCounts = std::map<std::string, int64_t>;

// The tokenizer before any merge: special tokens, bytes and the pre-tokenizer that training counts with.
Tokenizer untrained_tokenizer(const std::vector<std::string>& special_tokens);

PieceCounts count_pieces(const BpeTrainOptions& options);

Tokenizer train_bpe(const PieceCounts& counts, const BpeTrainOptions& options);

}  // namespace marrow
