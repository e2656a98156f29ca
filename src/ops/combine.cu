#include "ops/combine.h"

#include <array>

#include "ops/common.h"

namespace marrow {

namespace {

// Each element of out is written once, after its own residual element is read, so out may alias
// residual.
template <typename T>
void forward_cpu(T* out, const T* residual, const T* y_perm, const T* topk_weight, const int32_t* copy_row, int64_t n,
                 int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += double(topk_weight[t * k + j]) * y_perm[int64_t(copy_row[t * k + j]) * h + c];
      out[t * h + c] = T(residual[t * h + c] + sum);
    }
}

template <typename T>
void backward_cpu(T* dy_perm, T* dtopk_weight, const T* dout, const T* y_perm, const T* topk_weight, const int32_t* copy_row,
                  int64_t n, int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = copy_row[t * k + j];
      const double w = topk_weight[t * k + j];
      double dot = 0;
      for (int64_t c = 0; c < h; ++c) {
        dot += double(dout[t * h + c]) * y_perm[row * h + c];
        dy_perm[row * h + c] = T(w * dout[t * h + c]);
      }
      dtopk_weight[t * k + j] = T(dot);
    }
}

// Checks tokens[T, H] against rows[T * K, H], topk_weight[T, K] and copy_row[T, K] (i32); returns (T, K, H).
std::array<int64_t, 3> check_combine(const char* op, const char* tokens_name, const Tensor& tokens, const char* rows_name,
                                     const Tensor& rows, const Tensor& topk_weight, const Tensor& copy_row) {
  MARROW_CHECK(tokens.ndim == 2, "{}: {} must be [tokens, hidden], got {}", op, tokens_name, tokens.shape_string());
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  const int64_t n = tokens.size(0), h = tokens.size(1), k = copy_row.size(1);
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_shape(op, rows_name, rows, {n * k, h});
  return {n, k, h};
}

}  // namespace

void combine_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const char* op = "combine_forward";
  auto [n, k, h] = check_combine(op, "residual", residual, "y_perm", y_perm, topk_weight, copy_row);
  expect_shape(op, "out", out, {n, h});
  expect_same_dtype(op, {{"residual", &residual}, {"out", &out}, {"y_perm", &y_perm}, {"topk_weight", &topk_weight}});
  if (common_device(op, {{"residual", &residual},
                         {"out", &out},
                         {"y_perm", &y_perm},
                         {"topk_weight", &topk_weight},
                         {"copy_row", &copy_row}}) == Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  expect_indices_below(op, "copy_row", copy_row, n * k);
  with_cpu_scalar(op, residual, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), residual.ptr<T>(), y_perm.ptr<T>(), topk_weight.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

void combine_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, Tensor y_perm, Tensor topk_weight, Tensor copy_row,
                      Stream stream) {
  const char* op = "combine_backward";
  auto [n, k, h] = check_combine(op, "dout", dout, "y_perm", y_perm, topk_weight, copy_row);
  expect_shape(op, "dy_perm", dy_perm, {n * k, h});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  expect_same_dtype(op, {{"dout", &dout},
                         {"dy_perm", &dy_perm},
                         {"dtopk_weight", &dtopk_weight},
                         {"y_perm", &y_perm},
                         {"topk_weight", &topk_weight}});
  if (common_device(op, {{"dout", &dout},
                         {"dy_perm", &dy_perm},
                         {"dtopk_weight", &dtopk_weight},
                         {"y_perm", &y_perm},
                         {"topk_weight", &topk_weight},
                         {"copy_row", &copy_row}}) == Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  expect_indices_below(op, "copy_row", copy_row, n * k);
  with_cpu_scalar(op, dout, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dy_perm.ptr<T>(), dtopk_weight.ptr<T>(), dout.ptr<T>(), y_perm.ptr<T>(), topk_weight.ptr<T>(),
                    copy_row.ptr<int32_t>(), n, k, h);
  });
}

}  // namespace marrow
