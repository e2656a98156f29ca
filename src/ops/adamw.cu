#include "ops/adamw.h"

#include <cmath>

#include "ops/common.h"

namespace marrow {

namespace {

// In torch's order of operations (the moments are rounded to T before use; the denominator is
// sqrt(v) / sqrt(1 - beta2^step) + eps), so results stay as close to torch's as the double
// intermediates allow.
template <typename T>
void step_cpu(T* param, const T* grad, T* m, T* v, int64_t n, const AdamWHyper& hp) {
  const double decay = 1 - hp.lr * hp.weight_decay;
  const double step_size = hp.lr / (1 - std::pow(hp.beta1, double(hp.step)));
  const double bias2_sqrt = std::sqrt(1 - std::pow(hp.beta2, double(hp.step)));
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad[i];
    m[i] = T(hp.beta1 * m[i] + (1 - hp.beta1) * g);
    v[i] = T(hp.beta2 * v[i] + (1 - hp.beta2) * g * g);
    const double denom = std::sqrt(double(v[i])) / bias2_sqrt + hp.eps;
    param[i] = T(double(param[i]) * decay - step_size * double(m[i]) / denom);
  }
}

}  // namespace

void adamw_step(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const AdamWHyper& hyper, Stream stream) {
  const char* op = "adamw_step";
  for (auto [name, t] : {std::pair{"grad", &grad}, std::pair{"exp_avg", &exp_avg}, std::pair{"exp_avg_sq", &exp_avg_sq}})
    MARROW_CHECK(t->numel() == param.numel(), "{}: {} has {} elements but param has {}", op, name, t->numel(), param.numel());
  expect_same_dtype(op, {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  MARROW_CHECK(hyper.step >= 1, "{}: step is 1-based, got {}", op, hyper.step);
  MARROW_CHECK(0 <= hyper.beta1 && hyper.beta1 < 1 && 0 <= hyper.beta2 && hyper.beta2 < 1,
               "{}: beta1 and beta2 must be in [0, 1), got {} and {}", op, hyper.beta1, hyper.beta2);
  if (common_device(op, {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}}) ==
      Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, param, [&](auto s) {
    using T = decltype(s);
    step_cpu<T>(param.ptr<T>(), grad.ptr<T>(), exp_avg.ptr<T>(), exp_avg_sq.ptr<T>(), param.numel(), hyper);
  });
}

}  // namespace marrow
