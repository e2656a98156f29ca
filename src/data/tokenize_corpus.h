// `marrow tokenize`: raw text in, tokenized corpus (token_corpus.h) out, on all cores.
#pragma once
#include <string>
#include <vector>

#include "data/token_corpus.h"

namespace marrow {

struct TokenizeOptions {
  std::vector<std::string> inputs;  // files, directories or globs
  std::string tokenizer_path;
  std::string out_dir;
  std::string field = "text";
  std::string loss_mask;  // JSONL field whose text comes before each document's and is no target of the loss; empty: none
  std::string eos_token = "<|endoftext|>";
  int threads = 1;
  int64_t shard_tokens = int64_t(1) << 28;
  size_t chunk_bytes = size_t(1) << 20;  // text handed to one worker at a time
  bool strict = false;     // a bad line is an error rather than skipped and reported
  bool overwrite = false;  // replace an existing corpus at out_dir
  bool progress = false;   // a progress line on stderr
};

struct TokenizeReport {
  CorpusManifest manifest;
  uint64_t text_bytes = 0;
  double seconds = 0;
};

// Tokenizes the inputs into a corpus at out_dir. It is written to <out_dir>.incomplete and renamed
// when done, so a corpus directory is always whole. The result depends only on the inputs and the
// tokenizer, not on the thread count.
TokenizeReport tokenize_corpus(const TokenizeOptions& options);

}  // namespace marrow
