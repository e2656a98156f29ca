#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <string>
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

// Partial rotation (Qwen3.5: 64 of 256): the first rotary_dim elements against the rotation
// written out in double with inv_freq_j = theta^(-2j / rotary_dim), bit for bit the full rotation of
// a head of rotary_dim; the rest passed through exactly; in place the same bits.
TEST(Rope, PartialRotatesTheFirstDimsAndPassesTheRest) {
  const int64_t t = 3, h = 2, d = 10, rot = 4;
  std::vector<int32_t> pos = {0, 3, 17};
  Buffer x = random_buffer(DType::f64, {t, h, d}, 1), inplace = random_buffer(DType::f64, {t, h, d}, 1);
  Buffer y(DType::f64, Device::cpu, {t, h, d});
  Buffer head(DType::f64, Device::cpu, {t, h, rot}), head_rotated(DType::f64, Device::cpu, {t, h, rot});
  rope_forward(y, x, positions_tensor(pos), 1e4, rot);
  rope_forward(inplace, inplace, positions_tensor(pos), 1e4, rot);
  for (int64_t row = 0; row < t * h; ++row)
    for (int64_t j = 0; j < rot; ++j) head.ptr<double>()[row * rot + j] = element(x, row * d + j);
  rope_forward(head_rotated, head, positions_tensor(pos), 1e4);
  for (int64_t row = 0; row < t * h; ++row) {
    for (int64_t j = 0; j < rot / 2; ++j) {
      const double angle = pos[row / h] * std::pow(1e4, -2.0 * double(j) / double(rot));
      const double a = element(x, row * d + j), b = element(x, row * d + j + rot / 2);
      EXPECT_NEAR(element(y, row * d + j), a * std::cos(angle) - b * std::sin(angle), 1e-5) << row << " " << j;
      EXPECT_NEAR(element(y, row * d + j + rot / 2), b * std::cos(angle) + a * std::sin(angle), 1e-5) << row << " " << j;
    }
    for (int64_t j = 0; j < rot; ++j) EXPECT_EQ(element(y, row * d + j), element(head_rotated, row * rot + j)) << row << " " << j;
    for (int64_t j = rot; j < d; ++j) EXPECT_EQ(element(y, row * d + j), element(x, row * d + j)) << row << " " << j;
  }
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(element(inplace, i), element(y, i)) << i;
}

// The partial backward is the forward's transpose; at rotary_dim = D both are the theta overloads' bits.
TEST(Rope, PartialBackwardIsTheTransposeAndTheWholeHeadIsTheFullRotation) {
  std::vector<int32_t> pos = {0, 5, 4095, 32767};
  Buffer x = random_buffer(DType::f64, {4, 3, 16}, 1), r = random_buffer(DType::f64, {4, 3, 16}, 2);
  Buffer y(DType::f64, Device::cpu, {4, 3, 16}), dx(DType::f64, Device::cpu, {4, 3, 16});
  rope_forward(y, x, positions_tensor(pos), 1e6, 8);
  rope_backward(dx, r, positions_tensor(pos), 1e6, 8);
  const double forward = testing::weighted_sum(y, r), adjoint = testing::weighted_sum(dx, x);
  EXPECT_NEAR(forward, adjoint, 1e-12 * std::abs(forward));
  Buffer x32 = random_buffer(DType::f32, {4, 3, 16}, 3), a(DType::f32, Device::cpu, {4, 3, 16}), b(DType::f32, Device::cpu, {4, 3, 16});
  rope_forward(a, x32, positions_tensor(pos), 1e6, 16);
  rope_forward(b, x32, positions_tensor(pos), 1e6);
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(element(a, i), element(b, i)) << i;
  rope_backward(a, x32, positions_tensor(pos), 1e6, 16);
  rope_backward(b, x32, positions_tensor(pos), 1e6);
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(element(a, i), element(b, i)) << i;
}

