#include "ops/dispatch.h"

#include <vector>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

Buffer i32_buffer(std::initializer_list<int64_t> dims, const std::vector<int32_t>& values) {
  Buffer b(DType::i32, Device::cpu, dims);
  EXPECT_EQ(b.numel(), int64_t(values.size()));
  std::copy(values.begin(), values.end(), b.ptr<int32_t>());
  return b;
}

std::vector<int32_t> contents(const Buffer& b) { return std::vector<int32_t>(b.ptr<int32_t>(), b.ptr<int32_t>() + b.numel()); }

TEST(Dispatch, PlanOfHandMadeIndex) {
  // Expert 0 gets copies (0,1), (1,0), (2,1); expert 1 none; expert 2 (0,0), (2,0); expert 3 (1,1).
  Buffer topk = i32_buffer({3, 2}, {2, 0, 0, 3, 2, 0});
  Buffer offsets(DType::i32, Device::cpu, {5}), rows(DType::i32, Device::cpu, {3, 2});
  dispatch_plan(offsets, rows, topk);
  EXPECT_EQ(contents(offsets), (std::vector<int32_t>{0, 3, 3, 5, 6}));
  EXPECT_EQ(contents(rows), (std::vector<int32_t>{3, 0, 1, 5, 4, 2}));
}

TEST(Dispatch, PlanOfSingleTokenWithTopKOfAllExperts) {
  Buffer topk = i32_buffer({1, 3}, {2, 0, 1});
  Buffer offsets(DType::i32, Device::cpu, {4}), rows(DType::i32, Device::cpu, {1, 3});
  dispatch_plan(offsets, rows, topk);
  EXPECT_EQ(contents(offsets), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(contents(rows), (std::vector<int32_t>{2, 0, 1}));
}

TEST(Dispatch, ForwardCopiesEachTokenToItsRows) {
  Buffer rows = i32_buffer({2, 2}, {3, 0, 1, 2});
  double x[4] = {1, 2, 3, 4}, x_perm[8];
  dispatch_forward(Tensor(x_perm, DType::f64, Device::cpu, {4, 2}), Tensor(x, DType::f64, Device::cpu, {2, 2}), rows);
  EXPECT_EQ(std::vector<double>(x_perm, x_perm + 8), (std::vector<double>{1, 2, 3, 4, 3, 4, 1, 2}));
}

TEST(Dispatch, GradientsMatchFiniteDifferences) {
  struct Case {
    int64_t n, e, k;
    std::vector<int32_t> topk;
  };
  // An expert with no tokens; a single token with k = E.
  for (const Case& c : {Case{4, 4, 2, {1, 3, 3, 0, 0, 1, 3, 1}}, Case{1, 3, 3, {1, 2, 0}}}) {
    const int64_t h = 5;
    Buffer topk = i32_buffer({c.n, c.k}, c.topk), offsets(DType::i32, Device::cpu, {c.e + 1}),
           rows(DType::i32, Device::cpu, {c.n, c.k});
    dispatch_plan(offsets, rows, topk);
    Buffer x = random_buffer(DType::f64, {c.n, h}, 1), r = random_buffer(DType::f64, {c.n * c.k, h}, 2);
    Buffer x_perm(DType::f64, Device::cpu, {c.n * c.k, h}), dx(DType::f64, Device::cpu, {c.n, h});
    auto loss = [&] {
      dispatch_forward(x_perm, x, rows);
      return testing::weighted_sum(x_perm, r);
    };
    loss();
    dispatch_backward(dx, r, rows);
    testing::expect_gradient("dx", x, dx, loss);
  }
}

TEST(Dispatch, RejectsExpertOutsideRange) {
  Buffer topk = i32_buffer({2, 2}, {0, 1, 2, 4});
  Buffer offsets(DType::i32, Device::cpu, {5}), rows(DType::i32, Device::cpu, {2, 2});
  try {
    dispatch_plan(offsets, rows, topk);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_plan: topk_index[1, 1] = 4 is outside [0, 4)");
  }
}

TEST(Dispatch, RejectsMisshapenPermutedRows) {
  Buffer rows = i32_buffer({2, 2}, {0, 1, 2, 3});
  Buffer x(DType::f32, Device::cpu, {2, 3}), x_perm(DType::f32, Device::cpu, {3, 3});
  try {
    dispatch_forward(x_perm, x, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_forward: x_perm has shape [3, 3] but expected [4, 3]");
  }
}

TEST(Dispatch, RejectsRowOutsideRange) {
  Buffer rows = i32_buffer({2, 2}, {0, -1, 2, 3});
  Buffer dx(DType::f32, Device::cpu, {2, 3}), dx_perm(DType::f32, Device::cpu, {4, 3});
  try {
    dispatch_backward(dx, dx_perm, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_backward: copy_row[0, 1] = -1 is outside [0, 4)");
  }
}

}  // namespace
}  // namespace marrow
