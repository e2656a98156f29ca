#include "ops/grad_norm.h"

#include <cmath>
#include <limits>

#include "gradcheck.h"

namespace marrow {
namespace {

TEST(GradNorm, NormOfThreeFourIsFive) {
  float f[2] = {3, 4};
  double d[2] = {3, -4};
  EXPECT_EQ(l2_norm(Tensor(f, DType::f32, Device::cpu, {2})), 5.0);
  EXPECT_EQ(l2_norm(Tensor(d, DType::f64, Device::cpu, {2})), 5.0);
}

TEST(GradNorm, NonFiniteValuesPropagate) {
  float inf[3] = {1, std::numeric_limits<float>::infinity(), 2}, nan[3] = {1, std::nanf(""), 2};
  EXPECT_TRUE(std::isinf(l2_norm(Tensor(inf, DType::f32, Device::cpu, {3}))));
  EXPECT_TRUE(std::isnan(l2_norm(Tensor(nan, DType::f32, Device::cpu, {3}))));
}

TEST(GradNorm, IsDeterministicAndAccumulatesInDouble) {
  // A sum of squares accumulated in float would drift visibly over 10^5 terms.
  Buffer x = testing::random_buffer(DType::f32, {100000}, 1);
  double expected = 0;
  for (int64_t i = 0; i < x.numel(); ++i) expected += double(x.ptr<float>()[i]) * x.ptr<float>()[i];
  EXPECT_EQ(l2_norm(x), std::sqrt(expected));
  EXPECT_EQ(l2_norm(x), l2_norm(x));
}

TEST(GradNorm, RejectsIntegerTensor) {
  int32_t x[2] = {3, 4};
  try {
    l2_norm(Tensor(x, DType::i32, Device::cpu, {2}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "l2_norm: the CPU reference takes f32 or f64 tensors, got i32");
  }
}

}  // namespace
}  // namespace marrow
