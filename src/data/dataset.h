// The training data reader: a tokenized corpus (token_corpus.h) seen as a stream of tokens cut into
// non-overlapping windows of seq_len + 1 tokens (consecutive windows share one token, so every
// token is a target once). A few windows spread evenly through the corpus are held out for
// validation; the rest are training samples.
//
// Sample order: the training samples of optimizer step s are positions s*S .. s*S+S-1 (S samples
// per step) of an endless sequence made of one seeded random permutation of all training windows
// per epoch. So no window repeats before the corpus is used up, and the samples of a step are a
// pure function of (seed, step): resuming needs no saved state, and the same global batch comes out
// for any number of data-parallel ranks, each taking disjoint slices of it (train_batch).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/token_corpus.h"

namespace marrow {

// Tokens [first, first + count) of a sample's seq_len + 1: context parallelism reads only the
// parts of each sequence a process trains on. Spans of a sample are read one after another; none
// means the whole sample.
struct TokenSpan {
  int64_t first = 0, count = 0;
};
int64_t sample_tokens(const std::vector<TokenSpan>& spans, int64_t seq_len);

class TokenDataset {
 public:
  // Opens a tokenized corpus directory, verifies manifest, shard sizes and sha256 (with a progress
  // line, core/progress.h, when slow and show_progress).
  TokenDataset(const std::string& dir, int64_t seq_len, uint64_t seed, double validation_fraction = 0.01, bool show_progress = true);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int64_t vocab_size() const { return manifest_.vocab_size; }  // from the manifest
  int32_t eos_id() const { return manifest_.eos_id; }
  int64_t seq_len() const { return seq_len_; }
  int64_t train_samples() const { return windows_ - validation_windows_; }  // distinct samples of seq_len+1 tokens
  int64_t validation_samples() const { return validation_windows_; }
  const CorpusManifest& manifest() const { return manifest_; }

  // The global batch: training samples per optimizer step over all data-parallel ranks. It sets
  // where each step starts in the sample order, so it must be called before train_batch.
  void set_samples_per_step(int64_t samples_per_step);
  // Error "corpus <dir> holds N training samples of L tokens but the run needs M (...)" when the
  // run would need more than max_epochs passes over them.
  void require_train_samples(int64_t needed, int64_t max_epochs = 1) const;
  // Error naming both numbers when the corpus's vocabulary does not fit the model's vocab_size.
  void require_vocab_fits(int64_t model_vocab_size) const;
  // Fills tokens[count*(seq_len+1)] with micro-batch `micro` of `count` samples of optimizer step `step` for
  // data-parallel rank dp_rank of dp_size: the step's samples micro*count*dp_size + dp_rank*count + [0, count).
  // One round of micro-batches covers every rank before the next, so micro-batch m of all ranks together
  // is micro-batch m of one process with count*dp_size samples (its load-balance statistics too).
  // A pure function of (seed, step, indices). With spans, only those tokens of each sample are read
  // (below): tokens holds count * sample_tokens(spans).
  void train_batch(int64_t step, int64_t micro, int64_t count, int32_t* tokens, int dp_rank = 0, int dp_size = 1,
                   const std::vector<TokenSpan>& spans = {}) const;
  void validation_batch(int64_t first, int64_t count, int32_t* tokens, const std::vector<TokenSpan>& spans = {}) const;

  // The window (index into the corpus's windows) of training sample `position` of the endless order.
  int64_t train_window_at(int64_t position) const;
  int64_t validation_window(int64_t index) const;
  bool is_validation_window(int64_t window) const;

 private:
  struct Shard {
    const uint32_t* tokens = nullptr;
    size_t bytes = 0;
    int64_t first_token = 0;  // offset of the shard in the whole stream
  };
  // What hashing a shard finds: its sha256 and its largest token id (checked against the manifest).
  struct ShardDigest {
    std::string sha256;
    uint32_t largest_id = 0;
  };
  void verify_and_map(bool show_progress);
  void map_shards();
  std::vector<ShardDigest> hash_shards(bool show_progress) const;  // on all cores, with a progress line
  void check_shards(const std::vector<ShardDigest>& digests) const;
  int64_t validation_before(int64_t window) const;  // validation windows with a smaller index
  int64_t train_window(int64_t train_index) const;  // the train_index-th window that is not held out
  // Copies the spans of the window (all of it when none) to out, one after another.
  void copy_window(int64_t window, int32_t* out, const std::vector<TokenSpan>& spans) const;
  void copy_tokens(int64_t begin, int64_t count, int32_t* out) const;  // tokens [begin, begin + count) of the stream

  std::string dir_;
  CorpusManifest manifest_;
  int64_t seq_len_;
  uint64_t seed_;
  int64_t windows_ = 0;
  int64_t validation_windows_ = 0;
  int64_t samples_per_step_ = 0;
  std::vector<Shard> shards_;
};

}  // namespace marrow
