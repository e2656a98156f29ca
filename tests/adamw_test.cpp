#include "ops/adamw.h"

#include <cmath>
#include <cstring>

#include "core/bf16.h"
#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

Tensor host(double* data, int64_t n) { return Tensor(data, DType::f64, Device::cpu, {n}); }

TEST(AdamW, TwoStepsMatchHandComputedNumbers) {
  double param[1] = {1}, grad[1] = {0.5}, m[1] = {0}, v[1] = {0};
  AdamWHyper hp{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = 1};
  adamw_step(host(param, 1), {}, host(m, 1), host(v, 1), host(grad, 1), hp);
  // m = 0.1 * 0.5, v = 0.001 * 0.25; bias-corrected they are exactly g and g^2, so the update is
  // lr * 0.5 / (0.5 + eps), after the decay 1 - lr * wd = 0.999.
  EXPECT_NEAR(m[0], 0.05, 1e-15);
  EXPECT_NEAR(v[0], 0.00025, 1e-15);
  const double update = 0.1 * 0.5 / (0.5 + 1e-8);
  EXPECT_NEAR(param[0], 0.999 - update, 1e-14);
  EXPECT_NEAR(param[0], 0.899000002, 1e-14);

  // A constant gradient keeps the bias-corrected moments at g and g^2 on every step.
  hp.step = 2;
  adamw_step(host(param, 1), {}, host(m, 1), host(v, 1), host(grad, 1), hp);
  EXPECT_NEAR(m[0], 0.095, 1e-15);
  EXPECT_NEAR(v[0], 0.00049975, 1e-15);
  EXPECT_NEAR(param[0], 0.899000002 * 0.999 - update, 1e-14);
}

TEST(AdamW, NoDecayWhenWeightDecayIsZero) {
  // A zero gradient leaves zero moments and a zero Adam update, so only the decay can move param.
  double param[2] = {1.5, -2}, grad[2] = {0, 0}, m[2] = {0, 0}, v[2] = {0, 0};
  AdamWHyper hp{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1};
  adamw_step(host(param, 2), {}, host(m, 2), host(v, 2), host(grad, 2), hp);
  EXPECT_EQ(param[0], 1.5);
  EXPECT_EQ(param[1], -2);
  hp.weight_decay = 0.5;
  adamw_step(host(param, 2), {}, host(m, 2), host(v, 2), host(grad, 2), hp);
  EXPECT_DOUBLE_EQ(param[0], 1.5 * 0.95);
  EXPECT_DOUBLE_EQ(param[1], -2 * 0.95);
}

TEST(AdamW, F32PathMatchesF64) {
  const int64_t n = 50;
  Buffer p64 = random_buffer(DType::f64, {n}, 1), p32 = random_buffer(DType::f32, {n}, 1);
  Buffer m64 = Buffer::zeros(DType::f64, Device::cpu, {n}), v64 = Buffer::zeros(DType::f64, Device::cpu, {n});
  Buffer m32 = Buffer::zeros(DType::f32, Device::cpu, {n}), v32 = Buffer::zeros(DType::f32, Device::cpu, {n});
  for (int64_t step = 1; step <= 5; ++step) {
    Buffer g64 = random_buffer(DType::f64, {n}, 10 + step), g32 = random_buffer(DType::f32, {n}, 10 + step);
    AdamWHyper hp{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step};
    adamw_step(p64, {}, m64, v64, g64, hp);
    adamw_step(p32, {}, m32, v32, g32, hp);
  }
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(p32.ptr<float>()[i], p64.ptr<double>()[i], 1e-6 * (1 + std::abs(p64.ptr<double>()[i])));
}

TEST(AdamW, GradScaleEqualsPrescaledGradient) {
  // 0.25 is a power of two, so scaling inside the step and scaling the gradient first agree exactly.
  double p1[3] = {1, -2, 0.5}, p2[3] = {1, -2, 0.5}, g1[3] = {0.4, -1.2, 3}, g2[3] = {0.1, -0.3, 0.75};
  double m1[3] = {}, m2[3] = {}, v1[3] = {}, v2[3] = {};
  AdamWHyper hp{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = 1};
  adamw_step(host(p2, 3), {}, host(m2, 3), host(v2, 3), host(g2, 3), hp);
  hp.grad_scale = 0.25;
  adamw_step(host(p1, 3), {}, host(m1, 3), host(v1, 3), host(g1, 3), hp);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(p1[i], p2[i]);
    EXPECT_EQ(m1[i], m2[i]);
    EXPECT_EQ(v1[i], v2[i]);
  }
}

