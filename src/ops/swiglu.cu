#include "ops/swiglu.h"

#include <array>
#include <cmath>

#include "ops/common.h"

namespace marrow {

namespace {

// 1 / (1 + exp(-g)) saturates cleanly at both ends: exp overflows to inf for g << 0, giving 0.
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

template <typename T>
void forward_cpu(T* out, const T* gate_up, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const double g = gate_up[r * 2 * d + c], u = gate_up[r * 2 * d + d + c];
      out[r * d + c] = T(g * sigmoid(g) * u);
    }
}

template <typename T>
void backward_cpu(T* dgate_up, const T* dout, const T* gate_up, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const double g = gate_up[r * 2 * d + c], u = gate_up[r * 2 * d + d + c], s = sigmoid(g), dy = dout[r * d + c];
      dgate_up[r * 2 * d + c] = T(dy * u * s * (1 + g * (1 - s)));
      dgate_up[r * 2 * d + d + c] = T(dy * g * s);
    }
}

// gate_up[R, 2I]: returns (R, I).
std::array<int64_t, 2> check_gate_up(const char* op, const Tensor& gate_up) {
  MARROW_CHECK(gate_up.ndim == 2 && gate_up.size(1) % 2 == 0, "{}: gate_up must be [rows, 2 * intermediate], got {}", op,
               gate_up.shape_string());
  return {gate_up.size(0), gate_up.size(1) / 2};
}

}  // namespace

void swiglu_forward(Tensor out, Tensor gate_up, Stream stream) {
  const char* op = "swiglu_forward";
  auto [n, d] = check_gate_up(op, gate_up);
  expect_shape(op, "out", out, {n, d});
  expect_same_dtype(op, {{"gate_up", &gate_up}, {"out", &out}});
  if (common_device(op, {{"gate_up", &gate_up}, {"out", &out}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), gate_up.ptr<T>(), n, d);
  });
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, Stream stream) {
  const char* op = "swiglu_backward";
  auto [n, d] = check_gate_up(op, gate_up);
  expect_shape(op, "dgate_up", dgate_up, {n, 2 * d});
  expect_shape(op, "dout", dout, {n, d});
  expect_same_dtype(op, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"dout", &dout}});
  if (common_device(op, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"dout", &dout}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dgate_up.ptr<T>(), dout.ptr<T>(), gate_up.ptr<T>(), n, d);
  });
}

}  // namespace marrow
