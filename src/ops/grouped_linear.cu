#include "ops/grouped_linear.h"

#include <algorithm>
#include <array>
#include <vector>

#include "ops/common.h"

namespace marrow {

namespace {

template <typename T>
void forward_cpu(T* y, const T* x, const T* weight, const int32_t* offsets, int64_t e, int64_t o, int64_t in) {
  for (int64_t g = 0; g < e; ++g)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r)
      for (int64_t i = 0; i < o; ++i) {
        const T *w = weight + (g * o + i) * in, *xr = x + r * in;
        double sum = 0;
        for (int64_t c = 0; c < in; ++c) sum += double(xr[c]) * w[c];
        y[r * o + i] = T(sum);
      }
}

template <typename T>
void backward_input_cpu(T* dx, const T* dy, const T* weight, const int32_t* offsets, int64_t e, int64_t o, int64_t in) {
  std::vector<double> sum(in);
  for (int64_t g = 0; g < e; ++g)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t i = 0; i < o; ++i) {
        const T* w = weight + (g * o + i) * in;
        const double d = dy[r * o + i];
        for (int64_t c = 0; c < in; ++c) sum[c] += d * w[c];
      }
      for (int64_t c = 0; c < in; ++c) dx[r * in + c] = T(sum[c]);
    }
}

template <typename T>
void backward_weight_cpu(T* dweight, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t o, int64_t in) {
  std::vector<double> sum(in);
  for (int64_t g = 0; g < e; ++g)
    for (int64_t i = 0; i < o; ++i) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
        const double d = dy[r * o + i];
        for (int64_t c = 0; c < in; ++c) sum[c] += d * x[r * in + c];
      }
      T* dw = dweight + (g * o + i) * in;
      for (int64_t c = 0; c < in; ++c) dw[c] = T(dw[c] + sum[c]);
    }
}

// weight[E, O, I]: returns (E, O, I).
std::array<int64_t, 3> weight_sizes(const char* op, const char* name, const Tensor& weight) {
  MARROW_CHECK(weight.ndim == 3, "{}: {} must be [experts, out, in], got {}", op, name, weight.shape_string());
  return {weight.size(0), weight.size(1), weight.size(2)};
}

// The offsets drive raw row loops, so they must split [0, rows) into consecutive groups.
void check_offsets(const char* op, const Tensor& offsets, int64_t experts, int64_t rows) {
  expect_shape(op, "expert_offsets", offsets, {experts + 1});
  expect_dtype(op, "expert_offsets", offsets, DType::i32);
  expect_device(op, "expert_offsets", offsets, Device::cpu);
  const int32_t* o = offsets.ptr<int32_t>();
  MARROW_CHECK(o[0] == 0 && o[experts] == rows, "{}: expert_offsets must run from 0 to the {} rows, got {} to {}", op, rows,
               o[0], o[experts]);
  for (int64_t g = 0; g < experts; ++g)
    MARROW_CHECK(o[g] <= o[g + 1],
                 "{}: expert_offsets must not decrease, got expert_offsets[{}] = {} > expert_offsets[{}] = {}", op, g, o[g],
                 g + 1, o[g + 1]);
}

// R from a [rows, cols] tensor.
int64_t row_count(const char* op, const char* name, const Tensor& t) {
  MARROW_CHECK(t.ndim == 2, "{}: {} must be [rows, features], got {}", op, name, t.shape_string());
  return t.size(0);
}

}  // namespace

void grouped_linear_forward(Tensor y, Tensor x, Tensor weight, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_linear_forward";
  auto [e, o, in] = weight_sizes(op, "weight", weight);
  const int64_t r = row_count(op, "x", x);
  expect_shape(op, "x", x, {r, in});
  expect_shape(op, "y", y, {r, o});
  expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"weight", &weight}});
  check_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"x", &x}, {"y", &y}, {"weight", &weight}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(y.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
  });
}

void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor weight, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_linear_backward_input";
  auto [e, o, in] = weight_sizes(op, "weight", weight);
  const int64_t r = row_count(op, "dy", dy);
  expect_shape(op, "dy", dy, {r, o});
  expect_shape(op, "dx", dx, {r, in});
  expect_same_dtype(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}});
  check_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    backward_input_cpu<T>(dx.ptr<T>(), dy.ptr<T>(), weight.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
  });
}

void grouped_linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_linear_backward_weight";
  auto [e, o, in] = weight_sizes(op, "dweight", dweight);
  const int64_t r = row_count(op, "dy", dy);
  expect_shape(op, "dy", dy, {r, o});
  expect_shape(op, "x", x, {r, in});
  expect_same_dtype(op, {{"dy", &dy}, {"dweight", &dweight}, {"x", &x}});
  check_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"dy", &dy}, {"dweight", &dweight}, {"x", &x}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    backward_weight_cpu<T>(dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
  });
}

}  // namespace marrow