TEST(AdamW, WritesBf16CopyOfUpdatedParam) {
  const int64_t n = 33;
  Buffer p = random_buffer(DType::f32, {n}, 3), g = random_buffer(DType::f32, {n}, 4);
  Buffer m = Buffer::zeros(DType::f32, Device::cpu, {n}), v = Buffer::zeros(DType::f32, Device::cpu, {n});
  Buffer copy(DType::bf16, Device::cpu, {n});
  adamw_step(p, copy, m, v, g, AdamWHyper{1e-2, 0.9, 0.95, 1e-8, 0.1, 1});
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(static_cast<uint16_t*>(copy.view().data)[i], float_to_bf16(p.ptr<float>()[i])) << i;
}

TEST(AdamW, RejectsBf16CopyOfOtherSize) {
  Buffer p(DType::f32, Device::cpu, {4}), g(DType::f32, Device::cpu, {4}), m(DType::f32, Device::cpu, {4}),
      v(DType::f32, Device::cpu, {4}), copy(DType::bf16, Device::cpu, {5});
  try {
    adamw_step(p, copy, m, v, g, AdamWHyper{1e-3, 0.9, 0.999, 1e-8, 0, 1});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: param_bf16 has 5 elements but param has 4");
  }
}

TEST(AdamW, RejectsMismatchedElementCount) {
  Buffer p(DType::f32, Device::cpu, {4}), g(DType::f32, Device::cpu, {4}), m(DType::f32, Device::cpu, {3}),
      v(DType::f32, Device::cpu, {4});
  try {
    adamw_step(p, {}, m, v, g, AdamWHyper{1e-3, 0.9, 0.999, 1e-8, 0, 1});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: exp_avg has 3 elements but param has 4");
  }
}

TEST(AdamW, RejectsZeroStep) {
  Buffer p(DType::f32, Device::cpu, {4}), g(DType::f32, Device::cpu, {4}), m(DType::f32, Device::cpu, {4}),
      v(DType::f32, Device::cpu, {4});
  try {
    adamw_step(p, {}, m, v, g, AdamWHyper{1e-3, 0.9, 0.999, 1e-8, 0, 0});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: step is 1-based, got 0");
  }
}

// Rows flagged in known_zero take a zero gradient without reading it (garbage planted there is not
// used): the bits of adamw_step over the gradient with those rows zeroed, negative zeros included.
TEST(AdamW, KnownZeroRowsAreTheBitsOfZeroGradients) {
  const int64_t rows = 4, per_row = 5, n = rows * per_row;
  AdamWHyper hp{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = 3, .grad_scale = 0.5};
  Buffer param = random_buffer(DType::f32, {n}, 1), m = random_buffer(DType::f32, {n}, 2), v = random_buffer(DType::f32, {n}, 3);
  for (int64_t i = 0; i < n; ++i) v.ptr<float>()[i] = std::abs(v.ptr<float>()[i]);
  Buffer grad = random_buffer(DType::f32, {n}, 4), zeroed(DType::f32, Device::cpu, {n});
  const int32_t flags[rows] = {0, 1, 0, 1};
  for (int64_t i = 0; i < n; ++i) zeroed.ptr<float>()[i] = flags[i / per_row] ? (i % 2 ? -0.0f : 0.0f) : grad.ptr<float>()[i];
  Buffer known(DType::i32, Device::cpu, {rows});
  std::copy(flags, flags + rows, known.ptr<int32_t>());
  Buffer p1 = to_host(param), m1 = to_host(m), v1 = to_host(v), p2 = to_host(param), m2 = to_host(m), v2 = to_host(v);
  Buffer copy1(DType::bf16, Device::cpu, {n}), copy2(DType::bf16, Device::cpu, {n});
  adamw_step(p1, copy1, m1, v1, zeroed, hp);
  adamw_step_known_zero(p2, copy2, m2, v2, grad, known, hp);
  for (const auto& [a, b] : {std::pair{&p1, &p2}, std::pair{&m1, &m2}, std::pair{&v1, &v2}, std::pair{&copy1, &copy2}})
    EXPECT_EQ(std::memcmp(a->view().data, b->view().data, a->view().bytes()), 0);
  Buffer three(DType::i32, Device::cpu, {3});
  try {
    adamw_step_known_zero(p2, {}, m2, v2, grad, three, hp);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step_known_zero: known_zero has shape [3] but must be [E] with E dividing param's 20 elements");
  }
}

const uint16_t* bf16_bits(const Buffer& b) { return static_cast<const uint16_t*>(b.view().data); }

