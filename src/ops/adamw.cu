#include "ops/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

// A moment as stored: T itself, or (moments in bf16) the value rounded to float, then to bf16.
template <typename T> struct StoredMoment {
  using Storage = T;
  static double load(T x) { return double(x); }
  static T store(double x) { return T(x); }
};
template <> struct StoredMoment<uint16_t> {
  using Storage = uint16_t;
  static double load(uint16_t x) { return double(bf16_to_float(x)); }
  static uint16_t store(double x) { return float_to_bf16(float(x)); }
};

// In torch's order of operations (the moments are rounded to their storage before use; the
// denominator is sqrt(v) / sqrt(1 - beta2^step) + eps), so results stay as close to torch's as the
// double intermediates allow. M: the moments' storage, T or uint16_t (bf16).
// param_bf16 may be null; known_zero (null: none): rows of `per_row` elements whose gradient is
// taken as zero without reading it (a zero's sign never shows: m + (-0) = m, (-0)^2 = +0).
template <typename T, typename M>
void step_cpu(T* param, uint16_t* param_bf16, M* m, M* v, const T* grad, int64_t n, const AdamWHyper& hp,
              const int32_t* known_zero = nullptr, int64_t per_row = 1) {
  using Moment = StoredMoment<M>;
  const double decay = 1 - hp.lr * hp.weight_decay;
  const double step_size = hp.lr / (1 - std::pow(hp.beta1, double(hp.step)));
  const double bias2_sqrt = std::sqrt(1 - std::pow(hp.beta2, double(hp.step)));
  for (int64_t i = 0; i < n; ++i) {
    const double g = known_zero && known_zero[i / per_row] ? 0.0 : double(grad[i]) * hp.grad_scale;
    m[i] = Moment::store(hp.beta1 * Moment::load(m[i]) + (1 - hp.beta1) * g);
    v[i] = Moment::store(hp.beta2 * Moment::load(v[i]) + (1 - hp.beta2) * g * g);
    const double denom = std::sqrt(Moment::load(v[i])) / bias2_sqrt + hp.eps;
    param[i] = T(double(param[i]) * decay - step_size * Moment::load(m[i]) / denom);
    if (param_bf16) param_bf16[i] = float_to_bf16(float(param[i]));
  }
}

#ifdef __CUDACC__
// The step's constants, computed on the host exactly as step_cpu computes them.
struct Constants {
  double grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, bias2_sqrt, eps;
};

// A moment as its storage holds it: the float itself, or (bf16 storage) the float rounded to bf16.
__device__ __forceinline__ float stored(float x, float) { return x; }
__device__ __forceinline__ float stored(float x, __nv_bfloat16) { return __bfloat162float(__float2bfloat16_rn(x)); }

// step_cpu's formula in double, each operation rounded on its own (__d*_rn: no fused
// multiply-adds, as the CPU computes it), so GPU and CPU results agree bit for bit. A zero moment
// skips the square root and divisions whose results it knows exactly (0 / x = 0 of the
// numerator's sign for x > 0): their zero operands take the slow paths of __dsqrt_rn and
// __ddiv_rn, and the rows of an embedding that a step did not see are zero for many steps.
// M: the moments' storage (float or __nv_bfloat16); m and v come back as it holds them.
template <typename M>
__device__ void step_element(float& param, float grad, float& m, float& v, const Constants& k) {
  const double g = __dmul_rn(double(grad), k.grad_scale);
  m = stored(float(__dadd_rn(__dmul_rn(k.beta1, m), __dmul_rn(k.one_minus_beta1, g))), M{});
  v = stored(float(__dadd_rn(__dmul_rn(k.beta2, v), __dmul_rn(__dmul_rn(k.one_minus_beta2, g), g))), M{});
  const double denom = v == 0.0f ? k.eps : __dadd_rn(__ddiv_rn(__dsqrt_rn(double(v)), k.bias2_sqrt), k.eps);
  const double scaled_m = __dmul_rn(k.step_size, double(m));
  const double update = m == 0.0f && denom > 0 ? scaled_m : __ddiv_rn(scaled_m, denom);
  param = float(__dsub_rn(__dmul_rn(double(param), k.decay), update));
}

