#include "ops/route_weight.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/errors.h"

namespace marrow {
namespace {

Tensor f64(double* p, std::initializer_list<int64_t> dims) { return Tensor(p, DType::f64, Device::cpu, dims); }

TEST(RouteWeight, DotsThenScalesEachNamedRowOnce) {
  // Two tokens, two slots: token 0's copies are rows 2 and 0, token 1 has one copy (row 1) and one
  // entry of -1 (a copy on another process).
  int32_t rows[4] = {2, 0, 1, -1};
  double dact[6] = {1, 2, 3, 4, 5, 6}, act[6] = {0.5, -1, 2, 1, -2, 0.25}, w[4] = {0.25, 0.75, 2, 9}, dw[4] = {7, 7, 7, 7};
  route_weight_backward(f64(dw, {2, 2}), f64(dact, {3, 2}), f64(act, {3, 2}), f64(w, {2, 2}),
                        Tensor(rows, DType::i32, Device::cpu, {2, 2}));
  EXPECT_DOUBLE_EQ(dw[0], 5 * -2 + 6 * 0.25);  // row 2
  EXPECT_DOUBLE_EQ(dw[1], 1 * 0.5 + 2 * -1);   // row 0
  EXPECT_DOUBLE_EQ(dw[2], 3 * 2 + 4 * 1);      // row 1
  EXPECT_DOUBLE_EQ(dw[3], 0);                  // -1
  const std::vector<double> want_dact = {0.75, 1.5, 6, 8, 1.25, 1.5}, want_act = {0.375, -0.75, 4, 2, -0.5, 0.0625};
  for (int i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(dact[i], want_dact[size_t(i)]) << "dact element " << i;
    EXPECT_DOUBLE_EQ(act[i], want_act[size_t(i)]) << "act element " << i;
  }
}

TEST(RouteWeight, RejectsARowOutsideTheRows) {
  int32_t rows[2] = {0, 3};
  double dact[6] = {}, act[6] = {}, w[2] = {1, 1}, dw[2];
  try {
    route_weight_backward(f64(dw, {1, 2}), f64(dact, {3, 2}), f64(act, {3, 2}), f64(w, {1, 2}), Tensor(rows, DType::i32, Device::cpu, {1, 2}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "route_weight_backward: copy_row[0, 1] = 3 is neither -1 nor inside [0, 3)");
  }
}

TEST(RouteWeight, RejectsActOfAnotherShape) {
  int32_t rows[2] = {0, 1};
  double dact[6] = {}, act[4] = {}, w[2] = {1, 1}, dw[2];
  try {
    route_weight_backward(f64(dw, {1, 2}), f64(dact, {3, 2}), f64(act, {2, 2}), f64(w, {1, 2}), Tensor(rows, DType::i32, Device::cpu, {1, 2}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "route_weight_backward: act has shape [2, 2] but expected [3, 2]");
  }
}

}  // namespace
}  // namespace marrow
