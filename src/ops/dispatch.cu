#include "ops/dispatch.h"

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "ops/common.h"

namespace marrow {

namespace {

void plan_cpu(int32_t* expert_offsets, int32_t* copy_row, const int32_t* topk_index, int64_t copies, int64_t experts) {
  std::vector<int32_t> next(experts + 1, 0);
  for (int64_t i = 0; i < copies; ++i) ++next[topk_index[i] + 1];
  for (int64_t e = 0; e < experts; ++e) next[e + 1] += next[e];
  for (int64_t e = 0; e <= experts; ++e) expert_offsets[e] = next[e];
  // Copies are visited in (token, slot) order, which is the order within each expert's block.
  for (int64_t i = 0; i < copies; ++i) copy_row[i] = next[topk_index[i]]++;
}

template <typename T>
void forward_cpu(T* x_perm, const T* x, const int32_t* copy_row, int64_t n, int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) std::copy(x + t * h, x + (t + 1) * h, x_perm + int64_t(copy_row[t * k + j]) * h);
}

template <typename T>
void backward_cpu(T* dx, const T* dx_perm, const int32_t* copy_row, int64_t n, int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += dx_perm[int64_t(copy_row[t * k + j]) * h + c];
      dx[t * h + c] = T(sum);
    }
}

// Checks copy_row[T, K] (i32) against tokens[T, H] and rows[T * K, H]; returns (T, K, H).
std::array<int64_t, 3> check_permute(const char* op, const char* tokens_name, const Tensor& tokens, const char* rows_name,
                                     const Tensor& rows, const Tensor& copy_row) {
  MARROW_CHECK(tokens.ndim == 2, "{}: {} must be [tokens, hidden], got {}", op, tokens_name, tokens.shape_string());
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  const int64_t n = tokens.size(0), h = tokens.size(1), k = copy_row.size(1);
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, rows_name, rows, {n * k, h});
  expect_same_dtype(op, {{tokens_name, &tokens}, {rows_name, &rows}});
  if (common_device(op, {{tokens_name, &tokens}, {rows_name, &rows}, {"copy_row", &copy_row}}) == Device::cuda)
    no_cuda_kernel(op);
  expect_indices_below(op, "copy_row", copy_row, n * k);
  return {n, k, h};
}

}  // namespace

void dispatch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream) {
  const char* op = "dispatch_plan";
  MARROW_CHECK(topk_index.ndim == 2, "{}: topk_index must be [tokens, k], got {}", op, topk_index.shape_string());
  MARROW_CHECK(expert_offsets.ndim == 1 && expert_offsets.size(0) >= 1, "{}: expert_offsets must be [experts + 1], got {}", op,
               expert_offsets.shape_string());
  const int64_t n = topk_index.size(0), k = topk_index.size(1), e = expert_offsets.size(0) - 1;
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "topk_index", topk_index, DType::i32);
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_dtype(op, "expert_offsets", expert_offsets, DType::i32);
  MARROW_CHECK(n * k <= std::numeric_limits<int32_t>::max(), "{}: {} token copies do not fit the i32 row indices", op, n * k);
  if (common_device(op, {{"topk_index", &topk_index}, {"copy_row", &copy_row}, {"expert_offsets", &expert_offsets}}) ==
      Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  expect_indices_below(op, "topk_index", topk_index, e);
  plan_cpu(expert_offsets.ptr<int32_t>(), copy_row.ptr<int32_t>(), topk_index.ptr<int32_t>(), n * k, e);
}

void dispatch_forward(Tensor x_perm, Tensor x, Tensor copy_row, Stream stream) {
  const char* op = "dispatch_forward";
  auto [n, k, h] = check_permute(op, "x", x, "x_perm", x_perm, copy_row);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(x_perm.ptr<T>(), x.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

void dispatch_backward(Tensor dx, Tensor dx_perm, Tensor copy_row, Stream stream) {
  const char* op = "dispatch_backward";
  auto [n, k, h] = check_permute(op, "dx", dx, "dx_perm", dx_perm, copy_row);
  (void)stream;
  with_cpu_scalar(op, dx, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dx_perm.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

}  // namespace marrow
