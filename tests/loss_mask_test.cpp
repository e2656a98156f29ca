// The loss mask (marrow tokenize --loss-mask FIELD, data.loss_mask): the field's tokens (a prompt)
// carry kNoLossBit in the corpus, the dataset counts the targets without it (the loss is their
// mean), and make_batch turns the marked targets into kIgnoreIndex and strips the bit from ids.
#include <gtest/gtest.h>

#include <cstring>

#include "core/json.h"
#include "data/bpe_trainer.h"
#include "data/dataset.h"
#include "data/tokenize_corpus.h"
#include "data_test_util.h"
#include "engine/trainer.h"
#include "models/qwen3_moe.h"

namespace marrow {
namespace {

using data_testing::error_of;
using data_testing::read_file;
using data_testing::ScratchDir;
using data_testing::write_file;

std::string save_tokenizer(const ScratchDir& dir) {
  PieceCounts counts;
  Tokenizer splitter = untrained_tokenizer({"<|endoftext|>"});
  EncodeState state;
  splitter.pre_tokenize("question answer: the value of it is forty two", state,
                        [&](std::string_view piece) { counts[std::string(piece)] += 3; });
  BpeTrainOptions options;
  options.vocab_size = 300;
  const std::string path = dir / "tokenizer.json";
  train_bpe(counts, options).save(path);
  return path;
}

std::vector<uint32_t> shard_tokens(const std::string& corpus) {
  std::vector<uint32_t> tokens;
  for (const ShardInfo& shard : read_manifest(corpus).shards) {
    const std::string bytes = read_file(corpus + "/" + shard.file);
    tokens.resize(tokens.size() + bytes.size() / 4);
    std::memcpy(tokens.data() + tokens.size() - bytes.size() / 4, bytes.data(), bytes.size());
  }
  return tokens;
}

// Each line's prompt, then its text, then eos: the prompt's tokens alone carry the bit.
TEST(LossMask, TokenizeMarksTheFieldsTokens) {
  ScratchDir dir;
  TokenizeOptions options;
  options.tokenizer_path = save_tokenizer(dir);
  write_file(dir / "sft.jsonl", Json{{"prompt", "question"}, {"text", " answer: forty two"}}.dump() + "\n" +
                                    Json{{"prompt", ""}, {"text", "the value"}}.dump() + "\n");
  options.inputs = {dir / "sft.jsonl"};
  options.out_dir = dir / "corpus";
  options.loss_mask = "prompt";
  tokenize_corpus(options);
  EXPECT_EQ(read_manifest(options.out_dir).loss_mask, "prompt");
  const Tokenizer tokenizer = Tokenizer::load(options.tokenizer_path);
  std::vector<uint32_t> want;
  // (text, its tokens carry the bit); a document's text ends it with eos (id 0).
  for (const auto& [text, prompt] : {std::pair{"question", true}, {" answer: forty two", false}, {"", true}, {"the value", false}}) {
    for (const int32_t id : tokenizer.encode(text)) want.push_back(prompt ? uint32_t(id) | kNoLossBit : uint32_t(id));
    if (!prompt) want.push_back(0);
  }
  EXPECT_EQ(shard_tokens(options.out_dir), want);
  write_file(dir / "plain.txt", "the value\n");
  options.inputs = {dir / "plain.txt"};
  options.overwrite = true;
  EXPECT_NE(error_of([&] { tokenize_corpus(options); }).find("a loss mask (--loss-mask) needs JSONL inputs"), std::string::npos);
}

// A corpus of 41 tokens whose every third token carries the bit: its ids pass the vocabulary check
// without it, every window of 10 targets counts those without it, and make_batch ignores the rest.
TEST(LossMask, DatasetCountsAndBatchIgnoresMaskedTargets) {
  ScratchDir dir;
  const std::string corpus = dir / "corpus";
  std::filesystem::create_directory(corpus);
  ShardWriter writer(corpus, 1000);
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 41; ++i) tokens.push_back(i % 3 == 0 ? (i + 1) | kNoLossBit : i + 1);
  writer.append(tokens);
  writer.end_document();
  CorpusManifest manifest;
  manifest.tokenizer_sha256 = sha256_hex("no tokenizer");
  manifest.vocab_size = 64;
  manifest.documents = 1;
  manifest.tokens = 41;
  manifest.loss_mask = "prompt";
  manifest.shards = writer.finish();
  write_manifest(corpus, manifest);
  TokenDataset data(corpus, 10, 1, 0.0, false);
  data.set_samples_per_step(4);
  int64_t want = 0;
  for (int64_t s = 0; s < 4; ++s) {
    std::vector<int32_t> sample(11);
    data.train_batch(0, s, 1, sample.data(), 0, 1);
    want += std::count_if(sample.begin() + 1, sample.end(), [](int32_t t) { return !(uint32_t(t) & kNoLossBit); });
  }
  EXPECT_EQ(data.loss_targets(0), want);
  EXPECT_LT(want, 40);

  const std::vector<int32_t> window = {int32_t(1 | kNoLossBit), 2, 3, int32_t(4 | kNoLossBit), 5};
  for (const bool masked : {false, true}) {
    SequenceShare share{4, {{0, 5}}, {}, -1, masked};
    const Qwen3MoeBatch batch = make_batch<Qwen3Moe>(window, 1, share, Device::cpu);
    const int32_t* ids = batch.input_ids.ptr<int32_t>();
    const int32_t* targets = batch.targets.ptr<int32_t>();
    EXPECT_EQ(std::vector<int32_t>(ids, ids + 4), (std::vector<int32_t>{1, 2, 3, 4}));
    EXPECT_EQ(std::vector<int32_t>(targets, targets + 4), (std::vector<int32_t>{2, 3, masked ? kIgnoreIndex : 4, 5}));
  }
}

}  // namespace
}  // namespace marrow
