// engine/trainer.h's make_batch: the tokens read through a share's spans become inputs, targets
// and true positions (context parallelism's zigzag share, checked end to end elsewhere only
// through the layout comparisons).
#include <gtest/gtest.h>

#include "engine/trainer.h"
#include "models/qwen3_moe.h"
#include "parallel/ring_attention.h"

namespace marrow {
namespace {

std::vector<int32_t> values(const Buffer& b) {
  const int32_t* p = b.ptr<int32_t>();
  return std::vector<int32_t>(p, p + b.numel());
}

// Rank 0 of cp = 2 over a sequence of 8: chunks 0 and 3 (positions 0-1 and 6-7); each span reads
// one token more, the last target.
TEST(MakeBatch, ZigzagShareGivesInputsTargetsAndTruePositions) {
  const ZigzagSplit z = zigzag_split(8, 0, 2);
  ASSERT_EQ(z.chunk, 2);
  SequenceShare share{2 * z.chunk, {{z.first, z.chunk + 1}, {z.second, z.chunk + 1}}, {}};
  // Two samples; sample b's token at position p is 100 b + p.
  std::vector<int32_t> tokens;
  for (int32_t b = 0; b < 2; ++b)
    for (const TokenSpan& span : share.spans)
      for (int64_t i = 0; i < span.count; ++i) tokens.push_back(100 * b + int32_t(span.first + i));
  const Qwen3MoeBatch batch = make_batch<Qwen3Moe>(tokens, 2, share, Device::cpu);
  EXPECT_EQ(batch.batch, 2);
  EXPECT_EQ(batch.seq, 4);
  EXPECT_EQ(values(batch.input_ids), (std::vector<int32_t>{0, 1, 6, 7, 100, 101, 106, 107}));
  EXPECT_EQ(values(batch.targets), (std::vector<int32_t>{1, 2, 7, 8, 101, 102, 107, 108}));
  EXPECT_EQ(values(batch.positions), (std::vector<int32_t>{0, 1, 6, 7, 0, 1, 6, 7}));
  EXPECT_EQ(batch.attention, nullptr);  // no ring without a cp group
}

// One process: the whole sequence, positions 0 .. S - 1.
TEST(MakeBatch, WholeSequenceOnOneProcess) {
  SequenceShare share{4, {{0, 5}}, {}};
  const std::vector<int32_t> tokens{10, 11, 12, 13, 14};
  const Qwen3MoeBatch batch = make_batch<Qwen3Moe>(tokens, 1, share, Device::cpu);
  EXPECT_EQ(values(batch.input_ids), (std::vector<int32_t>{10, 11, 12, 13}));
  EXPECT_EQ(values(batch.targets), (std::vector<int32_t>{11, 12, 13, 14}));
  EXPECT_EQ(values(batch.positions), (std::vector<int32_t>{0, 1, 2, 3}));
}

// data.document_mask under cp = 2 over a sequence of 12 (chunks of 3): every rank reads the whole
// sample (13 tokens, eos 0 at positions 1 and 7), so a document that starts on another rank's chunk
// (positions 2-7, across chunks 0, 1 and 2) keeps its positions; position 8 starts one inside chunk 2.
TEST(MakeBatch, DocumentPositionsOfAZigzagShare) {
  std::vector<int32_t> tokens;
  for (int32_t p = 0; p < 13; ++p) tokens.push_back(p == 1 || p == 7 ? 0 : 50 + p);
  const std::vector<std::vector<int32_t>> want_ids = {{50, 0, 52, 59, 60, 61}, {53, 54, 55, 56, 0, 58}};
  const std::vector<std::vector<int32_t>> want_positions = {{0, 1, 0, 1, 2, 3}, {1, 2, 3, 4, 5, 0}};
  for (int rank = 0; rank < 2; ++rank) {
    const ZigzagSplit z = zigzag_split(12, rank, 2);
    SequenceShare share{2 * z.chunk, {{z.first, z.chunk + 1}, {z.second, z.chunk + 1}}, {}, 0};
    ASSERT_TRUE(share.reads().empty());  // the whole sample
    const Qwen3MoeBatch batch = make_batch<Qwen3Moe>(tokens, 1, share, Device::cpu);
    EXPECT_TRUE(batch.documents);
    EXPECT_EQ(values(batch.input_ids), want_ids[size_t(rank)]) << rank;
    EXPECT_EQ(values(batch.positions), want_positions[size_t(rank)]) << rank;
  }
}

}  // namespace
}  // namespace marrow
