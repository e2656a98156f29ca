#include "ops/rmsnorm.h"

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

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

}  // namespace
}  // namespace marrow