TEST(Rope, RejectsAnOddOrOversizedRotaryDim) {
  std::vector<int32_t> pos = {0, 1, 2};
  Buffer x(DType::f32, Device::cpu, {3, 2, 8});
  auto error = [&](int64_t rot, bool backward) -> std::string {
    try {
      if (backward) rope_backward(x, x, positions_tensor(pos), 1e6, rot);
      else rope_forward(x, x, positions_tensor(pos), 1e6, rot);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error(5, false), "rope_forward: rotary_dim must be even, positive and at most the head_dim of x (8), got 5");
  EXPECT_EQ(error(10, true), "rope_backward: rotary_dim must be even, positive and at most the head_dim of dy (8), got 10");
  EXPECT_EQ(error(0, false), "rope_forward: rotary_dim must be even, positive and at most the head_dim of x (8), got 0");
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

// GPT-OSS's rope_parameters (transformers' GptOssConfig).
RopeParameters gpt_oss_rope() {
  RopeParameters rope;
  rope.theta = 150000.0;
  rope.yarn = true;
  rope.factor = 32.0;
  rope.beta_fast = 32.0;
  rope.beta_slow = 1.0;
  rope.original_max_positions = 4096;
  rope.truncate = false;
  return rope;
}

// YaRN's frequencies written out plainly in double, as the paper states them: pair j keeps the
// default frequency below the correction range, is interpolated (divided by the factor) above it,
// and blends linearly inside it.
std::vector<double> yarn_in_double(int64_t d, const RopeParameters& rope) {
  const double pi = std::acos(-1.0);
  auto pair_turning = [&](double rotations) {
    return d * std::log(rope.original_max_positions / (2 * pi * rotations)) / (2 * std::log(rope.theta));
  };
  double low = pair_turning(rope.beta_fast), high = pair_turning(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(d - 1));
  if (high == low) high += 0.001;
  std::vector<double> inv_freq;
  for (int64_t j = 0; j < d / 2; ++j) {
    const double interpolated = std::clamp((j - low) / (high - low), 0.0, 1.0), base = std::pow(rope.theta, -2.0 * j / d);
    inv_freq.push_back(base * (interpolated / rope.factor + (1 - interpolated)));
  }
  return inv_freq;
}

TEST(RopeYarn, InverseFrequenciesMatchTheFormulaInDouble) {
  struct Case {
    const char* what;
    int64_t d;
    RopeParameters rope;
  };
  RopeParameters truncated = gpt_oss_rope(), qwen_like = gpt_oss_rope(), equal_betas = gpt_oss_rope(), short_context = gpt_oss_rope();
  truncated.truncate = true;
  qwen_like.theta = 1e6, qwen_like.factor = 4, qwen_like.original_max_positions = 32768, qwen_like.truncate = true;
  equal_betas.beta_fast = equal_betas.beta_slow = 2;  // low == high: transformers widens the range by 0.001
  short_context.original_max_positions = 64;          // low below 0, clipped
  for (const Case& c : {Case{"gpt-oss", 64, gpt_oss_rope()}, Case{"truncated", 64, truncated}, Case{"qwen-like", 128, qwen_like},
                        Case{"equal betas", 64, equal_betas}, Case{"short context", 16, short_context}}) {
    const std::vector<float> got = rope_inverse_frequencies(c.d, c.rope);
    const std::vector<double> want = yarn_in_double(c.d, c.rope);
    ASSERT_EQ(got.size(), want.size()) << c.what;
    for (size_t j = 0; j < want.size(); ++j) EXPECT_NEAR(got[j], want[j], 1e-6 * want[j]) << c.what << " j " << j;
  }
}

TEST(RopeYarn, AttentionScalingIsHuggingFacesDefaultUnlessGiven) {
  EXPECT_DOUBLE_EQ(rope_attention_scaling(gpt_oss_rope()), 0.1 * std::log(32.0) + 1);
  RopeParameters given = gpt_oss_rope(), unscaled = gpt_oss_rope();
  given.attention_factor = 0.7;
  unscaled.factor = 1;
  EXPECT_EQ(rope_attention_scaling(given), 0.7);
  EXPECT_EQ(rope_attention_scaling(unscaled), 1.0);
  EXPECT_EQ(rope_attention_scaling(RopeParameters{}), 1.0);
}

// Without yarn the parameters are the theta overloads, bit for bit.
TEST(RopeYarn, DefaultParametersGiveTheThetaOverloadsBits) {
  std::vector<int32_t> pos = {0, 3, 4095, 131071};
  RopeParameters rope;
  rope.theta = 150000.0;
  const std::vector<float> inv_freq = rope_inverse_frequencies(64, rope);
  for (int64_t j = 0; j < 32; ++j) EXPECT_EQ(inv_freq[j], rope_inverse_frequency(j, 64, rope.theta)) << j;
  Buffer x = random_buffer(DType::f32, {4, 2, 64}, 1), a(DType::f32, Device::cpu, {4, 2, 64}), b(DType::f32, Device::cpu, {4, 2, 64});
  rope_forward(a, x, positions_tensor(pos), rope);
  rope_forward(b, x, positions_tensor(pos), rope.theta);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(element(a, i), element(b, i)) << i;
  rope_backward(a, x, positions_tensor(pos), rope);
  rope_backward(b, x, positions_tensor(pos), rope.theta);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(element(a, i), element(b, i)) << i;
}

// With factor 1 the interpolated and default frequencies coincide, so only the float32 rounding of
// the blend, an ulp, separates yarn from the default.
TEST(RopeYarn, FactorOneAndNoScalingIsTheDefault) {
  RopeParameters yarn = gpt_oss_rope();
  yarn.factor = 1;
  yarn.attention_factor = 1;
  const std::vector<float> inv_freq = rope_inverse_frequencies(64, yarn);
  for (int64_t j = 0; j < 32; ++j) {
    const float want = rope_inverse_frequency(j, 64, yarn.theta);
    EXPECT_NEAR(inv_freq[j], want, 2e-7 * want) << j;
  }
  std::vector<int32_t> pos = {0, 7, 100};
  Buffer x = random_buffer(DType::f64, {3, 2, 64}, 1), a(DType::f64, Device::cpu, {3, 2, 64}), b(DType::f64, Device::cpu, {3, 2, 64});
  rope_forward(a, x, positions_tensor(pos), yarn);
  rope_forward(b, x, positions_tensor(pos), yarn.theta);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_NEAR(element(a, i), element(b, i), 1e-6) << i;
}

// x = [1, ..., 1, 0, ..., 0] comes out as the scaled cosines and sines, each cos(angle) * scale in
// float32 as transformers' GptOssRotaryEmbedding computes them.
TEST(RopeYarn, ScalesCosAndSinByTheAttentionFactor) {
  const int64_t d = 64;
  std::vector<int32_t> pos = {1, 4096, 131071};
  Buffer x = Buffer::zeros(DType::f32, Device::cpu, {3, 1, d}), y(DType::f32, Device::cpu, {3, 1, d});
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t j = 0; j < d / 2; ++j) x.ptr<float>()[t * d + j] = 1;
  rope_forward(y, x, positions_tensor(pos), gpt_oss_rope());
  const std::vector<float> inv_freq = rope_inverse_frequencies(d, gpt_oss_rope());
  const float scale = float(rope_attention_scaling(gpt_oss_rope()));
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t j = 0; j < d / 2; ++j) {
      const float angle = float(pos[t]) * inv_freq[j];
      EXPECT_EQ(element(y, t * d + j), std::cos(angle) * scale) << t << " " << j;
      EXPECT_EQ(element(y, t * d + d / 2 + j), std::sin(angle) * scale) << t << " " << j;
    }
}

