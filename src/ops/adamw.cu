#include "ops/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
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


#ifdef __CUDACC__
// The step's constants, computed on the host exactly as step_cpu computes them.
struct Constants {
  double beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, bias2_sqrt, eps;
};

// step_cpu's formula in double, each operation rounded on its own (__d*_rn: no fused
// multiply-adds, as the CPU computes it), so GPU and CPU results agree bit for bit.
__device__ void step_element(float& param, float grad, float& m, float& v, const Constants& k) {
  const double g = grad;
  m = float(__dadd_rn(__dmul_rn(k.beta1, m), __dmul_rn(k.one_minus_beta1, g)));
  v = float(__dadd_rn(__dmul_rn(k.beta2, v), __dmul_rn(__dmul_rn(k.one_minus_beta2, g), g)));
  const double denom = __dadd_rn(__ddiv_rn(__dsqrt_rn(double(v)), k.bias2_sqrt), k.eps);
  param = float(__dsub_rn(__dmul_rn(double(param), k.decay), __ddiv_rn(__dmul_rn(k.step_size, double(m)), denom)));
}

// Elementwise, grid-stride: one thread per float4 of the four tensors when all are 16-byte
// aligned (Vec4), then the n % 4 tail one element per thread.
template <bool Vec4>
__global__ void step_kernel(float* param, const float* grad, float* m, float* v, int64_t n, Constants k) {
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (Vec4) {
    for (int64_t i = first; i < n / 4; i += stride) {
      float4 p = reinterpret_cast<float4*>(param)[i], mm = reinterpret_cast<float4*>(m)[i], vv = reinterpret_cast<float4*>(v)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      step_element(p.x, g.x, mm.x, vv.x, k);
      step_element(p.y, g.y, mm.y, vv.y, k);
      step_element(p.z, g.z, mm.z, vv.z, k);
      step_element(p.w, g.w, mm.w, vv.w, k);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(m)[i] = mm;
      reinterpret_cast<float4*>(v)[i] = vv;
    }
    done = n / 4 * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) step_element(param[i], grad[i], m[i], v[i], k);
}

void launch_step(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const AdamWHyper& hp, Stream stream) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const Constants k{hp.beta1,
                    1 - hp.beta1,
                    hp.beta2,
                    1 - hp.beta2,
                    1 - hp.lr * hp.weight_decay,
                    hp.lr / (1 - std::pow(hp.beta1, double(hp.step))),
                    std::sqrt(1 - std::pow(hp.beta2, double(hp.step))),
                    hp.eps};
  const bool vec4 = (reinterpret_cast<uintptr_t>(param.data) | reinterpret_cast<uintptr_t>(grad.data) |
                     reinterpret_cast<uintptr_t>(exp_avg.data) | reinterpret_cast<uintptr_t>(exp_avg_sq.data)) % 16 == 0;
  const int threads = 256, blocks = int(std::min<int64_t>((n / (vec4 ? 4 : 1) + threads) / threads, 8192));
  auto s = static_cast<cudaStream_t>(stream.handle);
  float *p = param.ptr<float>(), *m = exp_avg.ptr<float>(), *v = exp_avg_sq.ptr<float>();
  if (vec4) step_kernel<true><<<blocks, threads, 0, s>>>(p, grad.ptr<float>(), m, v, n, k);
  else step_kernel<false><<<blocks, threads, 0, s>>>(p, grad.ptr<float>(), m, v, n, k);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

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
      Device::cuda) {
    expect_dtype(op, "param", param, DType::f32);
#ifdef __CUDACC__
    return launch_step(param, grad, exp_avg, exp_avg_sq, hyper, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  with_cpu_scalar(op, param, [&](auto s) {
    using T = decltype(s);
    step_cpu<T>(param.ptr<T>(), grad.ptr<T>(), exp_avg.ptr<T>(), exp_avg_sq.ptr<T>(), param.numel(), hyper);
  });
}

}  // namespace marrow
