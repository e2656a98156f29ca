#include "ops/dispatch.h"

#include <vector>

#include "core/errors.h"
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

// Expert parallelism's receiver: -1 entries are copies another rank holds; they get no row.
TEST(Dispatch, PlanSkipsAbsentCopies) {
  Buffer topk = i32_buffer({3, 2}, {2, -1, -1, -1, 0, 2});
  Buffer offsets(DType::i32, Device::cpu, {4}), rows(DType::i32, Device::cpu, {3, 2});
  dispatch_plan(offsets, rows, topk);
  EXPECT_EQ(contents(offsets), (std::vector<int32_t>{0, 1, 1, 3}));
  EXPECT_EQ(contents(rows), (std::vector<int32_t>{1, -1, -1, -1, 0, 2}));
  Buffer bad = i32_buffer({1, 2}, {0, -2});
  Buffer rows1(DType::i32, Device::cpu, {1, 2});
  EXPECT_THROW(dispatch_plan(offsets, rows1, bad), Error);
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

// Expert parallelism: copies held by other ranks are -1, and x_perm has R != T * K rows.
TEST(Dispatch, ForwardSkipsAbsentCopies) {
  // Token 0 here in slot 0 only, token 1 not here at all, token 2 in both slots; row 1 is nobody's.
  Buffer rows = i32_buffer({3, 2}, {2, -1, -1, -1, 0, 3});
  double x[6] = {1, 2, 3, 4, 5, 6}, x_perm[8] = {-9, -9, -9, -9, -9, -9, -9, -9};
  dispatch_forward(Tensor(x_perm, DType::f64, Device::cpu, {4, 2}), Tensor(x, DType::f64, Device::cpu, {3, 2}), rows);
  EXPECT_EQ(std::vector<double>(x_perm, x_perm + 8), (std::vector<double>{5, 6, -9, -9, 1, 2, 5, 6}));
}

TEST(Dispatch, BackwardSumsPresentCopiesOnly) {
  Buffer rows = i32_buffer({3, 2}, {2, -1, -1, -1, 0, 3});
  double dx_perm[8] = {1, 2, 30, 40, 5, 6, 700, 800}, dx[6] = {-9, -9, -9, -9, -9, -9};
  dispatch_backward(Tensor(dx, DType::f64, Device::cpu, {3, 2}), Tensor(dx_perm, DType::f64, Device::cpu, {4, 2}), rows);
  EXPECT_EQ(std::vector<double>(dx, dx + 6), (std::vector<double>{5, 6, 0, 0, 701, 802}));
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

TEST(Dispatch, GradientsMatchFiniteDifferencesWithAbsentCopies) {
  // R = 6 rows for T * K = 8 slots: rows 2 and 4 are nobody's, token 2 is not here at all.
  const int64_t n = 4, k = 2, r_rows = 6, h = 5;
  Buffer rows = i32_buffer({n, k}, {3, -1, 0, 5, -1, -1, 1, -1});
  Buffer x = random_buffer(DType::f64, {n, h}, 1), r = random_buffer(DType::f64, {r_rows, h}, 2);
  Buffer x_perm = Buffer::zeros(DType::f64, Device::cpu, {r_rows, h}), dx(DType::f64, Device::cpu, {n, h});
  auto loss = [&] {
    dispatch_forward(x_perm, x, rows);
    return testing::weighted_sum(x_perm, r);
  };
  loss();
  dispatch_backward(dx, r, rows);
  testing::expect_gradient("dx", x, dx, loss);
  for (int64_t c = 0; c < h; ++c) EXPECT_EQ(dx.ptr<double>()[2 * h + c], 0.0);
}

TEST(Dispatch, RejectsExpertOutsideRange) {
  Buffer topk = i32_buffer({2, 2}, {0, 1, 2, 4});
  Buffer offsets(DType::i32, Device::cpu, {5}), rows(DType::i32, Device::cpu, {2, 2});
  try {
    dispatch_plan(offsets, rows, topk);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_plan: topk_index[1, 1] = 4 is neither -1 nor inside [0, 4)");
  }
}

TEST(Dispatch, RejectsMisshapenPermutedRows) {
  Buffer rows = i32_buffer({2, 2}, {0, 1, 2, 3});
  Buffer x(DType::f32, Device::cpu, {2, 3}), x_perm(DType::f32, Device::cpu, {4, 4});
  try {
    dispatch_forward(x_perm, x, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_forward: x_perm has shape [4, 4] but expected [4, 3]");
  }
}

TEST(Dispatch, RejectsRowOutsideRange) {
  // R = 3 rows: 3 is past the end even though T * K = 4.
  Buffer rows = i32_buffer({2, 2}, {0, -1, 2, 3});
  Buffer dx(DType::f32, Device::cpu, {2, 3}), dx_perm(DType::f32, Device::cpu, {3, 3});
  try {
    dispatch_backward(dx, dx_perm, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_backward: copy_row[1, 1] = 3 is neither -1 nor inside [0, 3)");
  }
}

TEST(Dispatch, RejectsNegativeRowOtherThanAbsent) {
  Buffer rows = i32_buffer({2, 2}, {0, -2, 2, -1});
  Buffer x(DType::f32, Device::cpu, {2, 3}), x_perm(DType::f32, Device::cpu, {3, 3});
  try {
    dispatch_forward(x_perm, x, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch_forward: copy_row[0, 1] = -2 is neither -1 nor inside [0, 3)");
  }
}

}  // namespace
}  // namespace marrow