// The backward is the forward's transpose: sum(r * forward(x)) = sum(backward(r) * x).
TEST(RopeYarn, BackwardIsTheAdjointOfTheForward) {
  std::vector<int32_t> pos = {0, 5, 4095, 20000, 131071};
  Buffer x = random_buffer(DType::f64, {5, 3, 64}, 1), r = random_buffer(DType::f64, {5, 3, 64}, 2);
  Buffer y(DType::f64, Device::cpu, {5, 3, 64}), dx(DType::f64, Device::cpu, {5, 3, 64});
  rope_forward(y, x, positions_tensor(pos), gpt_oss_rope());
  rope_backward(dx, r, positions_tensor(pos), gpt_oss_rope());
  const double forward = testing::weighted_sum(y, r), adjoint = testing::weighted_sum(dx, x);
  EXPECT_NEAR(forward, adjoint, 1e-12 * std::abs(forward));
}

TEST(RopeYarn, RejectsBadParametersAndGpuDtypes) {
  std::vector<int32_t> pos = {0, 1};
  Buffer x(DType::f32, Device::cpu, {2, 1, 8});
  RopeParameters no_factor = gpt_oss_rope();
  no_factor.factor = 0;
  try {
    rope_forward(x, x, positions_tensor(pos), no_factor);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_forward: the yarn factor must be positive, got 0");
  }
  try {
    rope_inverse_frequencies(8, RopeParameters{gpt_oss_rope().theta, true});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_inverse_frequencies: yarn's original_max_positions must be positive, got 0");
  }
  // The checks come before anything reads the data, so a host pointer stands in for GPU memory.
  Tensor on_gpu(x.ptr<float>(), DType::f32, Device::cuda, {2, 1, 8});
  int32_t gpu_positions[2] = {0, 1};
  try {
    rope_backward(on_gpu, on_gpu, Tensor(gpu_positions, DType::i32, Device::cuda, {2}), gpt_oss_rope());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_backward: dy has dtype f32 but expected bf16");
  }
}

}  // namespace
}  // namespace marrow