// Four consecutive values (element 4i on) of a float or bf16 array; bf16 stores round to nearest.
__device__ __forceinline__ float4 load4(const float* p, int64_t i) { return reinterpret_cast<const float4*>(p)[i]; }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p, int64_t i) {
  const uint2 packed = reinterpret_cast<const uint2*>(p)[i];
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void store4(float* p, int64_t i, float4 x) { reinterpret_cast<float4*>(p)[i] = x; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, int64_t i, float4 x) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  reinterpret_cast<uint2*>(p)[i] = packed;
}

// Float4 i of param, the moments and the gradient, loaded.
struct Float4s {
  float4 p, m, v, g;
};
template <typename M>
__device__ __forceinline__ Float4s load_float4s(const float* param, const M* m, const M* v, const float* grad, int64_t i) {
  return {load4(param, i), load4(m, i), load4(v, i), grad ? load4(grad, i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
}

// Steps float4 i (loaded in x) and stores it; param_bf16 may be null.
template <typename M>
__device__ __forceinline__ void step_float4(float* param, __nv_bfloat16* param_bf16, M* m, M* v, Float4s x, int64_t i, const Constants& k) {
  step_element<M>(x.p.x, x.g.x, x.m.x, x.v.x, k);
  step_element<M>(x.p.y, x.g.y, x.m.y, x.v.y, k);
  step_element<M>(x.p.z, x.g.z, x.m.z, x.v.z, k);
  step_element<M>(x.p.w, x.g.w, x.m.w, x.v.w, k);
  store4(param, i, x.p);
  store4(m, i, x.m);
  store4(v, i, x.v);
  if (param_bf16) store4(param_bf16, i, x.p);
}

// Float4s first, first + stride, ... below count4, grid-stride; grad null: a zero gradient, not
// read. Two float4s a thread are loaded before either is stepped, so that ~2 x 48 bytes (bf16
// moments) or 2 x 64 (fp32) are in flight per thread while the FP64 arithmetic runs.
template <typename M>
__device__ __forceinline__ void step_float4s(float* param, __nv_bfloat16* param_bf16, M* m, M* v, const float* grad, int64_t count4,
                                             int64_t first, int64_t stride, const Constants& k) {
  for (int64_t i = first; i < count4; i += 2 * stride) {
    const int64_t j = i + stride;
    const Float4s a = load_float4s(param, m, v, grad, i);
    Float4s b{};
    if (j < count4) b = load_float4s(param, m, v, grad, j);
    step_float4(param, param_bf16, m, v, a, i, k);
    if (j < count4) step_float4(param, param_bf16, m, v, b, j, k);
  }
}

__device__ __forceinline__ float load1(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load1(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store1(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store1(__nv_bfloat16* p, int64_t i, float x) { p[i] = __float2bfloat16_rn(x); }

// One element of the tail (the n % 4 left after the float4s).
template <typename M>
__device__ __forceinline__ void step_one(float* param, __nv_bfloat16* param_bf16, M* m, M* v, float g, int64_t i, const Constants& k) {
  float mi = load1(m, i), vi = load1(v, i);
  step_element<M>(param[i], g, mi, vi, k);
  store1(m, i, mi);
  store1(v, i, vi);
  if (param_bf16) store1(param_bf16, i, param[i]);
}

// Elementwise, grid-stride: one thread per float4 of the four tensors when all are 16-byte
// aligned (the bf16 ones 8-byte) (Vec4), then the n % 4 tail one element per thread. param_bf16
// may be null. M: the moments' storage.
template <bool Vec4, typename M>
__global__ void adamw_step_kernel(float* param, __nv_bfloat16* param_bf16, M* m, M* v, const float* grad, int64_t n, Constants k) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (Vec4) {
    step_float4s(param, param_bf16, m, v, grad, n / 4, first, stride, k);
    done = n / 4 * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) step_one(param, param_bf16, m, v, grad[i], i, k);
}

// adamw_step_kernel over rows blockIdx.y, + gridDim.y, ... of `per_row` elements of each tensor,
// whose gradient is taken as zero without reading it where known_zero[row] is set (Vec4: per_row a
// multiple of 4 too). Rows beyond the grid's 65,535 (an embedding's vocabulary) come round again.
template <bool Vec4, typename M>
__global__ void adamw_step_rows_kernel(float* param, __nv_bfloat16* param_bf16, M* m, M* v, const float* grad, const int32_t* known_zero,
                                       int64_t rows, int64_t per_row, Constants k) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t offset = row * per_row;
    const bool zero = known_zero[row] != 0;
    float* p = param + offset;
    M *mr = m + offset, *vr = v + offset;
    const float* g = grad + offset;
    __nv_bfloat16* p16 = param_bf16 ? param_bf16 + offset : nullptr;
    int64_t done = 0;
    if (Vec4) {
      step_float4s(p, p16, mr, vr, zero ? nullptr : g, per_row / 4, first, stride, k);
      done = per_row / 4 * 4;
    }
    for (int64_t i = done + first; i < per_row; i += stride) step_one(p, p16, mr, vr, zero ? 0.0f : g[i], i, k);
  }
}

Constants constants(const AdamWHyper& hp) {
  return {hp.grad_scale,
          hp.beta1,
          1 - hp.beta1,
          hp.beta2,
          1 - hp.beta2,
          1 - hp.lr * hp.weight_decay,
          hp.lr / (1 - std::pow(hp.beta1, double(hp.step))),
          std::sqrt(1 - std::pow(hp.beta2, double(hp.step))),
          hp.eps};
}

// Whether the float4 path takes the tensors (the fp32 ones 16-byte aligned, the bf16 ones 8).
bool takes_vec4(const Tensor& param, const Tensor& param_bf16, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad) {
  auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data) % (t.dtype == DType::bf16 ? 8 : 16) == 0; };
  return aligned(param) && aligned(grad) && aligned(exp_avg) && aligned(exp_avg_sq) && reinterpret_cast<uintptr_t>(param_bf16.data) % 8 == 0;
}

