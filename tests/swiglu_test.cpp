#include "ops/swiglu.h"

#include <cmath>
#include <string>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

TEST(Swiglu, ForwardMatchesHandComputedCase) {
  // Row [gate 0, gate 1 | up 5, up 2]: silu(0) * 5 = 0, silu(1) * 2 = 2 / (1 + e^-1).
  double gate_up[4] = {0, 1, 5, 2}, out[2];
  swiglu_forward(Tensor(out, DType::f64, Device::cpu, {1, 2}), Tensor(gate_up, DType::f64, Device::cpu, {1, 4}));
  EXPECT_DOUBLE_EQ(out[0], 0);
  EXPECT_DOUBLE_EQ(out[1], 2 / (1 + std::exp(-1.0)));
}

TEST(Swiglu, GradientsMatchFiniteDifferences) {
  for (auto [n, d] : {std::pair<int64_t, int64_t>{1, 1}, {4, 7}}) {
    Buffer gate_up = random_buffer(DType::f64, {n, 2 * d}, 1, 3.0), r = random_buffer(DType::f64, {n, d}, 2);
    Buffer out(DType::f64, Device::cpu, {n, d}), dgate_up(DType::f64, Device::cpu, {n, 2 * d});
    auto loss = [&] {
      swiglu_forward(out, gate_up);
      return testing::weighted_sum(out, r);
    };
    loss();
    swiglu_backward(dgate_up, r, gate_up);
    testing::expect_gradient("dgate_up", gate_up, dgate_up, loss);
  }
}

TEST(Swiglu, SaturatesWithoutNaN) {
  float gate_up[4] = {-1000, 1000, 3, 3}, out[2], dout[2] = {1, 1}, dgate_up[4];
  Tensor gu(gate_up, DType::f32, Device::cpu, {1, 4});
  swiglu_forward(Tensor(out, DType::f32, Device::cpu, {1, 2}), gu);
  swiglu_backward(Tensor(dgate_up, DType::f32, Device::cpu, {1, 4}), Tensor(dout, DType::f32, Device::cpu, {1, 2}), gu);
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1], 3000);
  EXPECT_EQ(dgate_up[0], 0);
  EXPECT_EQ(dgate_up[1], 3);
  EXPECT_EQ(dgate_up[2], 0);
  EXPECT_EQ(dgate_up[3], 1000);
}

TEST(Swiglu, F32PathMatchesF64) {
  const int64_t n = 5, d = 6;
  Buffer gate_up64 = random_buffer(DType::f64, {n, 2 * d}, 3, 2.0), dout64 = random_buffer(DType::f64, {n, d}, 4);
  Buffer gate_up32 = random_buffer(DType::f32, {n, 2 * d}, 3, 2.0), dout32 = random_buffer(DType::f32, {n, d}, 4);
  Buffer out64(DType::f64, Device::cpu, {n, d}), out32(DType::f32, Device::cpu, {n, d});
  Buffer dgu64(DType::f64, Device::cpu, {n, 2 * d}), dgu32(DType::f32, Device::cpu, {n, 2 * d});
  swiglu_forward(out64, gate_up64);
  swiglu_forward(out32, gate_up32);
  swiglu_backward(dgu64, dout64, gate_up64);
  swiglu_backward(dgu32, dout32, gate_up32);
  // The f32 inputs are the f64 ones rounded, so the outputs differ by a few f32 roundings.
  for (int64_t i = 0; i < n * d; ++i)
    EXPECT_NEAR(out32.ptr<float>()[i], out64.ptr<double>()[i], 1e-5 * (1 + std::abs(out64.ptr<double>()[i])));
  for (int64_t i = 0; i < n * 2 * d; ++i)
    EXPECT_NEAR(dgu32.ptr<float>()[i], dgu64.ptr<double>()[i], 1e-5 * (1 + std::abs(dgu64.ptr<double>()[i])));
}

TEST(Swiglu, RejectsOddGateUpWidth) {
  Buffer gate_up(DType::f32, Device::cpu, {2, 5}), out(DType::f32, Device::cpu, {2, 2});
  try {
    swiglu_forward(out, gate_up);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "swiglu_forward: gate_up must be [rows, 2 * intermediate], got [2, 5]");
  }
}

TEST(Swiglu, RejectsMixedDtypes) {
  Buffer gate_up(DType::f32, Device::cpu, {2, 4}), dout(DType::f64, Device::cpu, {2, 2}),
      dgate_up(DType::f32, Device::cpu, {2, 4});
  try {
    swiglu_backward(dgate_up, dout, gate_up);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "swiglu_backward: dout has dtype f64 but gate_up has f32");
  }
}

