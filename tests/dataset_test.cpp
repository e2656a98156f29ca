#include "data/dataset.h"

#include <map>
#include <set>

#include "core/errors.h"
#include "data_test_util.h"

namespace marrow {
namespace {

using data_testing::ScratchDir;

// A corpus whose token i is i itself, so every sample says where it came from.
std::string make_counting_corpus(const ScratchDir& dir, int64_t tokens, int64_t shard_tokens, int64_t vocab_size = 1 << 30) {
  std::string corpus = dir / "corpus";
  std::filesystem::create_directory(corpus);
  ShardWriter writer(corpus, shard_tokens);
  std::vector<uint32_t> all(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) all[size_t(i)] = uint32_t(i);
  writer.append(all);
  writer.end_document();
  CorpusManifest manifest;
  manifest.tokenizer_sha256 = sha256_hex("no tokenizer");
  manifest.vocab_size = vocab_size;
  manifest.eos_id = 0;
  manifest.documents = 1;
  manifest.tokens = tokens;
  manifest.shards = writer.finish();
  write_manifest(corpus, manifest);
  return corpus;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TokenDataset, WindowsSplitIntoDisjointTrainAndValidation) {
  ScratchDir dir;
  std::string corpus = make_counting_corpus(dir, 10001, 777);
  TokenDataset data(corpus, 16, 1234, 0.05);
  const int64_t windows = 10000 / 16;
  EXPECT_EQ(data.train_samples() + data.validation_samples(), windows);
  EXPECT_EQ(data.validation_samples(), windows / 20);
  std::set<int64_t> validation;
  for (int64_t j = 0; j < data.validation_samples(); ++j) validation.insert(data.validation_window(j));
  EXPECT_EQ(int64_t(validation.size()), data.validation_samples());
  std::set<int64_t> train;
  for (int64_t position = 0; position < data.train_samples(); ++position) train.insert(data.train_window_at(position));
  EXPECT_EQ(int64_t(train.size()), data.train_samples());  // one epoch visits every training window once
  for (int64_t w : train) {
    EXPECT_FALSE(validation.count(w));
    EXPECT_FALSE(data.is_validation_window(w));
  }
  for (int64_t w : validation) EXPECT_TRUE(data.is_validation_window(w));
  // The next epoch is another order of the same windows.
  std::vector<int64_t> first_epoch, second_epoch;
  for (int64_t p = 0; p < data.train_samples(); ++p) {
    first_epoch.push_back(data.train_window_at(p));
    second_epoch.push_back(data.train_window_at(p + data.train_samples()));
  }
  EXPECT_NE(first_epoch, second_epoch);
  EXPECT_EQ(std::set<int64_t>(second_epoch.begin(), second_epoch.end()), train);
}

TEST(TokenDataset, SamplesAreConsecutiveTokensAcrossShards) {
  ScratchDir dir;
  std::string corpus = make_counting_corpus(dir, 5000, 100);
  TokenDataset data(corpus, 31, 7);
  data.set_samples_per_step(8);
  std::vector<int32_t> batch(8 * 32);
  data.train_batch(3, 0, 8, batch.data());
  for (int s = 0; s < 8; ++s) {
    int32_t start = batch[size_t(s) * 32];
    EXPECT_EQ(start % 31, 0);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(batch[size_t(s) * 32 + size_t(i)], start + i);
  }
  std::vector<int32_t> validation(32);
  data.validation_batch(0, 1, validation.data());
  EXPECT_EQ(validation[0], int32_t(data.validation_window(0) * 31));
}

TEST(TokenDataset, PureFunctionOfSeedAndStepAndSplitAcrossRanks) {
  ScratchDir dir;
  std::string corpus = make_counting_corpus(dir, 20000, 3000);
  TokenDataset a(corpus, 15, 99), b(corpus, 15, 99), other_seed(corpus, 15, 100);
  for (TokenDataset* d : {&a, &b, &other_seed}) d->set_samples_per_step(12);
  const size_t sample = 16;
  std::vector<int32_t> whole(12 * sample), again(12 * sample), seeded(12 * sample);
  a.train_batch(5, 0, 12, whole.data());
  b.train_batch(5, 0, 12, again.data());
  other_seed.train_batch(5, 0, 12, seeded.data());
  EXPECT_EQ(whole, again);
  EXPECT_NE(whole, seeded);
  // Four ranks in micro-batches of 3: micro-batch m of rank r is global samples m * 12 + r * 3 .. + 2
  // (one round of micro-batches covers every rank before the next), so they give the global batch.
  std::vector<int32_t> sharded(12 * sample);
  for (int rank = 0; rank < 4; ++rank) a.train_batch(5, 0, 3, sharded.data() + size_t(rank) * 3 * sample, rank, 4);
  EXPECT_EQ(whole, sharded);
  std::vector<int32_t> rank1_micro0(3 * sample), rank1_micro1(3 * sample);
  a.train_batch(5, 0, 3, rank1_micro0.data(), 1, 2);
  a.train_batch(5, 1, 3, rank1_micro1.data(), 1, 2);
  EXPECT_TRUE(std::equal(rank1_micro0.begin(), rank1_micro0.end(), whole.begin() + 3 * sample));
  EXPECT_TRUE(std::equal(rank1_micro1.begin(), rank1_micro1.end(), whole.begin() + 9 * sample));
  // No training window repeats before the corpus is used up.
  std::set<int32_t> starts;
  int64_t steps = a.train_samples() / 12;
  std::vector<int32_t> batch(12 * sample);
  for (int64_t step = 0; step < steps; ++step) {
    a.train_batch(step, 0, 12, batch.data());
    for (size_t s = 0; s < 12; ++s) EXPECT_TRUE(starts.insert(batch[s * sample]).second) << "step " << step;
  }
}

// Context parallelism reads spans of each sample (a zigzag share: two chunks with their last
// targets): exactly those tokens of the whole samples, across shard boundaries, in training and validation.
TEST(TokenDataset, SpansReadThosePartsOfEachSample) {
  ScratchDir dir;
  std::string corpus = make_counting_corpus(dir, 20000, 1000);
  TokenDataset data(corpus, 15, 7);
  data.set_samples_per_step(4);
  const std::vector<TokenSpan> spans = {{4, 5}, {8, 5}};  // chunks 1 and 2 of 4 (CP = 2, rank 1) with one more token each
  const size_t sample = 16;
  std::vector<int32_t> whole(4 * sample), parts(4 * 10);
  data.train_batch(3, 0, 4, whole.data());
  data.train_batch(3, 0, 4, parts.data(), 0, 1, spans);
  for (size_t s = 0; s < 4; ++s)
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(parts[s * 10 + i], whole[s * sample + 4 + i]);
      EXPECT_EQ(parts[s * 10 + 5 + i], whole[s * sample + 8 + i]);
    }
  data.validation_batch(0, 1, whole.data());
  data.validation_batch(0, 1, parts.data(), spans);
  EXPECT_TRUE(std::equal(parts.begin(), parts.begin() + 5, whole.begin() + 4));
  EXPECT_TRUE(std::equal(parts.begin() + 5, parts.begin() + 10, whole.begin() + 8));
  EXPECT_EQ(sample_tokens(spans, 15), 10);
  EXPECT_EQ(sample_tokens({}, 15), 16);
  EXPECT_EQ(error_of([&] { sample_tokens({{12, 5}}, 15); }), "tokens [12, 17) are not within a sample of 16");
}

TEST(TokenDataset, ClearErrorsForSmallCorporaVocabulariesAndDamage) {
  ScratchDir dir;
  std::string corpus = make_counting_corpus(dir, 4097, 1000, 50000);
  TokenDataset data(corpus, 64, 1);
  EXPECT_EQ(error_of([&] { data.require_train_samples(1000); }),
            fmt::format("corpus {} holds {} training samples of 65 tokens but the run needs 1000 (steps x global batch); "
                        "tokenize more text, or lower the steps, the batch or seq_len, or allow more passes (data.max_epochs)",
                        corpus, data.train_samples()));
  EXPECT_NO_THROW(data.require_train_samples(data.train_samples()));
  // More passes when asked for, and the error names the limit.
  EXPECT_NO_THROW(data.require_train_samples(2 * data.train_samples(), 2));
  EXPECT_EQ(error_of([&] { data.require_train_samples(2 * data.train_samples() + 1, 2); }),
            fmt::format("corpus {} holds {} training samples of 65 tokens but the run needs {} (steps x global batch), more than "
                        "data.max_epochs = 2 passes; tokenize more text, or lower the steps, the batch or seq_len, or allow more "
                        "passes (data.max_epochs)",
                        corpus, data.train_samples(), 2 * data.train_samples() + 1));
  EXPECT_NE(error_of([&] { data.require_vocab_fits(32000); }).find("vocabulary of 50000 tokens but the model has only 32000"),
            std::string::npos);
  EXPECT_NO_THROW(data.require_vocab_fits(50000));
  EXPECT_NE(error_of([&] { TokenDataset(corpus, 5000, 1); }).find("fewer than one sample"), std::string::npos);
  std::vector<int32_t> batch(65);
  EXPECT_NE(error_of([&] { data.train_batch(0, 0, 1, batch.data()); }).find("set_samples_per_step"), std::string::npos);

  {
    std::fstream shard(corpus + "/shard-00002.bin", std::ios::in | std::ios::out | std::ios::binary);
    shard.seekp(10);
    shard.put('\x7f');
  }
  EXPECT_NE(error_of([&] { TokenDataset(corpus, 64, 1); }).find("shard shard-00002.bin is corrupt"), std::string::npos);
  std::filesystem::resize_file(corpus + "/shard-00001.bin", 12);
  EXPECT_NE(error_of([&] { TokenDataset(corpus, 64, 1); }).find("shard shard-00001.bin holds 12 bytes but the manifest says 1000 tokens"),
            std::string::npos);
  EXPECT_NE(error_of([&] { TokenDataset(dir / "nowhere", 64, 1); }).find("is not a tokenized corpus"), std::string::npos);
}

}  // namespace
}  // namespace marrow
