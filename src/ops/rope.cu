#include "ops/rope.h"

#include <cmath>
#include <vector>

#include "ops/common.h"

namespace marrow {

namespace {

// Rotates every head of every token by +angle (sign 1) or -angle (sign -1). Each pair is read into
// locals before it is written, which is what lets the output alias the input.
template <typename T>
void rotate_cpu(T* y, const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t d, double theta,
                int sign) {
  const int64_t half = d / 2;
  // The float32 steps of transformers: arange(0, D, 2).float() / D, base ** that, 1.0 / that.
  std::vector<float> inv_freq(half);
  for (int64_t j = 0; j < half; ++j) inv_freq[j] = 1.0f / std::pow(float(theta), float(2 * j) / float(d));
  std::vector<T> cosines(half), sines(half);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      float angle = float(positions[t]) * inv_freq[j];
      cosines[j] = T(std::cos(angle));
      sines[j] = T(sign * std::sin(angle));
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * d;
      for (int64_t j = 0; j < half; ++j) {
        T a = x[base + j], b = x[base + j + half];
        y[base + j] = a * cosines[j] - b * sines[j];
        y[base + j + half] = b * cosines[j] + a * sines[j];
      }
    }
  }
}

void rotate(const char* op, Tensor y, const char* y_name, Tensor x, const char* x_name, Tensor positions, double theta,
            int sign) {
  MARROW_CHECK(x.ndim == 3, "{}: {} must be [tokens, heads, head_dim], got {}", op, x_name, x.shape_string());
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  MARROW_CHECK(d % 2 == 0, "{}: head_dim of {} must be even, got {}", op, x_name, d);
  MARROW_CHECK(theta > 0, "{}: theta must be positive, got {}", op, theta);
  expect_shape(op, y_name, y, {tokens, heads, d});
  expect_shape(op, "positions", positions, {tokens});
  expect_dtype(op, "positions", positions, DType::i32);
  expect_same_dtype(op, {{x_name, &x}, {y_name, &y}});
  if (common_device(op, {{x_name, &x}, {y_name, &y}, {"positions", &positions}}) == Device::cuda) no_cuda_kernel(op);
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    rotate_cpu<T>(y.ptr<T>(), x.ptr<T>(), positions.ptr<int32_t>(), tokens, heads, d, theta, sign);
  });
}

}  // namespace

void rope_forward(Tensor y, Tensor x, Tensor positions, double theta, Stream stream) {
  (void)stream;
  rotate("rope_forward", y, "y", x, "x", positions, theta, 1);
}

void rope_backward(Tensor dx, Tensor dy, Tensor positions, double theta, Stream stream) {
  (void)stream;
  rotate("rope_backward", dx, "dx", dy, "dy", positions, theta, -1);
}

}  // namespace marrow