TEST(Swiglu, WeightedBackwardIsTheThreeStepsInOne) {
  // Three rows of I = 2; token 0's copies are rows 2 and 0, token 1 has row 1 and an entry of -1.
  int32_t rows[4] = {2, 0, 1, -1};
  const int64_t n = 3, d = 2;
  Buffer gate_up = random_buffer(DType::f64, {n, 2 * d}, 5, 2.0), dact = random_buffer(DType::f64, {n, d}, 6);
  double w[4] = {0.25, 0.75, 2, 9};
  Tensor copy_row(rows, DType::i32, Device::cpu, {2, 2}), topk_weight(w, DType::f64, Device::cpu, {2, 2});
  Buffer dgate_up(DType::f64, Device::cpu, {n, 2 * d}), act(DType::f64, Device::cpu, {n, d}), dtopk(DType::f64, Device::cpu, {2, 2});
  swiglu_weighted_backward(dgate_up, act, dtopk, dact, gate_up, topk_weight, copy_row);

  // The same from the separate steps: the SwiGLU output, its dot with dact, then both weighted.
  Buffer plain(DType::f64, Device::cpu, {n, d}), weighted_dact(DType::f64, Device::cpu, {n, d}), want(DType::f64, Device::cpu, {n, 2 * d});
  swiglu_forward(plain, gate_up);
  const double row_weight[3] = {0.75, 2, 0.25};  // rows 0, 1, 2
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) weighted_dact.ptr<double>()[r * d + i] = row_weight[r] * dact.ptr<double>()[r * d + i];
  swiglu_backward(want, weighted_dact, gate_up);
  auto dot = [&](int64_t r) { return dact.ptr<double>()[r * d] * plain.ptr<double>()[r * d] + dact.ptr<double>()[r * d + 1] * plain.ptr<double>()[r * d + 1]; };
  EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[0], dot(2));
  EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[1], dot(0));
  EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[2], dot(1));
  EXPECT_EQ(dtopk.ptr<double>()[3], 0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < d; ++i)
      EXPECT_DOUBLE_EQ(act.ptr<double>()[r * d + i], row_weight[r] * plain.ptr<double>()[r * d + i]) << "act row " << r;
    for (int64_t i = 0; i < 2 * d; ++i)
      EXPECT_DOUBLE_EQ(dgate_up.ptr<double>()[r * 2 * d + i], want.ptr<double>()[r * 2 * d + i]) << "dgate_up row " << r;
  }
}