// Calls f with the moments' device pointers, typed by their storage (f32 or bf16).
template <typename F> void with_moments(const Tensor& exp_avg, const Tensor& exp_avg_sq, F&& f) {
  if (exp_avg.dtype == DType::bf16) f(static_cast<__nv_bfloat16*>(exp_avg.data), static_cast<__nv_bfloat16*>(exp_avg_sq.data));
  else f(exp_avg.ptr<float>(), exp_avg_sq.ptr<float>());
}

void launch_step_rows(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, Tensor known_zero,
                      const AdamWHyper& hp, Stream stream) {
  const int64_t rows = known_zero.numel(), per_row = rows > 0 ? param.numel() / rows : 0;
  if (per_row == 0) return;
  const Constants k = constants(hp);
  const bool vec4 = takes_vec4(param, param_bf16, exp_avg, exp_avg_sq, grad) && per_row % 4 == 0;
  const int threads = 256;
  const dim3 grid(unsigned(std::max<int64_t>(1, std::min<int64_t>((per_row / (vec4 ? 4 : 1) + threads) / threads, 8192 / rows))),
                  unsigned(std::min<int64_t>(rows, 65535)));
  auto s = static_cast<cudaStream_t>(stream.handle);
  float* p = param.ptr<float>();
  auto* p16 = static_cast<__nv_bfloat16*>(param_bf16.data);
  const int32_t* flags = known_zero.ptr<int32_t>();
  with_moments(exp_avg, exp_avg_sq, [&](auto* m, auto* v) {
    using M = std::remove_pointer_t<decltype(m)>;
    if (vec4) launch_dependent(adamw_step_rows_kernel<true, M>, grid, threads, 0, s, p, p16, m, v, grad.ptr<float>(), flags, rows, per_row, k);
    else launch_dependent(adamw_step_rows_kernel<false, M>, grid, threads, 0, s, p, p16, m, v, grad.ptr<float>(), flags, rows, per_row, k);
  });
  MARROW_CUDA_CHECK_LAUNCH();
}

void launch_step(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hp,
                 Stream stream) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const Constants k = constants(hp);
  const bool vec4 = takes_vec4(param, param_bf16, exp_avg, exp_avg_sq, grad);
  const int threads = 256, blocks = int(std::min<int64_t>((n / (vec4 ? 4 : 1) + threads) / threads, 8192));
  auto s = static_cast<cudaStream_t>(stream.handle);
  float* p = param.ptr<float>();
  auto* p16 = static_cast<__nv_bfloat16*>(param_bf16.data);
  with_moments(exp_avg, exp_avg_sq, [&](auto* m, auto* v) {
    using M = std::remove_pointer_t<decltype(m)>;
    if (vec4) launch_dependent(adamw_step_kernel<true, M>, blocks, threads, 0, s, p, p16, m, v, grad.ptr<float>(), n, k);
    else launch_dependent(adamw_step_kernel<false, M>, blocks, threads, 0, s, p, p16, m, v, grad.ptr<float>(), n, k);
  });
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

