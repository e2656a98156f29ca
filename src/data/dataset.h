// The training data reader: a tokenized corpus (token_corpus.h) seen as a stream of tokens cut into
// non-overlapping windows of seq_len + 1 tokens (consecutive windows share one token, so every
// token is a target once). A few windows spread evenly through the corpus are held out for
// validation; the rest are training samples.
//
// Sample order: step s takes positions s*S .. s*S+S-1 (S samples per step) of an endless sequence
// of seeded random permutations of the training windows, one per epoch: no window repeats before
// the corpus is used up, and a step's samples are a function of (seed, step), so resuming needs no
// saved state and any number of data-parallel ranks take disjoint slices of the same global batch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/token_corpus.h"

namespace marrow {

// Tokens [first, first + count) of a sample's seq_len + 1 (context parallelism reads only its
// parts of each sequence); a sample's spans are read one after another, none meaning all of it.
struct TokenSpan {
  int64_t first = 0, count = 0;
};
int64_t sample_tokens(const std::vector<TokenSpan>& spans, int64_t seq_len);

// Packed documents (data.document_mask): positions[i] is token i's position in its document, a
// document ending with the eos token (the token after one, like tokens[0], is at 0).
void document_positions(int32_t* positions, const int32_t* tokens, int64_t count, int32_t eos);

class TokenDataset {
 public:
  // Opens a tokenized corpus directory, verifying manifest, shard sizes and sha256.
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

  // The global batch over all data-parallel ranks (where each step starts): before train_batch.
  void set_samples_per_step(int64_t samples_per_step);
  // An Error when the run would need more than max_epochs passes over the training samples.
  void require_train_samples(int64_t needed, int64_t max_epochs = 1) const;
  // Error naming both numbers when the corpus's vocabulary does not fit the model's vocab_size.
  void require_vocab_fits(int64_t model_vocab_size) const;
  // Fills tokens[count * sample_tokens(spans)] with micro-batch `micro` of `count` samples of step
  // `step` for data-parallel rank dp_rank of dp_size: the step's samples micro*count*dp_size +
  // dp_rank*count + [0, count), so micro-batch m of all ranks together is micro-batch m of one
  // process with count*dp_size samples.
  void train_batch(int64_t step, int64_t micro, int64_t count, int32_t* tokens, int dp_rank = 0, int dp_size = 1,
                   const std::vector<TokenSpan>& spans = {}) const;
  void validation_batch(int64_t first, int64_t count, int32_t* tokens, const std::vector<TokenSpan>& spans = {}) const;
  // With a loss mask (manifest().loss_mask): the targets without kNoLossBit of step `step`'s global
  // batch, and of the first `count` validation samples (the loss is their mean).
  int64_t loss_targets(int64_t step) const;
  int64_t validation_loss_targets(int64_t count) const;

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
  void map_shards();
  std::vector<ShardDigest> hash_shards(bool show_progress) const;  // on all cores, with a progress line
  void check_shards(const std::vector<ShardDigest>& digests) const;
  int64_t validation_before(int64_t window) const;  // validation windows with a smaller index
  int64_t train_window(int64_t train_index) const;  // the train_index-th window that is not held out
  // Copies the spans of the window (all of it when none) to out, one after another.
  void copy_window(int64_t window, int32_t* out, const std::vector<TokenSpan>& spans) const;
  void copy_tokens(int64_t begin, int64_t count, int32_t* out) const;  // tokens [begin, begin + count) of the stream
  int64_t window_loss_targets(int64_t window) const;

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