// The error of swiglu_weighted_backward on three rows of I = 2 with one token's two copies, given
// those copies' rows and dact's row count.
std::string weighted_backward_error(int32_t first_row, int32_t second_row, int64_t dact_rows) {
  int32_t rows[2] = {first_row, second_row};
  double gate_up[12] = {}, dact[6] = {}, act[6], dgate_up[12], w[2] = {1, 1}, dw[2];
  try {
    swiglu_weighted_backward(Tensor(dgate_up, DType::f64, Device::cpu, {3, 4}), Tensor(act, DType::f64, Device::cpu, {3, 2}),
                             Tensor(dw, DType::f64, Device::cpu, {1, 2}), Tensor(dact, DType::f64, Device::cpu, {dact_rows, 2}),
                             Tensor(gate_up, DType::f64, Device::cpu, {3, 4}), Tensor(w, DType::f64, Device::cpu, {1, 2}),
                             Tensor(rows, DType::i32, Device::cpu, {1, 2}));
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Swiglu, WeightedBackwardRejectsBadRowsAndShapes) {
  EXPECT_EQ(weighted_backward_error(0, 3, 3), "swiglu_weighted_backward: copy_row[0, 1] = 3 is neither -1 nor inside [0, 3)");
  EXPECT_EQ(weighted_backward_error(0, 1, 2), "swiglu_weighted_backward: dact has shape [2, 2] but expected [3, 2]");
}

// GPT-OSS's swiglu_alpha and swiglu_limit.
constexpr double kAlpha = 1.702, kLimit = 7.0;

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

TEST(ClampedSwiglu, ForwardIsTheHuggingFaceFormula) {
  // One row of four interleaved (gate, up) pairs: inside the limits, gate past the limit, up past both limits.
  double gate_up[8] = {0.5, 1.5, 9, -3, -2, 8, -12, -7.5}, out[4];
  clamped_swiglu_forward(Tensor(out, DType::f64, Device::cpu, {1, 4}), Tensor(gate_up, DType::f64, Device::cpu, {1, 8}), kAlpha,
                         kLimit);
  auto want = [](double g, double u) { return (u + 1) * (g * sigmoid(kAlpha * g)); };
  EXPECT_DOUBLE_EQ(out[0], want(0.5, 1.5));
  EXPECT_DOUBLE_EQ(out[1], want(7, -3));   // gate clamped from above
  EXPECT_DOUBLE_EQ(out[2], want(-2, 7));   // up clamped from above
  EXPECT_DOUBLE_EQ(out[3], want(-12, -7));  // gate has no lower clamp; up clamped from below
}

// Away from the clamp edges the op is smooth, so central differences apply, including where a
// clamp holds (a zero gradient there).
TEST(ClampedSwiglu, GradientsMatchFiniteDifferences) {
  for (auto [n, d] : {std::pair<int64_t, int64_t>{1, 1}, {4, 7}}) {
    Buffer gate_up = random_buffer(DType::f64, {n, 2 * d}, 1, 5.0), r = random_buffer(DType::f64, {n, d}, 2);
    for (int64_t i = 0; i < gate_up.numel(); ++i)
      if (std::abs(std::abs(gate_up.ptr<double>()[i]) - kLimit) < 1e-3) gate_up.ptr<double>()[i] += 0.01;
    Buffer out(DType::f64, Device::cpu, {n, d}), dgate_up(DType::f64, Device::cpu, {n, 2 * d});
    auto loss = [&] {
      clamped_swiglu_forward(out, gate_up, kAlpha, kLimit);
      return testing::weighted_sum(out, r);
    };
    clamped_swiglu_backward(dgate_up, r, gate_up, kAlpha, kLimit);
    testing::expect_gradient("dgate_up", gate_up, dgate_up, loss);
  }
}

// torch's clamp backward passes the gradient with the bounds included and stops it past them:
// gate above the limit, up above or below it. Gate has no lower clamp.
TEST(ClampedSwiglu, ValuesPastTheLimitsGetNoGradient) {
  // Interleaved pairs: (gate 9, up 1), (gate 7, up 7), (gate -20, up -7), (gate 1, up 7.5), (gate 1, up -8).
  float gate_up[10] = {9, 1, 7, 7, -20, -7, 1, 7.5, 1, -8}, dout[5] = {1, 1, 1, 1, 1}, dgate_up[10];
  clamped_swiglu_backward(Tensor(dgate_up, DType::f32, Device::cpu, {1, 10}), Tensor(dout, DType::f32, Device::cpu, {1, 5}),
                          Tensor(gate_up, DType::f32, Device::cpu, {1, 10}), kAlpha, kLimit);
  auto dgate = [](double g, double u) {
    const double s = sigmoid(kAlpha * g);
    return float((u + 1) * s * (1 + kAlpha * g * (1 - s)));
  };
  auto dup = [](double g) { return float(g * sigmoid(kAlpha * g)); };
  EXPECT_EQ(dgate_up[0], 0) << "gate 9 is past the limit";
  EXPECT_EQ(dgate_up[1], dup(7)) << "up of a clamped gate sees the clamped gate";
  EXPECT_EQ(dgate_up[2], dgate(7, 7)) << "gate at the limit passes";
  EXPECT_EQ(dgate_up[3], dup(7)) << "up at the limit passes";
  EXPECT_EQ(dgate_up[4], dgate(-20, -7)) << "gate has no lower clamp";
  EXPECT_EQ(dgate_up[5], dup(-20)) << "up at minus the limit passes";
  EXPECT_EQ(dgate_up[6], dgate(1, 7)) << "gate sees the clamped up";
  EXPECT_EQ(dgate_up[7], 0) << "up 7.5 is past the limit";
  EXPECT_EQ(dgate_up[9], 0) << "up -8 is past minus the limit";
  EXPECT_EQ(dgate_up[8], dgate(1, -7));
}

// With an unreachable limit and alpha 1 it is (up + 1) times plain SwiGLU's silu(gate): plain
// SwiGLU's gate_up is gate then up, so the pairs are taken apart and up moved by one.
TEST(ClampedSwiglu, WithoutClampsIsSwigluOfUpPlusOne) {
  const int64_t n = 3, d = 5;
  Buffer gate_up = random_buffer(DType::f64, {n, 2 * d}, 3, 2.0), shifted(DType::f64, Device::cpu, {n, 2 * d});
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      shifted.ptr<double>()[r * 2 * d + c] = gate_up.ptr<double>()[r * 2 * d + 2 * c];
      shifted.ptr<double>()[r * 2 * d + d + c] = gate_up.ptr<double>()[r * 2 * d + 2 * c + 1] + 1;
    }
  Buffer out(DType::f64, Device::cpu, {n, d}), want(DType::f64, Device::cpu, {n, d});
  clamped_swiglu_forward(out, gate_up, 1.0, 1e9);
  swiglu_forward(want, shifted);
  for (int64_t i = 0; i < n * d; ++i) EXPECT_NEAR(out.ptr<double>()[i], want.ptr<double>()[i], 1e-15) << i;
}

