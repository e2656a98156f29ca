#include "ops/rmsnorm.h"

#include <cmath>
#include <string>
#include <vector>

#include "gradcheck.h"
#include "ops/add.h"
#include "ops/rope.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

Tensor positions_tensor(std::vector<int32_t>& p) { return Tensor(p.data(), DType::i32, Device::cpu, {int64_t(p.size())}); }

void expect_same(const char* what, const Tensor& got, const Tensor& want, double tolerance) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) ASSERT_NEAR(element(got, i), element(want, i), tolerance) << what << " element " << i;
}

// The message of the error f throws, or "" when it throws none.
template <class F> std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(RmsNorm, ForwardMatchesHandComputedRow) {
  float x[2] = {3, 4}, w[2] = {1, 2}, y[2], rstd[1];
  rmsnorm_forward(Tensor(y, DType::f32, Device::cpu, {1, 2}), Tensor(rstd, DType::f32, Device::cpu, {1}),
                  Tensor(x, DType::f32, Device::cpu, {1, 2}), Tensor(w, DType::f32, Device::cpu, {2}), 0.0);
  // mean of squares = 12.5
  EXPECT_NEAR(rstd[0], 1 / std::sqrt(12.5), 1e-7);
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-6);
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  for (int64_t d : {1, 7, 64}) {
    const int64_t n = 5;
    Buffer x = random_buffer(DType::f64, {n, d}, 1), w = random_buffer(DType::f64, {d}, 2),
           r = random_buffer(DType::f64, {n, d}, 3);
    Buffer y(DType::f64, Device::cpu, {n, d}), rstd(DType::f64, Device::cpu, {n});
    Buffer dx(DType::f64, Device::cpu, {n, d}), dw = Buffer::zeros(DType::f64, Device::cpu, {d});
    auto loss = [&] {
      rmsnorm_forward(y, rstd, x, w, 1e-6);
      return testing::weighted_sum(y, r);
    };
    loss();
    rmsnorm_backward(dx, dw, r, x, w, rstd);
    testing::expect_gradient("dx", x, dx, loss);
    testing::expect_gradient("dweight", w, dw, loss);
  }
}

// Qwen3.5's zero-centred norm: offset 1 against x * rstd * (1 + w) written out in f64.
TEST(RmsNorm, ZeroCentredWeightIsTheDirectFormula) {
  const int64_t n = 4, d = 7;
  Buffer x = random_buffer(DType::f64, {n, d}, 1), w = random_buffer(DType::f64, {d}, 2);
  Buffer y(DType::f64, Device::cpu, {n, d}), rstd(DType::f64, Device::cpu, {n});
  rmsnorm_forward(y, rstd, x, NormWeight(w, 1), 1e-6);
  for (int64_t i = 0; i < n; ++i) {
    double squares = 0;
    for (int64_t j = 0; j < d; ++j) squares += element(x, i * d + j) * element(x, i * d + j);
    const double r = 1 / std::sqrt(squares / double(d) + 1e-6);
    EXPECT_NEAR(element(rstd, i), r, 1e-14 * r);
    for (int64_t j = 0; j < d; ++j)
      EXPECT_NEAR(element(y, i * d + j), element(x, i * d + j) * r * (1 + element(w, j)), 1e-13) << i << " " << j;
  }
}

// loss = <y, r> + <sum, r_sum> of the fused add and norm with offset 1 (its CPU reference is add,
// then rmsnorm_forward), through rmsnorm_backward with dresidual.
TEST(RmsNorm, ZeroCentredGradientsMatchFiniteDifferences) {
  for (int64_t d : {1, 7, 64}) {
    const int64_t n = 5;
    Buffer x = random_buffer(DType::f64, {n, d}, 1), residual = random_buffer(DType::f64, {n, d}, 2),
           w = random_buffer(DType::f64, {d}, 3), r = random_buffer(DType::f64, {n, d}, 4), r_sum = random_buffer(DType::f64, {n, d}, 5);
    Buffer sum(DType::f64, Device::cpu, {n, d}), y(DType::f64, Device::cpu, {n, d}), rstd(DType::f64, Device::cpu, {n});
    Buffer dx(DType::f64, Device::cpu, {n, d}), dw = Buffer::zeros(DType::f64, Device::cpu, {d});
    auto loss = [&] {
      rmsnorm_add_forward(y, sum, rstd, x, residual, NormWeight(w, 1), 1e-6);
      return testing::weighted_sum(y, r) + testing::weighted_sum(sum, r_sum);
    };
    loss();
    rmsnorm_backward(dx, dw, r, sum, NormWeight(w, 1), rstd, r_sum);
    testing::expect_gradient("dx", x, dx, loss);
    testing::expect_gradient("dresidual", residual, dx, loss);
    testing::expect_gradient("dweight", w, dw, loss);
  }
}

