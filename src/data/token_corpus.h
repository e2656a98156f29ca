// A tokenized corpus on disk (DESIGN.md §6): a directory with manifest.json, a copy of the
// tokenizer.json that made it, and shards of little-endian uint32 token ids, each document
// followed by the end-of-document token. A corpus tokenized with a loss mask sets kNoLossBit on
// the tokens that are no target of the loss (supervised fine-tuning's prompts); ids stay below it.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/sha256.h"

namespace marrow {

constexpr uint32_t kNoLossBit = 0x80000000u;

struct ShardInfo {
  std::string file;  // relative to the corpus directory
  int64_t tokens = 0;
  int64_t documents = 0;  // documents whose end-of-document token is in this shard
  std::string sha256;
};

struct CorpusManifest {
  std::string tokenizer_sha256;
  int64_t vocab_size = 0;
  int32_t eos_id = 0;
  std::string eos_token;
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t bad_lines = 0;
  std::string loss_mask;  // the JSONL field whose tokens carry kNoLossBit (marrow tokenize --loss-mask); empty: none
  std::vector<std::string> inputs;
  std::vector<ShardInfo> shards;
};

constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kCorpusTokenizerFile = "tokenizer.json";

// Reads and checks <dir>/manifest.json; a missing or malformed one is an Error naming it.
CorpusManifest read_manifest(const std::string& dir);
void write_manifest(const std::string& dir, const CorpusManifest& manifest);

// Writes a token stream as shards of at most shard_tokens tokens, hashing as it goes.
class ShardWriter {
 public:
  ShardWriter(std::string dir, int64_t shard_tokens);
  ~ShardWriter();
  void append(std::span<const uint32_t> tokens);
  // Counts a document that ends with the last token appended.
  void end_document();
  // Flushes and closes the last shard; the shards written, in order.
  std::vector<ShardInfo> finish();

 private:
  void flush();
  void close_shard();

  std::string dir_;
  int64_t shard_tokens_;
  int fd_ = -1;
  std::string path_;
  ShardInfo current_;
  Sha256 hash_;
  std::vector<uint32_t> buffer_;
  std::vector<ShardInfo> done_;
};

}  // namespace marrow
