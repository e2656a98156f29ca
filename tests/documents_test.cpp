// Packed documents (data.document_mask): a row holding several documents, RoPE at their restarted
// positions and attention with the document mask, equals each document run alone through RoPE and
// attention (logits' inputs and every gradient), with GPT-OSS's sinks and window too; the data
// side's positions restart after each eos.
#include <gtest/gtest.h>

#include <vector>

#include "data/dataset.h"
#include "gradcheck.h"
#include "ops/attention.h"
#include "ops/rope.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

constexpr int64_t kHeads = 4, kKvHeads = 2, kDim = 8;
constexpr double kTheta = 10000;
constexpr int32_t kEos = 7;

// RoPE at `positions` [T] on q [B, S, Hq, D] and k, attention with the variant, and the backward of
// dout through both: out, lse and the gradients of the inputs before RoPE.
struct Result {
  Buffer out, lse, dq, dk, dv, dsinks;
};
Result rope_attention(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor positions, const AttentionVariant& variant) {
  const int64_t B = q.size(0), S = q.size(1), T = B * S;
  auto like = [](const Tensor& t) { return Buffer(DType::f64, Device::cpu, {t.size(0), t.size(1), t.size(2), t.size(3)}); };
  Buffer qr = like(q), kr = like(k), dqr = like(q), dkr = like(k);
  rope_forward(qr.view().reshape({T, kHeads, kDim}), q.reshape({T, kHeads, kDim}), positions, kTheta);
  rope_forward(kr.view().reshape({T, kKvHeads, kDim}), k.reshape({T, kKvHeads, kDim}), positions, kTheta);
  Result r{like(dout), Buffer(DType::f64, Device::cpu, {B, kHeads, S}), like(q), like(k), like(v), Buffer::zeros(DType::f64, Device::cpu, {kHeads})};
  attention_forward(r.out, r.lse, qr, kr, v, variant);
  attention_backward(dqr, dkr, r.dv, variant.sinks.data ? r.dsinks.view() : Tensor{}, dout, qr, kr, v, r.out, r.lse, variant);
  rope_backward(r.dq.view().reshape({T, kHeads, kDim}), dqr.view().reshape({T, kHeads, kDim}), positions, kTheta);
  rope_backward(r.dk.view().reshape({T, kKvHeads, kDim}), dkr.view().reshape({T, kKvHeads, kDim}), positions, kTheta);
  return r;
}

// Rows [first, first + count) of batch row b of t [B, S, ...] as [1, count, ...].
Tensor document(Tensor t, int64_t b, int64_t first, int64_t count) {
  const int64_t S = t.size(0) * t.size(1), row = t.numel() / S, at = b * t.size(1) + first;
  return t.reshape({S, row}).rows(at, at + count).reshape({1, count, t.size(2), t.size(3)});
}

// Row b's tokens: documents of the given lengths, each ending with kEos (the last one cut off).
std::vector<int32_t> packed_tokens(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> tokens;
  for (const int64_t n : lengths)
    for (int64_t i = 0; i < n; ++i) tokens.push_back(i + 1 == n ? kEos : int32_t(10 + i));
  tokens.back() = 3;
  return tokens;
}

void expect_rows_equal(const char* what, const Tensor& packed, const Tensor& alone) {
  for (int64_t i = 0; i < alone.numel(); ++i) ASSERT_NEAR(element(packed, i), element(alone, i), 1e-12) << what << " " << i;
}

// Three documents of odd lengths per row (different splits in the two rows), plain and with a
// window shorter than a document plus sinks.
TEST(PackedDocuments, AttentionEqualsEachDocumentAlone) {
  const std::vector<std::vector<int64_t>> rows = {{5, 3, 7}, {1, 9, 5}};
  const int64_t B = 2, S = 15;
  const Buffer q = random_buffer(DType::f64, {B, S, kHeads, kDim}, 1), k = random_buffer(DType::f64, {B, S, kKvHeads, kDim}, 2),
               v = random_buffer(DType::f64, {B, S, kKvHeads, kDim}, 3), dout = random_buffer(DType::f64, {B, S, kHeads, kDim}, 4),
               sinks = random_buffer(DType::f64, {kHeads}, 5);
  Buffer positions(DType::i32, Device::cpu, {B, S});
  for (int64_t b = 0; b < B; ++b) document_positions(positions.ptr<int32_t>() + b * S, packed_tokens(rows[size_t(b)]).data(), S, kEos);
  for (const AttentionVariant& plain : {AttentionVariant{}, AttentionVariant{sinks, 3}}) {
    AttentionVariant masked = plain;
    masked.documents = positions;
    const Result packed = rope_attention(q, k, v, dout, positions.view().reshape({B * S}), masked);
    Buffer dsinks = Buffer::zeros(DType::f64, Device::cpu, {kHeads});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t first = 0; const int64_t n : rows[size_t(b)]) {
        Buffer at(DType::i32, Device::cpu, {n});
        for (int64_t i = 0; i < n; ++i) at.ptr<int32_t>()[i] = int32_t(i);
        ASSERT_EQ(positions.ptr<int32_t>()[b * S + first + n - 1], n - 1);
        const Result alone = rope_attention(document(q, b, first, n), document(k, b, first, n), document(v, b, first, n),
                                            document(dout, b, first, n), at, plain);
        expect_rows_equal("out", document(packed.out, b, first, n), alone.out);
        expect_rows_equal("dq", document(packed.dq, b, first, n), alone.dq);
        expect_rows_equal("dk", document(packed.dk, b, first, n), alone.dk);
        expect_rows_equal("dv", document(packed.dv, b, first, n), alone.dv);
        for (int64_t h = 0; h < kHeads; ++h) {
          dsinks.ptr<double>()[h] += element(alone.dsinks, h);
          for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(element(packed.lse, (b * kHeads + h) * S + first + i), element(alone.lse, h * n + i), 1e-12);
        }
        first += n;
      }
    expect_rows_equal("dsinks", packed.dsinks, dsinks);
  }
}

TEST(PackedDocuments, PositionsRestartAfterEachEos) {
  const std::vector<int32_t> tokens = {kEos, 4, 5, kEos, kEos, 6, 8};
  std::vector<int32_t> positions(tokens.size());
  document_positions(positions.data(), tokens.data(), int64_t(tokens.size()), kEos);
  EXPECT_EQ(positions, (std::vector<int32_t>{0, 0, 1, 2, 0, 0, 1}));
}

TEST(PackedDocuments, RejectsBadDocuments) {
  const Buffer q = random_buffer(DType::f32, {1, 4, kHeads, kDim}, 1), k = random_buffer(DType::f32, {1, 4, kKvHeads, kDim}, 2);
  Buffer out(DType::f32, Device::cpu, {1, 4, kHeads, kDim}), lse(DType::f32, Device::cpu, {1, kHeads, 4});
  const Buffer short_documents = Buffer::zeros(DType::i32, Device::cpu, {1, 3}), f32_documents = Buffer::zeros(DType::f32, Device::cpu, {1, 4});
  auto message = [&](const Buffer& documents) {
    try {
      attention_forward(out, lse, q, k, k, {.documents = documents});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(short_documents), "attention_forward: documents has shape [1, 3] but expected [1, 4]");
  EXPECT_EQ(message(f32_documents), "attention_forward: documents has dtype f32 but expected i32");
}

}  // namespace
}  // namespace marrow
