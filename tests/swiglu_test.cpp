#include "ops/swiglu.h"

#include <cmath>

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

}  // namespace
}  // namespace marrow
