#include "ops/cross_entropy.h"

#include <cmath>
#include <vector>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

Tensor targets_tensor(std::vector<int32_t>& t) {
  return Tensor(t.data(), DType::i32, Device::cpu, {int64_t(t.size())});
}

TEST(CrossEntropy, UniformLogitsGiveLogV) {
  const int64_t n = 3, vocab = 10;
  std::vector<double> logits(n * vocab, 3.7);
  std::vector<int32_t> targets = {0, 9, 4};
  double loss[n], lse[n];
  cross_entropy_forward(Tensor(loss, DType::f64, Device::cpu, {n}), Tensor(lse, DType::f64, Device::cpu, {n}),
                        Tensor(logits.data(), DType::f64, Device::cpu, {n, vocab}), targets_tensor(targets));
  for (int64_t t = 0; t < n; ++t) {
    EXPECT_NEAR(loss[t], std::log(10.0), 1e-14);
    EXPECT_NEAR(lse[t], 3.7 + std::log(10.0), 1e-14);
  }
}

// Logits log(1, 2, 3): softmax = (1, 2, 3) / 6.
TEST(CrossEntropy, HandComputedRow) {
  double logits[3] = {0, std::log(2.0), std::log(3.0)}, loss[1], lse[1], dlogits[3];
  std::vector<int32_t> targets = {1};
  Tensor tl(logits, DType::f64, Device::cpu, {1, 3}), tlse(lse, DType::f64, Device::cpu, {1});
  cross_entropy_forward(Tensor(loss, DType::f64, Device::cpu, {1}), tlse, tl, targets_tensor(targets));
  EXPECT_NEAR(loss[0], std::log(3.0), 1e-14);
  EXPECT_NEAR(lse[0], std::log(6.0), 1e-14);
  cross_entropy_backward(Tensor(dlogits, DType::f64, Device::cpu, {1, 3}), tl, tlse, targets_tensor(targets), 0.5);
  EXPECT_NEAR(dlogits[0], 0.5 / 6, 1e-15);
  EXPECT_NEAR(dlogits[1], 0.5 * (2.0 / 6 - 1), 1e-15);
  EXPECT_NEAR(dlogits[2], 0.5 * 3 / 6, 1e-15);
}

TEST(CrossEntropy, IgnoredRowsGiveZeroLossAndGradient) {
  std::vector<int32_t> targets = {kIgnoreIndex, 2, kIgnoreIndex};
  Buffer logits = random_buffer(DType::f32, {3, 5}, 1), loss(DType::f32, Device::cpu, {3}),
         lse(DType::f32, Device::cpu, {3});
  Buffer dlogits = random_buffer(DType::f32, {3, 5}, 2);
  cross_entropy_forward(loss, lse, logits, targets_tensor(targets));
  cross_entropy_backward(dlogits, logits, lse, targets_tensor(targets), 1.0);
  EXPECT_EQ(element(loss, 0), 0);
  EXPECT_EQ(element(loss, 2), 0);
  EXPECT_GT(element(loss, 1), 0);
  for (int64_t v = 0; v < 5; ++v) {
    EXPECT_EQ(element(dlogits, v), 0) << v;
    EXPECT_EQ(element(dlogits, 10 + v), 0) << v;
  }
}

TEST(CrossEntropy, LargeLogitsDoNotOverflow) {
  float logits[2] = {1000, 1000 + std::log(3.0f)}, loss[1], lse[1];
  std::vector<int32_t> targets = {1};
  cross_entropy_forward(Tensor(loss, DType::f32, Device::cpu, {1}), Tensor(lse, DType::f32, Device::cpu, {1}),
                        Tensor(logits, DType::f32, Device::cpu, {1, 2}), targets_tensor(targets));
  EXPECT_NEAR(loss[0], std::log(4.0 / 3.0), 1e-4);
}

