#include "ops/rope.h"

#include <cmath>
#include <vector>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

Tensor positions_tensor(std::vector<int32_t>& p) {
  return Tensor(p.data(), DType::i32, Device::cpu, {int64_t(p.size())});
}

TEST(Rope, PositionZeroIsIdentity) {
  std::vector<int32_t> pos = {0, 0};
  Buffer x = random_buffer(DType::f32, {2, 3, 8}, 1), y(DType::f32, Device::cpu, {2, 3, 8});
  rope_forward(y, x, positions_tensor(pos), 10000.0);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(element(y, i), element(x, i)) << i;
}

// With D = 2 there is one pair, inv_freq = 1 and the angle is the position itself.
TEST(Rope, SinglePairRotatesByThePosition) {
  std::vector<int32_t> pos = {1};
  double x[2] = {1, 2}, y[2];
  rope_forward(Tensor(y, DType::f64, Device::cpu, {1, 1, 2}), Tensor(x, DType::f64, Device::cpu, {1, 1, 2}),
               positions_tensor(pos), 1e6);
  EXPECT_NEAR(y[0], std::cos(1.0) - 2 * std::sin(1.0), 1e-7);
  EXPECT_NEAR(y[1], 2 * std::cos(1.0) + std::sin(1.0), 1e-7);
}

// cos and sin are float32 values, as in transformers, so the rotation is orthogonal only to float32
// precision even in f64.
TEST(Rope, PreservesTheNormOfEveryPair) {
  const int64_t t = 3, h = 2, d = 10;
  std::vector<int32_t> pos = {5, 100, 40000};
  Buffer x = random_buffer(DType::f64, {t, h, d}, 1), y(DType::f64, Device::cpu, {t, h, d});
  rope_forward(y, x, positions_tensor(pos), 1e6);
  for (int64_t row = 0; row < t * h; ++row)
    for (int64_t j = 0; j < d / 2; ++j) {
      auto norm = [&](const Tensor& z) { return std::hypot(element(z, row * d + j), element(z, row * d + j + d / 2)); };
      EXPECT_NEAR(norm(y), norm(x), 1e-6 * norm(x)) << row << " " << j;
    }
}

// x = [1, ..., 1, 0, ..., 0] comes out as [cos_0 .. cos_{D/2-1}, sin_0 .. sin_{D/2-1}]. The values
// are transformers' Qwen3RotaryEmbedding (D = 128, theta = 1e6) in float32; at position 32767 an
// angle computed in double precision misses them by up to ~1e-4.
TEST(Rope, MatchesHuggingFaceFloat32Angles) {
  const int64_t d = 128;
  std::vector<int32_t> pos = {3, 32767};
  Buffer x = Buffer::zeros(DType::f64, Device::cpu, {2, 1, d}), y(DType::f64, Device::cpu, {2, 1, d});
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t j = 0; j < d / 2; ++j) x.ptr<double>()[t * d + j] = 1;
  rope_forward(y, x, positions_tensor(pos), 1e6);
  struct Want {
    int64_t token, j;
    double cos, sin;
  };
  for (Want w :
       {Want{0, 0, -0.9899924993515015, 0.14112000167369843}, Want{0, 1, -0.7491185069084167, 0.6624360084533691},
        Want{0, 63, 1.0, 3.7228132896416355e-06}, Want{1, 0, 0.9822633266448975, 0.1875065565109253},
        Want{1, 1, -0.9984877109527588, 0.05497569218277931}, Want{1, 10, 0.17320573329925537, 0.9848856925964355},
        Want{1, 40, 0.8976901769638062, -0.44062718749046326}, Want{1, 63, 0.9991734027862549, 0.04065060243010521}}) {
    EXPECT_NEAR(element(y, w.token * d + w.j), w.cos, 2e-7) << w.token << " " << w.j;
    EXPECT_NEAR(element(y, w.token * d + w.j + d / 2), w.sin, 2e-7) << w.token << " " << w.j;
  }
}

TEST(Rope, GradientsMatchFiniteDifferences) {
  struct Case {
    std::vector<int32_t> pos;
    int64_t heads, d;
  };
  for (Case c : {Case{{0, 5, 17, 1000}, 3, 6}, Case{{7}, 1, 2}, Case{{2, 1, 9}, 2, 16}}) {
    const int64_t t = int64_t(c.pos.size());
    Buffer x = random_buffer(DType::f64, {t, c.heads, c.d}, 1), r = random_buffer(DType::f64, {t, c.heads, c.d}, 2);
    Buffer y(DType::f64, Device::cpu, {t, c.heads, c.d}), dx(DType::f64, Device::cpu, {t, c.heads, c.d});
    auto loss = [&] {
      rope_forward(y, x, positions_tensor(c.pos), 10000.0);
      return testing::weighted_sum(y, r);
    };
    rope_backward(dx, r, positions_tensor(c.pos), 10000.0);
    testing::expect_gradient("dx", x, dx, loss);
  }
}