namespace {
// adamw_step's checks; returns whether the tensors are on the GPU.
bool check_step(const char* op, const Tensor& param, const Tensor& param_bf16, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& grad, const AdamWHyper& hyper) {
  const bool copy = param_bf16.data != nullptr;
  for (auto [name, t] : {std::pair{"grad", &grad}, std::pair{"exp_avg", &exp_avg}, std::pair{"exp_avg_sq", &exp_avg_sq}})
    MARROW_CHECK(t->numel() == param.numel(), "{}: {} has {} elements but param has {}", op, name, t->numel(), param.numel());
  expect_same_dtype(op, {{"param", &param}, {"grad", &grad}});
  expect_same_dtype(op, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  MARROW_CHECK(exp_avg.dtype == param.dtype || (exp_avg.dtype == DType::bf16 && param.dtype == DType::f32),
               "{}: the moments are {} but param is {}: they take param's dtype, or bf16 with f32 param", op, dtype_name(exp_avg.dtype),
               dtype_name(param.dtype));
  MARROW_CHECK(hyper.step >= 1, "{}: step is 1-based, got {}", op, hyper.step);
  MARROW_CHECK(0 <= hyper.beta1 && hyper.beta1 < 1 && 0 <= hyper.beta2 && hyper.beta2 < 1,
               "{}: beta1 and beta2 must be in [0, 1), got {} and {}", op, hyper.beta1, hyper.beta2);
  MARROW_CHECK(std::isfinite(hyper.grad_scale), "{}: grad_scale must be finite, got {}", op, hyper.grad_scale);
  if (copy) {
    MARROW_CHECK(param_bf16.numel() == param.numel(), "{}: param_bf16 has {} elements but param has {}", op, param_bf16.numel(),
                 param.numel());
    expect_dtype(op, "param_bf16", param_bf16, DType::bf16);
    expect_device(op, "param_bf16", param_bf16, param.device);
  }
  if (common_device(op, {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}}) == Device::cpu)
    return false;
  expect_dtype(op, "param", param, DType::f32);
  return true;
}

// step_cpu over the tensors' scalar type (known_zero: rows of per_row elements, may be null).
void step_on_cpu(const char* op, Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hyper,
                 const int32_t* known_zero, int64_t per_row) {
  auto* copy = param_bf16.data ? static_cast<uint16_t*>(param_bf16.data) : nullptr;
  with_cpu_scalar(op, param, [&](auto s) {
    using T = decltype(s);
    if (exp_avg.dtype == DType::bf16)
      step_cpu(param.ptr<T>(), copy, static_cast<uint16_t*>(exp_avg.data), static_cast<uint16_t*>(exp_avg_sq.data), grad.ptr<T>(),
               param.numel(), hyper, known_zero, per_row);
    else step_cpu(param.ptr<T>(), copy, exp_avg.ptr<T>(), exp_avg_sq.ptr<T>(), grad.ptr<T>(), param.numel(), hyper, known_zero, per_row);
  });
}
}  // namespace

void adamw_step(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hyper,
                Stream stream) {
  const char* op = "adamw_step";
  if (check_step(op, param, param_bf16, exp_avg, exp_avg_sq, grad, hyper)) {
#ifdef __CUDACC__
    return launch_step(param, param_bf16, exp_avg, exp_avg_sq, grad, hyper, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  step_on_cpu(op, param, param_bf16, exp_avg, exp_avg_sq, grad, hyper, nullptr, 1);
}

void adamw_step_known_zero(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, Tensor known_zero,
                           const AdamWHyper& hyper, Stream stream) {
  const char* op = "adamw_step_known_zero";
  const bool gpu = check_step(op, param, param_bf16, exp_avg, exp_avg_sq, grad, hyper);
  expect_dtype(op, "known_zero", known_zero, DType::i32);
  expect_device(op, "known_zero", known_zero, param.device);
  MARROW_CHECK(known_zero.ndim == 1 && known_zero.numel() > 0 && param.numel() % known_zero.numel() == 0,
               "{}: known_zero has shape {} but must be [E] with E dividing param's {} elements", op, known_zero.shape_string(),
               param.numel());
  if (gpu) {
#ifdef __CUDACC__
    return launch_step_rows(param, param_bf16, exp_avg, exp_avg_sq, grad, known_zero, hyper, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  step_on_cpu(op, param, param_bf16, exp_avg, exp_avg_sq, grad, hyper, known_zero.ptr<int32_t>(), param.numel() / known_zero.numel());
}

}  // namespace marrow
