#include "ops/rmsnorm.h"

#include <cmath>

#include "ops/common.h"

namespace marrow {

namespace {

template <typename T>
void forward_cpu(T* y, T* rstd, const T* x, const T* weight, int64_t n, int64_t d, double eps) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    double sum = 0;
    for (int64_t j = 0; j < d; ++j) sum += double(xi[j]) * xi[j];
    T r = T(1.0 / std::sqrt(sum / double(d) + eps));
    rstd[i] = r;
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = xi[j] * r * weight[j];
  }
}

// With xhat = x * rstd: dweight += sum_i dy * xhat;
// dx = rstd * (dy * w - xhat * mean_j(dy * w * xhat)).
template <typename T>
void backward_cpu(T* dx, T* dweight, const T* dy, const T* x, const T* weight, const T* rstd, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const T *xi = x + i * d, *dyi = dy + i * d;
    double r = rstd[i], dot = 0;
    for (int64_t j = 0; j < d; ++j) dot += double(dyi[j]) * weight[j] * xi[j] * r;
    double mean = dot / double(d);
    for (int64_t j = 0; j < d; ++j) {
      double xhat = xi[j] * r;
      dweight[j] += T(dyi[j] * xhat);
      dx[i * d + j] = T(r * (double(dyi[j]) * weight[j] - xhat * mean));
    }
  }
}

}  // namespace

void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, double eps, Stream stream) {
  const char* op = "rmsnorm_forward";
  MARROW_CHECK(x.ndim == 2, "{}: x must be [rows, dim], got {}", op, x.shape_string());
  const int64_t n = x.size(0), d = x.size(1);
  expect_shape(op, "y", y, {n, d});
  expect_shape(op, "rstd", rstd, {n});
  expect_shape(op, "weight", weight, {d});
  expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"rstd", &rstd}, {"weight", &weight}});
  if (common_device(op, {{"x", &x}, {"y", &y}, {"rstd", &rstd}, {"weight", &weight}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(y.ptr<T>(), rstd.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), n, d, eps);
  });
}

void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Tensor rstd, Stream stream) {
  const char* op = "rmsnorm_backward";
  MARROW_CHECK(x.ndim == 2, "{}: x must be [rows, dim], got {}", op, x.shape_string());
  const int64_t n = x.size(0), d = x.size(1);
  expect_shape(op, "dx", dx, {n, d});
  expect_shape(op, "dy", dy, {n, d});
  expect_shape(op, "dweight", dweight, {d});
  expect_shape(op, "weight", weight, {d});
  expect_shape(op, "rstd", rstd, {n});
  expect_same_dtype(op, {{"x", &x}, {"dx", &dx}, {"dy", &dy}, {"dweight", &dweight}, {"weight", &weight}, {"rstd", &rstd}});
  if (common_device(op, {{"x", &x}, {"dx", &dx}, {"dy", &dy}, {"dweight", &dweight}, {"weight", &weight}, {"rstd", &rstd}}) ==
      Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), rstd.ptr<T>(), n, d);
  });
}

}  // namespace marrow