// The backward undoes the forward up to the float32 rounding of cos and sin.
TEST(Rope, InPlaceMatchesOutOfPlaceAndBackwardUndoesForward) {
  std::vector<int32_t> pos = {3, 0, 250};
  Buffer x = random_buffer(DType::f64, {3, 2, 8}, 1), y(DType::f64, Device::cpu, {3, 2, 8}),
         inplace = random_buffer(DType::f64, {3, 2, 8}, 1);
  rope_forward(y, x, positions_tensor(pos), 10000.0);
  rope_forward(inplace, inplace, positions_tensor(pos), 10000.0);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(element(inplace, i), element(y, i)) << i;
  rope_backward(inplace, inplace, positions_tensor(pos), 10000.0);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_NEAR(element(inplace, i), element(x, i), 1e-6) << i;
}

TEST(Rope, F32MatchesF64) {
  std::vector<int32_t> pos = {0, 1, 4095, 32767};
  Buffer x32 = random_buffer(DType::f32, {4, 3, 64}, 1), x64 = random_buffer(DType::f64, {4, 3, 64}, 1);
  Buffer y32(DType::f32, Device::cpu, {4, 3, 64}), y64(DType::f64, Device::cpu, {4, 3, 64});
  rope_forward(y32, x32, positions_tensor(pos), 1e6);
  rope_forward(y64, x64, positions_tensor(pos), 1e6);
  for (int64_t i = 0; i < y32.numel(); ++i) ASSERT_NEAR(element(y32, i), element(y64, i), 1e-6) << i;
  rope_backward(y32, x32, positions_tensor(pos), 1e6);
  rope_backward(y64, x64, positions_tensor(pos), 1e6);
  for (int64_t i = 0; i < y32.numel(); ++i) ASSERT_NEAR(element(y32, i), element(y64, i), 1e-6) << i;
}

TEST(Rope, RejectsOddHeadDimAndMismatchedPositions) {
  std::vector<int32_t> pos = {0, 1, 2};
  Buffer x(DType::f32, Device::cpu, {3, 2, 5});
  try {
    rope_forward(x, x, positions_tensor(pos), 1e6);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_forward: head_dim of x must be even, got 5");
  }
  Buffer dy(DType::f32, Device::cpu, {4, 2, 8}), dx(DType::f32, Device::cpu, {4, 2, 8});
  try {
    rope_backward(dx, dy, positions_tensor(pos), 1e6);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_backward: positions has shape [3] but expected [4]");
  }
}

// The table holds the cosine and sine the rotation uses: rotating x = (1, 0) pairs by rope_forward
// gives (cos, sin) of each angle, in f32.
TEST(RopeCosSinTable, HoldsTheRotationsCosinesAndSines) {
  const int64_t t = 3, d = 8;
  std::vector<int32_t> pos = {0, 7, 40000};
  Buffer table(DType::f32, Device::cpu, {t, d / 2, 2});
  rope_cos_sin_table(table, positions_tensor(pos), d, 1e6);
  Buffer x(DType::f32, Device::cpu, {t, 1, d}), y(DType::f32, Device::cpu, {t, 1, d});
  for (int64_t i = 0; i < x.numel(); ++i) x.ptr<float>()[i] = i % d < d / 2 ? 1.0f : 0.0f;
  rope_forward(y, x, positions_tensor(pos), 1e6);
  for (int64_t r = 0; r < t; ++r)
    for (int64_t j = 0; j < d / 2; ++j) {
      EXPECT_EQ(element(table, 2 * (r * d / 2 + j)), element(y, r * d + j)) << r << " " << j;
      EXPECT_EQ(element(table, 2 * (r * d / 2 + j) + 1), element(y, r * d + d / 2 + j)) << r << " " << j;
    }
}

TEST(RopeCosSinTable, RejectsAnOddHeadDimAndAWrongShape) {
  std::vector<int32_t> pos = {0, 1, 2};
  Buffer table(DType::f32, Device::cpu, {3, 4, 2});
  try {
    rope_cos_sin_table(table, positions_tensor(pos), 7, 1e6);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_cos_sin_table: head_dim must be even and positive, got 7");
  }
  try {
    rope_cos_sin_table(table, positions_tensor(pos), 16, 1e6);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_cos_sin_table: table has shape [3, 4, 2] but expected [3, 8, 2]");
  }
}

}  // namespace
}  // namespace marrow