// bf16 moments (optimizer.moments = "bf16") from zero: each is the f32 moment rounded to bf16 (within
// half a bf16 step: the bf16 path computes in f32, the f32 path in double), and the update that reads
// them back moves param within 1% of one step of the f32 path's.
TEST(AdamW, Bf16MomentsAreTheF32MomentsRounded) {
  const int64_t n = 257;
  const double lr = 1e-2;
  Buffer p32 = random_buffer(DType::f32, {n}, 5), p16 = random_buffer(DType::f32, {n}, 5), g = random_buffer(DType::f32, {n}, 6);
  Buffer m32 = Buffer::zeros(DType::f32, Device::cpu, {n}), v32 = Buffer::zeros(DType::f32, Device::cpu, {n});
  Buffer m16 = Buffer::zeros(DType::bf16, Device::cpu, {n}), v16 = Buffer::zeros(DType::bf16, Device::cpu, {n});
  const AdamWHyper hp{lr, 0.9, 0.95, 1e-8, 0.1, 1};
  adamw_step(p32, {}, m32, v32, g, hp);
  adamw_step(p16, {}, m16, v16, g, hp);
  int rounded = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float m = m32.ptr<float>()[i], v = v32.ptr<float>()[i];
    EXPECT_LE(std::abs(bf16_to_float(bf16_bits(m16)[i]) - m), std::ldexp(1.0, -8) * 1.001 * std::abs(m)) << i;
    EXPECT_LE(std::abs(bf16_to_float(bf16_bits(v16)[i]) - v), std::ldexp(1.0, -8) * 1.001 * v) << i;
    EXPECT_LE(std::abs(p16.ptr<float>()[i] - p32.ptr<float>()[i]), 0.01 * lr) << i;
    rounded += bf16_to_float(bf16_bits(m16)[i]) != m32.ptr<float>()[i];
  }
  EXPECT_GT(rounded, n / 2);  // the rounding happened: few f32 values are bf16 already
}

// Over 300 steps of noisy gradients (beta2 = 0.95, the largest the config allows is 0.99), v in bf16
// keeps following v in f32: rounding to nearest leaves no drift that builds up.
TEST(AdamW, Bf16MomentsFollowF32MomentsOverManySteps) {
  const int64_t n = 512;
  Buffer p32 = Buffer::zeros(DType::f32, Device::cpu, {n}), p16 = Buffer::zeros(DType::f32, Device::cpu, {n});
  Buffer m32 = Buffer::zeros(DType::f32, Device::cpu, {n}), v32 = Buffer::zeros(DType::f32, Device::cpu, {n});
  Buffer m16 = Buffer::zeros(DType::bf16, Device::cpu, {n}), v16 = Buffer::zeros(DType::bf16, Device::cpu, {n});
  for (int64_t step = 1; step <= 300; ++step) {
    Buffer g = random_buffer(DType::f32, {n}, 100 + uint64_t(step), 1e-3);
    const AdamWHyper hp{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
    adamw_step(p32, {}, m32, v32, g, hp);
    adamw_step(p16, {}, m16, v16, g, hp);
  }
  double v_error = 0, p_error = 0, p_scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    v_error = std::max(v_error, std::abs(double(bf16_to_float(bf16_bits(v16)[i])) / v32.ptr<float>()[i] - 1));
    p_error = std::max(p_error, double(std::abs(p16.ptr<float>()[i] - p32.ptr<float>()[i])));
    p_scale = std::max(p_scale, double(std::abs(p32.ptr<float>()[i])));
  }
  EXPECT_LT(v_error, 0.05);
  EXPECT_LT(p_error, 0.02 * p_scale);
}

TEST(AdamW, RejectsBf16MomentsWithF64ParamAndMixedMoments) {
  Buffer p(DType::f64, Device::cpu, {4}), g(DType::f64, Device::cpu, {4}), m(DType::bf16, Device::cpu, {4}),
      v(DType::bf16, Device::cpu, {4}), m32(DType::f32, Device::cpu, {4}), p32(DType::f32, Device::cpu, {4}),
      g32(DType::f32, Device::cpu, {4});
  const AdamWHyper hp{1e-3, 0.9, 0.95, 1e-8, 0, 1};
  try {
    adamw_step(p, {}, m, v, g, hp);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: the moments are bf16 but grad is f64: they take grad's dtype, or bf16 with f32 grad");
  }
  try {
    adamw_step(p32, {}, m32, v, g32, hp);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: exp_avg_sq has dtype bf16 but exp_avg has f32");
  }
}

}  // namespace
}  // namespace marrow