// Offset 1 is the weight T(1) + w in the op's dtype, bit for bit (y, rstd, dx, dweight); offset 0
// is today's x * rstd * w, bit for bit, the sign of a -0 weight's zeros included.
TEST(RmsNorm, OffsetJoinsTheWeightInItsDtype) {
  for (DType dtype : {DType::f32, DType::f64}) {
    const int64_t n = 3, d = 9;
    Buffer x = random_buffer(dtype, {n, d}, 1), w = random_buffer(dtype, {d}, 2), shifted(dtype, Device::cpu, {d});
    testing::set_element(w, 4, -0.0);
    for (int64_t j = 0; j < d; ++j)
      testing::set_element(shifted, j, dtype == DType::f32 ? double(1.0f + w.ptr<float>()[j]) : 1.0 + element(w, j));
    Buffer y[2] = {{dtype, Device::cpu, {n, d}}, {dtype, Device::cpu, {n, d}}};
    Buffer dx[2] = {{dtype, Device::cpu, {n, d}}, {dtype, Device::cpu, {n, d}}};
    Buffer rstd[2] = {{dtype, Device::cpu, {n}}, {dtype, Device::cpu, {n}}};
    Buffer dw[2] = {random_buffer(dtype, {d}, 3), random_buffer(dtype, {d}, 3)}, dy = random_buffer(dtype, {n, d}, 4);
    rmsnorm_forward(y[0], rstd[0], x, NormWeight(w, 1), 1e-6);
    rmsnorm_forward(y[1], rstd[1], x, shifted, 1e-6);
    rmsnorm_backward(dx[0], dw[0], dy, x, NormWeight(w, 1), rstd[0]);
    rmsnorm_backward(dx[1], dw[1], dy, x, shifted, rstd[1]);
    for (const Buffer* pair : {y, rstd, dx, dw})
      for (int64_t i = 0; i < pair[0].numel(); ++i) ASSERT_EQ(element(pair[0], i), element(pair[1], i)) << i;
    rmsnorm_forward(y[0], rstd[0], x, NormWeight(w, 0), 1e-6);
    for (int64_t i = 0; i < n * d; ++i) {
      const double want = dtype == DType::f32 ? double(x.ptr<float>()[i] * rstd[0].ptr<float>()[i / d] * w.ptr<float>()[i % d])
                                               : element(x, i) * element(rstd[0], i / d) * element(w, i % d);
      ASSERT_EQ(element(y[0], i), want) << i;
      ASSERT_EQ(std::signbit(element(y[0], i)), std::signbit(want)) << i;
    }
  }
}

TEST(RmsNorm, RejectsMismatchedWeight) {
  Buffer x(DType::f32, Device::cpu, {2, 4}), y(DType::f32, Device::cpu, {2, 4}), rstd(DType::f32, Device::cpu, {2}),
      w(DType::f32, Device::cpu, {3});
  try {
    rmsnorm_forward(y, rstd, x, w, 1e-6);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rmsnorm_forward: weight has shape [3] but expected [4]");
  }
}

