#include "ops/cast.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/bf16.h"
#include "core/memory.h"

namespace marrow {
namespace {

TEST(Cast, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 lies halfway between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway as well: ties go up to the even mantissa.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
}

TEST(Cast, RoundTripsThroughBf16AndF64) {
  float in[4] = {1.0f, -3.140625f, 1e-3f, 65504.0f};
  uint16_t mid[4];
  double wide[4];
  float back[4];
  cast(Tensor(mid, DType::bf16, Device::cpu, {4}), Tensor(in, DType::f32, Device::cpu, {2, 2}));
  cast(Tensor(wide, DType::f64, Device::cpu, {4}), Tensor(mid, DType::bf16, Device::cpu, {4}));
  cast(Tensor(back, DType::f32, Device::cpu, {4}), Tensor(wide, DType::f64, Device::cpu, {4}));
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back[i], in[i], std::abs(in[i]) / 128) << i;
  EXPECT_EQ(back[1], -3.140625f);  // exactly representable in bf16
}

TEST(Cast, RejectsMismatchedCountsAndIntegerTensors) {
  float a[3], b[4];
  int32_t c[3];
  EXPECT_THROW(cast(Tensor(a, DType::f32, Device::cpu, {3}), Tensor(b, DType::f32, Device::cpu, {4})), Error);
  try {
    cast(Tensor(a, DType::f32, Device::cpu, {3}), Tensor(c, DType::i32, Device::cpu, {3}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "cast: in has dtype i32 but only f32, f64 and bf16 are supported");
  }
}

}  // namespace
}  // namespace marrow
