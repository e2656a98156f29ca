#include "ops/linear.h"

#include <algorithm>

#include "ops/common.h"

namespace marrow {

namespace {

// Eight independent partial sums: one running sum would serialise on the latency of the add, and
// the compiler may not reassociate a float sum by itself. The order is still fixed, so the result
// is deterministic.
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T>
void axpy(T* y, T alpha, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// How many rows of length `cols` make a block that stays in the L2 cache while the loop over the
// other operand's rows reuses it.
template <typename T>
int64_t block_rows(int64_t cols) {
  return std::max<int64_t>(1, (128 << 10) / (std::max<int64_t>(1, cols) * int64_t(sizeof(T))));
}

// Dot products of contiguous rows of x and W, with a block of weight rows held in cache.
template <typename T>
void forward_cpu(T* y, const T* x, const T* w, int64_t n, int64_t in, int64_t out) {
  const int64_t block = block_rows<T>(in);
  for (int64_t o0 = 0; o0 < out; o0 += block) {
    const int64_t o1 = std::min(out, o0 + block);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = o0; o < o1; ++o) y[r * out + o] = dot(x + r * in, w + o * in, in);
  }
}

// dx[r, :] = sum_o dy[r, o] W[o, :] as contiguous row updates, with a block of weight rows in cache.
template <typename T>
void backward_input_cpu(T* dx, const T* dy, const T* w, int64_t n, int64_t in, int64_t out) {
  std::fill(dx, dx + n * in, T(0));
  const int64_t block = block_rows<T>(in);
  for (int64_t o0 = 0; o0 < out; o0 += block) {
    const int64_t o1 = std::min(out, o0 + block);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = o0; o < o1; ++o) axpy(dx + r * in, dy[r * out + o], w + o * in, in);
  }
}

// dW[o, :] += sum_r dy[r, o] x[r, :] as contiguous row updates, with a block of x rows in cache.
// Blocks run in row order, so each element sums its terms in the order r = 0, 1, ...
template <typename T>
void backward_weight_cpu(T* dw, const T* dy, const T* x, int64_t n, int64_t in, int64_t out) {
  const int64_t block = block_rows<T>(in);
  for (int64_t r0 = 0; r0 < n; r0 += block) {
    const int64_t r1 = std::min(n, r0 + block);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t r = r0; r < r1; ++r) axpy(dw + o * in, dy[r * out + o], x + r * in, in);
  }
}

void expect_matrix(const char* op, const char* name, const Tensor& t, const char* dims) {
  MARROW_CHECK(t.ndim == 2, "{}: {} must be {}, got {}", op, name, dims, t.shape_string());
}

}  // namespace

void linear_forward(Tensor y, Tensor x, Tensor weight, Stream stream) {
  const char* op = "linear_forward";
  expect_matrix(op, "x", x, "[rows, in]");
  expect_matrix(op, "weight", weight, "[out, in]");
  const int64_t n = x.size(0), in = x.size(1), out = weight.size(0);
  expect_shape(op, "weight", weight, {out, in});
  expect_shape(op, "y", y, {n, out});
  expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"weight", &weight}});
  if (common_device(op, {{"x", &x}, {"y", &y}, {"weight", &weight}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(y.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), n, in, out);
  });
}

void linear_backward_input(Tensor dx, Tensor dy, Tensor weight, Stream stream) {
  const char* op = "linear_backward_input";
  expect_matrix(op, "dy", dy, "[rows, out]");
  expect_matrix(op, "weight", weight, "[out, in]");
  const int64_t n = dy.size(0), out = weight.size(0), in = weight.size(1);
  expect_shape(op, "dy", dy, {n, out});
  expect_shape(op, "dx", dx, {n, in});
  expect_same_dtype(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}});
  if (common_device(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    backward_input_cpu<T>(dx.ptr<T>(), dy.ptr<T>(), weight.ptr<T>(), n, in, out);
  });
}

void linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, Stream stream) {
  const char* op = "linear_backward_weight";
  expect_matrix(op, "x", x, "[rows, in]");
  expect_matrix(op, "dy", dy, "[rows, out]");
  const int64_t n = x.size(0), in = x.size(1), out = dy.size(1);
  expect_shape(op, "dy", dy, {n, out});
  expect_shape(op, "dweight", dweight, {out, in});
  expect_same_dtype(op, {{"x", &x}, {"dy", &dy}, {"dweight", &dweight}});
  if (common_device(op, {{"x", &x}, {"dy", &dy}, {"dweight", &dweight}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    backward_weight_cpu<T>(dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), n, in, out);
  });
}

}  // namespace marrow