// The fused residual add against add() then the norm, in f64 and f32, with sum written over x as the
// model does; and the backward's dresidual against add() after the plain backward, written over
// dresidual.
TEST(RmsNorm, AddForwardAndResidualGradientMatchTheUnfusedOps) {
  for (DType dtype : {DType::f64, DType::f32}) {
    const int64_t n = 6, d = 24;
    const double tolerance = dtype == DType::f64 ? 1e-12 : 0;
    Buffer x = random_buffer(dtype, {n, d}, 1), residual = random_buffer(dtype, {n, d}, 2), w = random_buffer(dtype, {d}, 3);
    Buffer sum(dtype, Device::cpu, {n, d}), y(dtype, Device::cpu, {n, d}), rstd(dtype, Device::cpu, {n});
    add(sum, x, residual);
    rmsnorm_forward(y, rstd, sum, w, 1e-6);
    Buffer fused_sum = random_buffer(dtype, {n, d}, 1), fused_y(dtype, Device::cpu, {n, d}), fused_rstd(dtype, Device::cpu, {n});
    rmsnorm_add_forward(fused_y, fused_sum, fused_rstd, fused_sum, residual, w, 1e-6);
    expect_same("sum", fused_sum, sum, tolerance);
    expect_same("y", fused_y, y, tolerance);
    expect_same("rstd", fused_rstd, rstd, tolerance);

    Buffer dy = random_buffer(dtype, {n, d}, 4), dresidual = random_buffer(dtype, {n, d}, 5);
    Buffer dx(dtype, Device::cpu, {n, d}), dw = random_buffer(dtype, {d}, 6), fused_dw = random_buffer(dtype, {d}, 6);
    rmsnorm_backward(dx, dw, dy, sum, w, rstd);
    add(dx, dx, dresidual);
    rmsnorm_backward(dresidual, fused_dw, dy, sum, w, rstd, dresidual);
    expect_same("dx", dresidual, dx, tolerance);
    expect_same("dweight", fused_dw, dw, tolerance);
  }
}

// loss = <y, r> + <sum, r_sum>: sum's other reader hands the backward r_sum as dresidual, and x and
// residual both get dx.
TEST(RmsNorm, AddGradientsMatchFiniteDifferences) {
  for (int64_t d : {1, 7, 64}) {
    const int64_t n = 5;
    Buffer x = random_buffer(DType::f64, {n, d}, 1), residual = random_buffer(DType::f64, {n, d}, 2),
           w = random_buffer(DType::f64, {d}, 3), r = random_buffer(DType::f64, {n, d}, 4),
           r_sum = random_buffer(DType::f64, {n, d}, 5);
    Buffer sum(DType::f64, Device::cpu, {n, d}), y(DType::f64, Device::cpu, {n, d}), rstd(DType::f64, Device::cpu, {n});
    Buffer dx(DType::f64, Device::cpu, {n, d}), dw = Buffer::zeros(DType::f64, Device::cpu, {d});
    auto loss = [&] {
      rmsnorm_add_forward(y, sum, rstd, x, residual, w, 1e-6);
      return testing::weighted_sum(y, r) + testing::weighted_sum(sum, r_sum);
    };
    loss();
    rmsnorm_backward(dx, dw, r, sum, w, rstd, r_sum);
    testing::expect_gradient("dx", x, dx, loss);
    testing::expect_gradient("dresidual", residual, dx, loss);
    testing::expect_gradient("dweight", w, dw, loss);
  }
}

// QK-norm with RoPE against the norm then rope_forward, and its backward against rope_backward then
// the norm's backward (f64 to 1e-12, f32 exactly: the CPU reference is that sequence).
TEST(RmsNorm, RopeMatchesTheUnfusedOps) {
  std::vector<int32_t> pos = {0, 7, 4095, 32767};
  for (DType dtype : {DType::f64, DType::f32}) {
    const int64_t t = 4, h = 3, d = 16;
    const double tolerance = dtype == DType::f64 ? 1e-12 : 0;
    Buffer x = random_buffer(dtype, {t, h, d}, 1), w = random_buffer(dtype, {d}, 2);
    Buffer y(dtype, Device::cpu, {t, h, d}), rstd(dtype, Device::cpu, {t * h});
    rmsnorm_forward(y.view().reshape({t * h, d}), rstd, x.view().reshape({t * h, d}), w, 1e-6);
    rope_forward(y, y, positions_tensor(pos), 1e6);
    Buffer fused_y(dtype, Device::cpu, {t, h, d}), fused_rstd(dtype, Device::cpu, {t * h});
    rmsnorm_rope_forward(fused_y, fused_rstd, x, w, positions_tensor(pos), 1e-6, 1e6);
    expect_same("y", fused_y, y, tolerance);
    expect_same("rstd", fused_rstd, rstd, tolerance);

    Buffer dy = random_buffer(dtype, {t, h, d}, 3), unrotated(dtype, Device::cpu, {t, h, d}), dx(dtype, Device::cpu, {t, h, d});
    Buffer dw = random_buffer(dtype, {d}, 4), fused_dw = random_buffer(dtype, {d}, 4), fused_dx(dtype, Device::cpu, {t, h, d});
    rope_backward(unrotated, dy, positions_tensor(pos), 1e6);
    rmsnorm_backward(dx.view().reshape({t * h, d}), dw, unrotated.view().reshape({t * h, d}), x.view().reshape({t * h, d}), w, rstd);
    rmsnorm_rope_backward(fused_dx, fused_dw, dy, x, w, rstd, positions_tensor(pos), 1e6);
    expect_same("dx", fused_dx, dx, tolerance);
    expect_same("dweight", fused_dw, dw, tolerance);
  }
}

