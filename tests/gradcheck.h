// Test helpers: random f64/f32 host tensors and a central-difference gradient check in double
// precision. Ops run in f64 here, so analytic and numerical gradients agree to ~1e-7 unless the
// backward is wrong.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/rng.h"

namespace marrow::testing {

inline Buffer random_buffer(DType dtype, std::initializer_list<int64_t> dims, uint64_t seed, double scale = 1.0) {
  Buffer b(dtype, Device::cpu, dims);
  Philox rng = philox_for(seed, "test");
  for (int64_t i = 0; i < b.numel(); ++i) {
    double v = scale * rng.normal(uint64_t(i));
    if (dtype == DType::f64) b.ptr<double>()[i] = v;
    else b.ptr<float>()[i] = float(v);
  }
  return b;
}

inline double element(const Tensor& t, int64_t i) {
  return t.dtype == DType::f64 ? t.ptr<double>()[i] : double(t.ptr<float>()[i]);
}

inline void set_element(const Tensor& t, int64_t i, double v) {
  if (t.dtype == DType::f64) t.ptr<double>()[i] = v;
  else t.ptr<float>()[i] = float(v);
}

// sum_i weights[i] * t[i]: turns an op's output into the scalar whose gradient the check compares.
inline double weighted_sum(const Tensor& t, const Tensor& weights) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += element(t, i) * element(weights, i);
  return s;
}

// Compares analytic[i] with (loss(x + h e_i) - loss(x - h e_i)) / 2h for up to max_checks elements
// of input (spread evenly). loss recomputes the forward from the current contents of input.
inline void expect_gradient(const std::string& what, const Tensor& input, const Tensor& analytic,
                            const std::function<double()>& loss, double tolerance = 1e-6, int64_t max_checks = 64,
                            double h = 1e-6) {
  ASSERT_EQ(input.numel(), analytic.numel()) << what;
  int64_t n = input.numel(), stride = std::max<int64_t>(1, n / max_checks);
  for (int64_t i = 0; i < n; i += stride) {
    double original = element(input, i);
    set_element(input, i, original + h);
    double plus = loss();
    set_element(input, i, original - h);
    double minus = loss();
    set_element(input, i, original);
    double numerical = (plus - minus) / (2 * h), a = element(analytic, i);
    ASSERT_NEAR(a, numerical, tolerance * (1 + std::abs(numerical))) << what << " element " << i;
  }
}

}  // namespace marrow::testing
