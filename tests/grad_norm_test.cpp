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

// Flagged rows are not read: NaN planted in them gives the parts of the same values with zeros
// there; an unflagged row is read (its NaN shows).
TEST(GradNorm, KnownZeroRowsAreNotRead) {
  Buffer x = testing::random_buffer(DType::f32, {3 + 5 * 4 + 2}, 2);  // 3 before, 5 rows of 4, 2 after
  int32_t flags[5] = {1, 0, 1, 1, 0};
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 4; ++c) x.ptr<float>()[3 + r * 4 + c] = flags[r] ? 0.0f : x.ptr<float>()[3 + r * 4 + c];
  Buffer plain(DType::f64, Device::cpu, {kSumParts}), known(DType::f64, Device::cpu, {kSumParts});
  sum_squares_parts(plain, x);
  for (int64_t r = 0; r < 5; ++r)
    if (flags[r]) x.ptr<float>()[3 + r * 4 + 1] = std::nanf("");
  const KnownZeroRows rows{Tensor(flags, DType::i32, Device::cpu, {5}), 3, 4};
  sum_squares_parts(known, x, rows);
  EXPECT_EQ(sum_parts_on_host(known), sum_parts_on_host(plain));
  flags[2] = 0;
  sum_squares_parts(known, x, rows);
  EXPECT_TRUE(std::isnan(sum_parts_on_host(known)));
}

TEST(GradNorm, KnownZeroRowsPastTheEndAreAnError) {
  float x[8] = {};
  int32_t flags[3] = {};
  Buffer parts(DType::f64, Device::cpu, {kSumParts});
  try {
    sum_squares_parts(parts, Tensor(x, DType::f32, Device::cpu, {8}), KnownZeroRows{Tensor(flags, DType::i32, Device::cpu, {3}), 1, 3});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "sum_squares_parts: 3 known rows of 3 from element 1 pass the end of x (8 elements)");
  }
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

// Parts on the device: l2_norm is the square root of its parts' sum, and pieces summed into
// parts of one buffer add up to the whole.
TEST(GradNorm, PartsAddUpToTheNorm) {
  Buffer x = testing::random_buffer(DType::f32, {5000}, 2);
  Buffer parts(DType::f64, Device::cpu, {2 * kSumParts});
  const Tensor x_all = x, first = x_all.rows(0, 1234), rest = x_all.rows(1234, 5000);
  sum_squares_parts(parts.view().rows(0, kSumParts), first);
  sum_squares_parts(parts.view().rows(kSumParts, 2 * kSumParts), rest);
  const double whole = std::pow(l2_norm(x), 2);
  EXPECT_NEAR(sum_parts_on_host(parts), whole, 1e-14 * whole);
  sum_squares_parts(parts.view().rows(0, kSumParts), x);
  EXPECT_EQ(std::sqrt(sum_parts_on_host(parts.view().rows(0, kSumParts))), l2_norm(x));
  double values[3] = {1.5, -2, 4};
  sum_values_parts(parts.view().rows(0, kSumParts), Tensor(values, DType::f64, Device::cpu, {3}));
  EXPECT_EQ(sum_parts_on_host(parts.view().rows(0, kSumParts)), 3.5);
}

TEST(GradNorm, PartsOfTheWrongShapeAreNamed) {
  float x[2] = {3, 4};
  Buffer parts(DType::f64, Device::cpu, {7});
  try {
    sum_squares_parts(parts, Tensor(x, DType::f32, Device::cpu, {2}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "sum_squares_parts: parts has shape [7] but expected [1024]");
  }
}

}  // namespace
}  // namespace marrow