TEST(RmsNorm, RopeGradientsMatchFiniteDifferences) {
  std::vector<int32_t> pos = {3, 0, 250};
  for (int64_t d : {2, 6, 64}) {
    const int64_t t = 3, h = 2;
    Buffer x = random_buffer(DType::f64, {t, h, d}, 1), w = random_buffer(DType::f64, {d}, 2), r = random_buffer(DType::f64, {t, h, d}, 3);
    Buffer y(DType::f64, Device::cpu, {t, h, d}), rstd(DType::f64, Device::cpu, {t * h});
    Buffer dx(DType::f64, Device::cpu, {t, h, d}), dw = Buffer::zeros(DType::f64, Device::cpu, {d});
    auto loss = [&] {
      rmsnorm_rope_forward(y, rstd, x, w, positions_tensor(pos), 1e-6, 10000.0);
      return testing::weighted_sum(y, r);
    };
    loss();
    rmsnorm_rope_backward(dx, dw, r, x, w, rstd, positions_tensor(pos), 10000.0);
    testing::expect_gradient("dx", x, dx, loss);
    testing::expect_gradient("dweight", w, dw, loss);
  }
}

TEST(RmsNorm, FusedOpsNameTheMisshapenTensor) {
  std::vector<int32_t> pos = {0, 1};
  Buffer a(DType::f32, Device::cpu, {2, 4}), b(DType::f32, Device::cpu, {2, 4}), c(DType::f32, Device::cpu, {2, 4}),
      bad(DType::f32, Device::cpu, {2, 3}), rstd(DType::f32, Device::cpu, {2}), w(DType::f32, Device::cpu, {4});
  EXPECT_EQ(error_of([&] { rmsnorm_add_forward(a, b, rstd, c, bad, w, 1e-6); }),
            "rmsnorm_add_forward: residual has shape [2, 3] but expected [2, 4]");
  EXPECT_EQ(error_of([&] { rmsnorm_add_forward(a, bad, rstd, b, c, w, 1e-6); }),
            "rmsnorm_add_forward: sum has shape [2, 3] but expected [2, 4]");
  EXPECT_EQ(error_of([&] { rmsnorm_backward(a, w, b, c, w, rstd, bad); }),
            "rmsnorm_backward: dresidual has shape [2, 3] but expected [2, 4]");

  Buffer x(DType::f32, Device::cpu, {2, 3, 4}), y(DType::f32, Device::cpu, {2, 3, 4}), rstd6(DType::f32, Device::cpu, {6}),
      odd(DType::f32, Device::cpu, {2, 3, 5});
  EXPECT_EQ(error_of([&] { rmsnorm_rope_forward(y, rstd, x, w, positions_tensor(pos), 1e-6, 1e6); }),
            "rmsnorm_rope_forward: rstd has shape [2] but expected [6]");
  EXPECT_EQ(error_of([&] { rmsnorm_rope_forward(odd, rstd6, odd, Buffer(DType::f32, Device::cpu, {5}), positions_tensor(pos), 1e-6, 1e6); }),
            "rmsnorm_rope_forward: head_dim of x must be even, got 5");
  std::vector<int32_t> three = {0, 1, 2};
  EXPECT_EQ(error_of([&] { rmsnorm_rope_backward(y, w, x, x, w, rstd6, positions_tensor(three), 1e6); }),
            "rmsnorm_rope_backward: positions has shape [3] but expected [2]");
  EXPECT_EQ(error_of([&] { rmsnorm_rope_backward(a, w, b, c, w, rstd, positions_tensor(pos), 1e6); }),
            "rmsnorm_rope_backward: x must be [tokens, heads, head_dim], got [2, 4]");
  Buffer table(DType::f32, Device::cpu, {2, 4, 2});
  EXPECT_EQ(error_of([&] { rmsnorm_rope_forward(y, rstd6, x, w, positions_tensor(pos), 1e-6, 1e6, table); }),
            "rmsnorm_rope_forward: cos_sin has shape [2, 4, 2] but expected [2, 2, 2]");
}

}  // namespace
}  // namespace marrow
