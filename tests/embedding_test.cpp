#include "ops/embedding.h"

#include <cstring>

#include <vector>

#include "gradcheck.h"
#include "ops/known_zero.h"

namespace marrow {
namespace {

using testing::random_buffer;

Tensor ids_tensor(std::vector<int32_t>& ids) {
  return Tensor(ids.data(), DType::i32, Device::cpu, {int64_t(ids.size())});
}

TEST(Embedding, ForwardCopiesRows) {
  float table[6] = {1, 2, 3, 4, 5, 6}, out[6];
  std::vector<int32_t> ids = {2, 0, 2};
  embedding_forward(Tensor(out, DType::f32, Device::cpu, {3, 2}), ids_tensor(ids),
                    Tensor(table, DType::f32, Device::cpu, {3, 2}));
  const float want[6] = {5, 6, 1, 2, 5, 6};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], want[i]) << i;
}

// The row flags of ops/known_zero.h: a restart zeroes the rows written since the last one (and
// only those: a flagged row holds its zeros already, so garbage planted there stays), then flags
// every row; a backward clears the flags of the rows it adds to and computes what it computes
// without flags.
TEST(Embedding, KnownZeroRowsRestartAndClear) {
  const int64_t V = 6, H = 3;
  Buffer dtable = testing::random_buffer(DType::f32, {V, H}, 3), plain = Buffer::zeros(DType::f32, Device::cpu, {V, H});
  int32_t flags[V] = {0, 1, 0, 1, 0, 0};
  for (int64_t v = 0; v < V; ++v)
    for (int64_t c = 0; c < H; ++c)
      if (flags[v]) dtable.ptr<float>()[v * H + c] = 0.0f;  // what a flag says
  dtable.ptr<float>()[1 * H] = 7.0f;  // flagged: left alone, so a zeroed flagged row would show
  restart_known_zero(dtable, Tensor(flags, DType::i32, Device::cpu, {V}));
  for (int64_t v = 0; v < V; ++v) {
    EXPECT_EQ(flags[v], 1) << v;
    for (int64_t c = 0; c < H; ++c) EXPECT_EQ(dtable.ptr<float>()[v * H + c], v == 1 && c == 0 ? 7.0f : 0.0f) << v << " " << c;
  }
  dtable.ptr<float>()[1 * H] = 0.0f;
  std::vector<int32_t> ids = {4, 2, 4};
  Buffer dout = testing::random_buffer(DType::f32, {3, H}, 4);
  embedding_backward(dtable, dout, ids_tensor(ids), Tensor(flags, DType::i32, Device::cpu, {V}));
  embedding_backward(plain, dout, ids_tensor(ids));
  const int32_t want[V] = {1, 1, 0, 1, 0, 1};
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(flags[v], want[v]) << v;
  EXPECT_EQ(std::memcmp(dtable.view().data, plain.view().data, dtable.view().bytes()), 0);
}

TEST(Embedding, KnownZeroFlagsOfAnotherVocabularyAreAnError) {
  float dtable[6] = {}, dout[2] = {};
  int32_t flags[2] = {};
  std::vector<int32_t> ids = {1};
  try {
    embedding_backward(Tensor(dtable, DType::f32, Device::cpu, {3, 2}), Tensor(dout, DType::f32, Device::cpu, {1, 2}), ids_tensor(ids),
                       Tensor(flags, DType::i32, Device::cpu, {2}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "embedding_backward: known_zero has shape [2] but expected [3]");
  }
}

TEST(Embedding, GradientsMatchFiniteDifferences) {
  // Repeated ids with odd sizes; one token with one hidden unit; one id used twice.
  struct Case {
    std::vector<int32_t> ids;
    int64_t vocab, hidden;
  };
  for (Case c : {Case{{3, 0, 6, 3, 3, 1, 6, 2, 5}, 7, 5}, Case{{0}, 1, 1}, Case{{1, 1}, 3, 4}}) {
    const int64_t n = int64_t(c.ids.size());
    Buffer table = random_buffer(DType::f64, {c.vocab, c.hidden}, 1), r = random_buffer(DType::f64, {n, c.hidden}, 2);
    Buffer out(DType::f64, Device::cpu, {n, c.hidden}),
        dtable = Buffer::zeros(DType::f64, Device::cpu, {c.vocab, c.hidden});
    auto loss = [&] {
      embedding_forward(out, ids_tensor(c.ids), table);
      return testing::weighted_sum(out, r);
    };
    embedding_backward(dtable, r, ids_tensor(c.ids));
    testing::expect_gradient("dtable", table, dtable, loss);
  }
}

TEST(Embedding, BackwardAccumulates) {
  float dtable[6] = {1, 1, 1, 1, 1, 1}, dout[4] = {0.5f, 2, 4, 8};
  std::vector<int32_t> ids = {1, 1};
  embedding_backward(Tensor(dtable, DType::f32, Device::cpu, {3, 2}), Tensor(dout, DType::f32, Device::cpu, {2, 2}),
                     ids_tensor(ids));
  const float want[6] = {1, 1, 5.5f, 11, 1, 1};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(dtable[i], want[i]) << i;
}

TEST(Embedding, F32MatchesF64) {
  std::vector<int32_t> ids = {4, 0, 9, 4};
  Buffer t32 = random_buffer(DType::f32, {10, 3}, 1), t64 = random_buffer(DType::f64, {10, 3}, 1);
  Buffer o32(DType::f32, Device::cpu, {4, 3}), o64(DType::f64, Device::cpu, {4, 3});
  embedding_forward(o32, ids_tensor(ids), t32);
  embedding_forward(o64, ids_tensor(ids), t64);
  for (int64_t i = 0; i < o32.numel(); ++i) EXPECT_EQ(testing::element(o32, i), testing::element(o64, i)) << i;
}

TEST(Embedding, RejectsIdOutsideVocabulary) {
  Buffer table(DType::f32, Device::cpu, {4, 2}), out(DType::f32, Device::cpu, {3, 2});
  std::vector<int32_t> ids = {0, 4, 1};
  try {
    embedding_forward(out, ids_tensor(ids), table);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "embedding_forward: id 4 at position 1 is outside the vocabulary [0, 4)");
  }
  ids = {-1, 0, 0};
  try {
    embedding_backward(table, out, ids_tensor(ids));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "embedding_backward: id -1 at position 0 is outside the vocabulary [0, 4)");
  }
}

TEST(Embedding, RejectsMismatchedShapesAndDtypes) {
  Buffer table(DType::f32, Device::cpu, {4, 5}), out(DType::f32, Device::cpu, {3, 4}),
      fids(DType::f32, Device::cpu, {3});
  std::vector<int32_t> ids = {0, 1, 2};
  try {
    embedding_forward(out, ids_tensor(ids), table);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "embedding_forward: out has shape [3, 4] but expected [3, 5]");
  }
  Buffer out5(DType::f32, Device::cpu, {3, 5});
  try {
    embedding_forward(out5, fids, table);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "embedding_forward: ids has dtype f32 but expected i32");
  }
}

}  // namespace
}  // namespace marrow