TEST(CrossEntropy, GradientsMatchFiniteDifferences) {
  struct Case {
    std::vector<int32_t> targets;
    int64_t vocab;
  };
  // An ignored row among odd sizes; one token; a vocabulary of one.
  for (Case c : {Case{{3, kIgnoreIndex, 0, 6, 6, 2}, 7}, Case{{4}, 5}, Case{{0, 0}, 1}}) {
    const int64_t n = int64_t(c.targets.size());
    const double scale = 0.3;
    Buffer logits = random_buffer(DType::f64, {n, c.vocab}, 1, 2.0), loss(DType::f64, Device::cpu, {n}),
           lse(DType::f64, Device::cpu, {n}), dlogits(DType::f64, Device::cpu, {n, c.vocab});
    Buffer weights(DType::f64, Device::cpu, {n});
    for (int64_t t = 0; t < n; ++t) weights.ptr<double>()[t] = scale;
    auto total = [&] {
      cross_entropy_forward(loss, lse, logits, targets_tensor(c.targets));
      return testing::weighted_sum(loss, weights);
    };
    total();
    cross_entropy_backward(dlogits, logits, lse, targets_tensor(c.targets), scale);
    testing::expect_gradient("dlogits", logits, dlogits, total);
  }
}

TEST(CrossEntropy, BackwardInPlaceMatchesOutOfPlace) {
  std::vector<int32_t> targets = {1, kIgnoreIndex, 8};
  Buffer logits = random_buffer(DType::f32, {3, 9}, 1), loss(DType::f32, Device::cpu, {3}),
         lse(DType::f32, Device::cpu, {3});
  Buffer dlogits(DType::f32, Device::cpu, {3, 9});
  cross_entropy_forward(loss, lse, logits, targets_tensor(targets));
  cross_entropy_backward(dlogits, logits, lse, targets_tensor(targets), 0.25);
  cross_entropy_backward(logits, logits, lse, targets_tensor(targets), 0.25);
  for (int64_t i = 0; i < logits.numel(); ++i) EXPECT_EQ(element(logits, i), element(dlogits, i)) << i;
}

TEST(CrossEntropy, F32MatchesF64) {
  const int64_t n = 5, vocab = 1000;
  std::vector<int32_t> targets = {0, 999, kIgnoreIndex, 500, 17};
  auto run = [&](DType t, Buffer& loss, Buffer& lse, Buffer& logits) {
    logits = random_buffer(t, {n, vocab}, 1, 4.0);
    loss = Buffer(t, Device::cpu, {n});
    lse = Buffer(t, Device::cpu, {n});
    cross_entropy_forward(loss, lse, logits, targets_tensor(targets));
    cross_entropy_backward(logits, logits, lse, targets_tensor(targets), 1.0 / 4);
  };
  Buffer loss32, lse32, d32, loss64, lse64, d64;
  run(DType::f32, loss32, lse32, d32);
  run(DType::f64, loss64, lse64, d64);
  for (int64_t t = 0; t < n; ++t) {
    EXPECT_NEAR(element(loss32, t), element(loss64, t), 1e-5) << t;
    EXPECT_NEAR(element(lse32, t), element(lse64, t), 1e-5) << t;
  }
  for (int64_t i = 0; i < d32.numel(); ++i) ASSERT_NEAR(element(d32, i), element(d64, i), 1e-6) << i;
}

TEST(CrossEntropy, RejectsBadTargetsAndShapes) {
  Buffer logits(DType::f32, Device::cpu, {3, 7}), loss(DType::f32, Device::cpu, {3}), lse(DType::f32, Device::cpu, {3});
  std::vector<int32_t> targets = {0, kIgnoreIndex, 7};
  try {
    cross_entropy_forward(loss, lse, logits, targets_tensor(targets));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_forward: target 7 at position 2 is outside the vocabulary [0, 7) and is not the ignore "
                 "index -100");
  }
  targets = {0, -1, 0};
  try {
    cross_entropy_backward(logits, logits, lse, targets_tensor(targets), 1.0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_backward: target -1 at position 1 is outside the vocabulary [0, 7) and is not the "
                 "ignore index -100");
  }
  Buffer short_lse(DType::f32, Device::cpu, {2});
  targets = {0, 1, 2};
  try {
    cross_entropy_forward(loss, short_lse, logits, targets_tensor(targets));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "cross_entropy_forward: lse has shape [2] but expected [3]");
  }
}

}  // namespace
}  // namespace marrow
