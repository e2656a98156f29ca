#include "ops/add.h"

#include "core/bf16.h"
#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

TEST(Add, AddsElementwiseAcrossShapes) {
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {10, 20, 30, 40, 50, 60}, out[6];
  add(Tensor(out, DType::f32, Device::cpu, {2, 3}), Tensor(a, DType::f32, Device::cpu, {6}),
      Tensor(b, DType::f32, Device::cpu, {3, 2}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], 11 * (i + 1)) << i;
}

TEST(Add, OutMayAliasEitherInput) {
  float a[3] = {1, 2, 3}, b[3] = {4, 5, 6};
  Tensor ta(a, DType::f32, Device::cpu, {3}), tb(b, DType::f32, Device::cpu, {3});
  add(ta, ta, tb);
  add(tb, ta, tb);
  const float want_a[3] = {5, 7, 9}, want_b[3] = {9, 12, 15};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a[i], want_a[i]) << i;
    EXPECT_EQ(b[i], want_b[i]) << i;
  }
}

// add has no backward of its own: the gradient of each input is the output's gradient, as is.
TEST(Add, GradientIsTheOutputGradient) {
  Buffer a = random_buffer(DType::f64, {3, 5}, 1), b = random_buffer(DType::f64, {15}, 2),
         r = random_buffer(DType::f64, {15}, 3);
  Buffer out(DType::f64, Device::cpu, {5, 3});
  auto loss = [&] {
    add(out, a, b);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient("da", a, r, loss);
  testing::expect_gradient("db", b, r, loss);
}

TEST(Add, F32MatchesF64) {
  Buffer a32 = random_buffer(DType::f32, {7, 3}, 1), b32 = random_buffer(DType::f32, {7, 3}, 2);
  Buffer a64 = random_buffer(DType::f64, {7, 3}, 1), b64 = random_buffer(DType::f64, {7, 3}, 2);
  Buffer o32(DType::f32, Device::cpu, {7, 3}), o64(DType::f64, Device::cpu, {7, 3});
  add(o32, a32, b32);
  add(o64, a64, b64);
  for (int64_t i = 0; i < o32.numel(); ++i)
    EXPECT_FLOAT_EQ(float(testing::element(o32, i)), float(testing::element(o64, i))) << i;
}

TEST(Add, RejectsDifferentElementCountsAndDtypes) {
  Buffer out(DType::f32, Device::cpu, {2, 4}), a(DType::f32, Device::cpu, {8}), b(DType::f32, Device::cpu, {2, 3}),
      b64(DType::f64, Device::cpu, {8});
  try {
    add(out, a, b);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "add: b has shape [2, 3] (6 elements) but out has shape [2, 4] (8 elements)");
  }
  try {
    add(out, a, b64);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "add: b has dtype f64 but out has f32");
  }
}

// add_into sums bf16 (or f32) partials into an f32 accumulator, element by element.
TEST(Add, AddIntoAccumulatesBf16AndF32IntoF32) {
  float acc[5] = {1, 2, 3, 4, 5}, x32[5] = {0.5f, -1, 2, 0, 10};
  uint16_t x16[5];
  for (int i = 0; i < 5; ++i) x16[i] = float_to_bf16(x32[i] * 2);
  add_into(Tensor(acc, DType::f32, Device::cpu, {5}), Tensor(x32, DType::f32, Device::cpu, {5}));
  add_into(Tensor(acc, DType::f32, Device::cpu, {5}), Tensor(x16, DType::bf16, Device::cpu, {5}));
  const float want[5] = {2.5f, -1, 9, 4, 35};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(acc[i], want[i]) << i;
  float wrong[4] = {};
  EXPECT_THROW(add_into(Tensor(acc, DType::f32, Device::cpu, {5}), Tensor(wrong, DType::f32, Device::cpu, {4})), Error);
}

}  // namespace
}  // namespace marrow