// The clamped form of WeightedBackwardIsTheThreeStepsInOne, with values past the limit and the
// routing weight of each row written out.
TEST(ClampedSwiglu, WeightedBackwardIsTheThreeStepsInOne) {
  int32_t rows[4] = {2, 0, 1, -1};
  const int64_t n = 3, d = 3;
  Buffer gate_up = random_buffer(DType::f64, {n, 2 * d}, 5, 2.0 * kLimit), dact = random_buffer(DType::f64, {n, d}, 6);
  double w[4] = {0.25, 0.75, 2, 9};
  Tensor copy_row(rows, DType::i32, Device::cpu, {2, 2}), topk_weight(w, DType::f64, Device::cpu, {2, 2});
  Buffer dgate_up(DType::f64, Device::cpu, {n, 2 * d}), act(DType::f64, Device::cpu, {n, d}), dtopk(DType::f64, Device::cpu, {2, 2});
  Buffer row_weight(DType::f64, Device::cpu, {n});
  clamped_swiglu_weighted_backward(dgate_up, act, row_weight, dtopk, dact, gate_up, topk_weight, copy_row, kAlpha, kLimit);

  Buffer plain(DType::f64, Device::cpu, {n, d}), weighted_dact(DType::f64, Device::cpu, {n, d}), want(DType::f64, Device::cpu, {n, 2 * d});
  clamped_swiglu_forward(plain, gate_up, kAlpha, kLimit);
  const double weight_of_row[3] = {0.75, 2, 0.25};
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) weighted_dact.ptr<double>()[r * d + i] = weight_of_row[r] * dact.ptr<double>()[r * d + i];
  clamped_swiglu_backward(want, weighted_dact, gate_up, kAlpha, kLimit);
  auto dot = [&](int64_t r) {
    double sum = 0;
    for (int64_t i = 0; i < d; ++i) sum += dact.ptr<double>()[r * d + i] * plain.ptr<double>()[r * d + i];
    return sum;
  };
  EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[0], dot(2));
  EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[1], dot(0));
  EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[2], dot(1));
  EXPECT_EQ(dtopk.ptr<double>()[3], 0);
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_EQ(row_weight.ptr<double>()[r], weight_of_row[r]);
    for (int64_t i = 0; i < d; ++i)
      EXPECT_DOUBLE_EQ(act.ptr<double>()[r * d + i], weight_of_row[r] * plain.ptr<double>()[r * d + i]) << "act row " << r;
    for (int64_t i = 0; i < 2 * d; ++i)
      EXPECT_DOUBLE_EQ(dgate_up.ptr<double>()[r * 2 * d + i], want.ptr<double>()[r * 2 * d + i]) << "dgate_up row " << r;
  }
}

TEST(ClampedSwiglu, RejectsABadLimitAndGpuDtypes) {
  Buffer gate_up(DType::f32, Device::cpu, {2, 4}), out(DType::f32, Device::cpu, {2, 2});
  try {
    clamped_swiglu_forward(out, gate_up, kAlpha, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "clamped_swiglu_forward: limit must be positive, got 0");
  }
  try {
    clamped_swiglu_forward(Buffer(DType::f32, Device::cpu, {2, 3}), gate_up, kAlpha, kLimit);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "clamped_swiglu_forward: out has shape [2, 3] but expected [2, 2]");
  }
  // The GPU's dtypes are checked before anything reads the data, so host memory stands in for the GPU's.
  Tensor gpu_gate_up(gate_up.ptr<float>(), DType::f32, Device::cuda, {2, 4}), gpu_out(out.ptr<float>(), DType::f32, Device::cuda, {2, 2});
  try {
    clamped_swiglu_backward(Tensor(gate_up.ptr<float>(), DType::f32, Device::cuda, {2, 4}), gpu_out, gpu_gate_up, kAlpha, kLimit);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "clamped_swiglu_backward: gate_up has dtype f32 but expected bf16");
  }
  // row_weight is f32 on the GPU, as the routing weights.
  int32_t rows[2] = {0, 1};
  float weights[2] = {1, 1}, dweights[2];
  auto gpu = [](void* p, DType dtype, std::initializer_list<int64_t> dims) { return Tensor(p, dtype, Device::cuda, dims); };
  try {
    clamped_swiglu_weighted_backward(gpu(gate_up.ptr<float>(), DType::bf16, {2, 4}), gpu(out.ptr<float>(), DType::bf16, {2, 2}),
                                     gpu(out.ptr<float>(), DType::bf16, {2}), gpu(dweights, DType::f32, {1, 2}),
                                     gpu(out.ptr<float>(), DType::bf16, {2, 2}), gpu(gate_up.ptr<float>(), DType::bf16, {2, 4}),
                                     gpu(weights, DType::f32, {1, 2}), gpu(rows, DType::i32, {1, 2}), kAlpha, kLimit);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "clamped_swiglu_weighted_backward: row_weight has dtype bf16 but expected f32");
  }
}

}  // namespace
}  // namespace marrow
