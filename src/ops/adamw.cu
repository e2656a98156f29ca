// Measured launch shape: many more blocks than fit at once (~12 waves) beat one resident wave with
// grid-stride loops, despite the waves' tail (the single wave was +0.9 ms a bench step). Fusing a
// block-wide reduction into this memory-bound FP64 walk (the FP8 weight scales) ran slower than AdamW
// plus a separate pass (2.6 TB/s against 4.0 + 2.0): the barrier between the update and the stores
// either holds a block's values in registers (fewer warps to hide the FP64 chains) or reads them
// back (an exposed L2 round trip); try a side stream before another fused kernel. But AdamW on a
// side stream under the next forward hid nothing, with or without stream priorities: the forward's
// GEMMs and attention take every register of an SM, and a priority orders only the dispatch of new
// blocks, so it helps only with short-lived blocks on the low-priority side.
#include "ops/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/split_f32.h"
#include "core/memory.h"
#include "ops/cast.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

// In torch's order of operations (the moments are rounded to T before use; the denominator is
// sqrt(v) / sqrt(1 - beta2^step) + eps), so results stay as close to torch's as the double
// intermediates allow.
// param_bf16 may be null; known_zero (null: none): rows of `per_row` elements whose gradient is
// taken as zero without reading it (a zero's sign never shows: m + (-0) = m, (-0)^2 = +0).
template <typename T>
void step_cpu(T* param, uint16_t* param_bf16, T* m, T* v, const T* grad, int64_t n, const AdamWHyper& hp,
              const int32_t* known_zero = nullptr, int64_t per_row = 1) {
  const double decay = 1 - hp.lr * hp.weight_decay;
  const double step_size = hp.lr / (1 - std::pow(hp.beta1, double(hp.step)));
  const double bias2_sqrt = std::sqrt(1 - std::pow(hp.beta2, double(hp.step)));
  for (int64_t i = 0; i < n; ++i) {
    const double g = known_zero && known_zero[i / per_row] ? 0.0 : double(grad[i]) * hp.grad_scale;
    m[i] = T(hp.beta1 * m[i] + (1 - hp.beta1) * g);
    v[i] = T(hp.beta2 * v[i] + (1 - hp.beta2) * g * g);
    const double denom = std::sqrt(double(v[i])) / bias2_sqrt + hp.eps;
    param[i] = T(double(param[i]) * decay - step_size * double(m[i]) / denom);
    if (param_bf16) param_bf16[i] = float_to_bf16(float(param[i]));
  }
}

// The step's constants in f32 for the bf16 moments' arithmetic, made from the double ones.
struct FloatConstants {
  float grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, bias2_sqrt, eps;
};
FloatConstants float_constants(const AdamWHyper& hp) {
  return {float(hp.grad_scale),
          float(hp.beta1),
          float(1 - hp.beta1),
          float(hp.beta2),
          float(1 - hp.beta2),
          float(1 - hp.lr * hp.weight_decay),
          float(hp.lr / (1 - std::pow(hp.beta1, double(hp.step)))),
          float(std::sqrt(1 - std::pow(hp.beta2, double(hp.step)))),
          float(hp.eps)};
}

// step_cpu with bf16 moments: the same formula in f32, as torch's fused AdamW computes (a moment
// that keeps 8 bits gains nothing from double intermediates, and the GPU's FP64 pipe would bind the
// kernel), each moment rounded to bf16 where it is stored and read back as stored.
void step_cpu_bf16_moments(float* param, uint16_t* param_bf16, uint16_t* m, uint16_t* v, const float* grad, int64_t n,
                           const AdamWHyper& hp, const int32_t* known_zero, int64_t per_row) {
  const FloatConstants k = float_constants(hp);
  for (int64_t i = 0; i < n; ++i) {
    const float g = known_zero && known_zero[i / per_row] ? 0.0f : grad[i] * k.grad_scale;
    m[i] = float_to_bf16(k.beta1 * bf16_to_float(m[i]) + k.one_minus_beta1 * g);
    v[i] = float_to_bf16(k.beta2 * bf16_to_float(v[i]) + k.one_minus_beta2 * g * g);
    const float denom = std::sqrt(bf16_to_float(v[i])) / k.bias2_sqrt + k.eps;
    param[i] = param[i] * k.decay - k.step_size * bf16_to_float(m[i]) / denom;
    if (param_bf16) param_bf16[i] = float_to_bf16(param[i]);
  }
}

#ifdef __CUDACC__
// The step's constants, computed on the host exactly as step_cpu and step_cpu_bf16_moments compute them.
struct Constants {
  double grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, bias2_sqrt, eps;
  FloatConstants f;
};

// step_cpu's formula in double, each operation rounded on its own (__d*_rn: no fused
// multiply-adds, as the CPU computes it), so GPU and CPU results agree bit for bit. A zero moment
// skips the square root and divisions whose results it knows exactly (0 / x = 0 of the
// numerator's sign for x > 0): their zero operands take the slow paths of __dsqrt_rn and
// __ddiv_rn, and the rows of an embedding that a step did not see are zero for many steps.
__device__ void step_element(float& param, float grad, float& m, float& v, const Constants& k, float /* moments' storage */) {
  const double g = __dmul_rn(double(grad), k.grad_scale);
  m = float(__dadd_rn(__dmul_rn(k.beta1, m), __dmul_rn(k.one_minus_beta1, g)));
  v = float(__dadd_rn(__dmul_rn(k.beta2, v), __dmul_rn(__dmul_rn(k.one_minus_beta2, g), g)));
  const double denom = v == 0.0f ? k.eps : __dadd_rn(__ddiv_rn(__dsqrt_rn(double(v)), k.bias2_sqrt), k.eps);
  const double scaled_m = __dmul_rn(k.step_size, double(m));
  const double update = m == 0.0f && denom > 0 ? scaled_m : __ddiv_rn(scaled_m, denom);
  param = float(__dsub_rn(__dmul_rn(double(param), k.decay), update));
}

__device__ __forceinline__ float round_to_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// step_cpu_bf16_moments's formula, each f32 operation rounded on its own; m and v come back as bf16
// holds them.
__device__ void step_element(float& param, float grad, float& m, float& v, const Constants& c, __nv_bfloat16 /* moments' storage */) {
  const FloatConstants& k = c.f;
  const float g = __fmul_rn(grad, k.grad_scale);
  m = round_to_bf16(__fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(k.one_minus_beta1, g)));
  v = round_to_bf16(__fadd_rn(__fmul_rn(k.beta2, v), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bias2_sqrt), k.eps);
  param = __fsub_rn(__fmul_rn(param, k.decay), __fdiv_rn(__fmul_rn(k.step_size, m), denom));
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

// The master weights a step reads and writes: one fp32 array, with the bf16 copy written beside it
// when `copy` is given, or split into bf16 high and u16 low halves (core/split_f32.h), whose high
// half is the copy. get4 / put4: four consecutive values (element 4i on).
struct F32Master {
  float* value;
  __nv_bfloat16* copy;
  __device__ float4 get4(int64_t i) const { return load4(value, i); }
  __device__ void put4(int64_t i, float4 x) const {
    store4(value, i, x);
    if (copy) store4(copy, i, x);
  }
  __device__ float get1(int64_t i) const { return value[i]; }
  __device__ void put1(int64_t i, float x) const {
    value[i] = x;
    if (copy) copy[i] = __float2bfloat16_rn(x);
  }
  __device__ F32Master at(int64_t offset) const { return {value + offset, copy ? copy + offset : nullptr}; }
};

// The halves' arithmetic of core/split_f32.h in a few instructions each (the step is near the
// SM's issue limit with fp32 moments): the high halves by the hardware's bf16 conversion (the same
// rounding; the unit a midpoint moves never changes it), the halves paired by byte permutes.
struct SplitMaster {
  uint16_t* high;
  uint16_t* low;
  // fp32 bits from a high and a low half (each in bits 0-15 of its word, or 16-31 with shift 16).
  __device__ static float join(uint32_t h, uint32_t l, int shift) {
    const uint32_t lo = (l >> shift) & 0xffffu, hi = ((h >> shift) & 0xffffu) - (lo > 0x8000u ? 1u : 0u);
    return __uint_as_float(__byte_perm(lo, hi, 0x5410));
  }
  // The low half of x as stored: the one kind of midpoint a unit higher.
  __device__ static uint32_t low_of(float x) {
    const uint32_t bits = __float_as_uint(x);
    return (bits & 0x1ffffu) == 0x18000u ? 0x8001u : bits & 0xffffu;
  }
  __device__ static uint32_t highs(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ float get1(int64_t i) const { return join(high[i], low[i], 0); }
  __device__ void put1(int64_t i, float x) const {
    high[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    low[i] = uint16_t(low_of(x));
  }
  __device__ float4 get4(int64_t i) const {
    const uint2 h = reinterpret_cast<const uint2*>(high)[i], l = reinterpret_cast<const uint2*>(low)[i];
    return make_float4(join(h.x, l.x, 0), join(h.x, l.x, 16), join(h.y, l.y, 0), join(h.y, l.y, 16));
  }
  __device__ void put4(int64_t i, float4 x) const {
    reinterpret_cast<uint2*>(high)[i] = make_uint2(highs(x.x, x.y), highs(x.z, x.w));
    reinterpret_cast<uint2*>(low)[i] = make_uint2(__byte_perm(low_of(x.x), low_of(x.y), 0x5410), __byte_perm(low_of(x.z), low_of(x.w), 0x5410));
  }
  __device__ SplitMaster at(int64_t offset) const { return {high + offset, low + offset}; }
};

// Float4 i of the tensors with gradient g.
template <typename P, typename M>
__device__ __forceinline__ void step_float4(const P& param, M* m, M* v, float4 g, int64_t i, const Constants& k) {
  float4 p = param.get4(i), mm = load4(m, i), vv = load4(v, i);
  step_element(p.x, g.x, mm.x, vv.x, k, M{});
  step_element(p.y, g.y, mm.y, vv.y, k, M{});
  step_element(p.z, g.z, mm.z, vv.z, k, M{});
  step_element(p.w, g.w, mm.w, vv.w, k, M{});
  param.put4(i, p);
  store4(m, i, mm);
  store4(v, i, vv);
}

__device__ __forceinline__ float load1(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load1(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store1(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store1(__nv_bfloat16* p, int64_t i, float x) { p[i] = __float2bfloat16_rn(x); }

// One element of the tail (the n % 4 left after the float4s).
template <typename P, typename M>
__device__ __forceinline__ void step_one(const P& param, M* m, M* v, float g, int64_t i, const Constants& k) {
  float p = param.get1(i), mi = load1(m, i), vi = load1(v, i);
  step_element(p, g, mi, vi, k, M{});
  param.put1(i, p);
  store1(m, i, mi);
  store1(v, i, vi);
}

// Elementwise, grid-stride: one thread per float4 of the tensors when all are 16-byte aligned (the
// 16-bit ones 8-byte) (Vec4), then the n % 4 tail one element per thread. P: the master's storage,
// M: the moments'. (Loading the next float4s before computing the current ones measured no faster
// with fp32 moments and 12% slower with bf16 ones: 80 registers, fewer warps; both paths run at
// ~4.0 TB/s as they are.)
template <bool Vec4, typename P, typename M>
__global__ void adamw_step_kernel(P param, M* m, M* v, const float* grad, int64_t n, Constants k) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (Vec4) {
    for (int64_t i = first; i < n / 4; i += stride) step_float4(param, m, v, load4(grad, i), i, k);
    done = n / 4 * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) step_one(param, m, v, grad[i], i, k);
}

// adamw_step_kernel over rows blockIdx.y, + gridDim.y, ... of `per_row` elements of each tensor,
// whose gradient is taken as zero without reading it where known_zero[row] is set (Vec4: per_row a
// multiple of 4 too). Rows beyond the grid's 65,535 (an embedding's vocabulary) come round again.
template <bool Vec4, typename P, typename M>
__global__ void adamw_step_rows_kernel(P param, M* m, M* v, const float* grad, const int32_t* known_zero, int64_t rows, int64_t per_row,
                                       Constants k) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t offset = row * per_row;
    const bool zero = known_zero[row] != 0;
    const P p = param.at(offset);
    M *mr = m + offset, *vr = v + offset;
    const float* g = grad + offset;
    int64_t done = 0;
    if (Vec4) {
      for (int64_t i = first; i < per_row / 4; i += stride)
        step_float4(p, mr, vr, zero ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : load4(g, i), i, k);
      done = per_row / 4 * 4;
    }
    for (int64_t i = done + first; i < per_row; i += stride) step_one(p, mr, vr, zero ? 0.0f : g[i], i, k);
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
          hp.eps,
          float_constants(hp)};
}

// Whether the float4 path takes the tensors (the fp32 ones 16-byte aligned, the 16-bit ones 8).
bool takes_vec4(const Tensor& param, const Tensor& param_bf16, const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& grad) {
  auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data) % (dtype_size(t.dtype) == 2 ? 8 : 16) == 0; };
  return aligned(param) && aligned(grad) && aligned(exp_avg) && aligned(exp_avg_sq) && reinterpret_cast<uintptr_t>(param_bf16.data) % 8 == 0;
}

// Calls f with the master's storage (F32Master or SplitMaster) and the moments' device pointers,
// typed by their storage (f32 or bf16).
template <typename F> void with_storage(const Tensor& param, const Tensor& param_bf16, const Tensor& exp_avg, const Tensor& exp_avg_sq, F&& f) {
  auto with_moments = [&](auto master) {
    if (exp_avg.dtype == DType::bf16) f(master, static_cast<__nv_bfloat16*>(exp_avg.data), static_cast<__nv_bfloat16*>(exp_avg_sq.data));
    else f(master, exp_avg.ptr<float>(), exp_avg_sq.ptr<float>());
  };
  if (param.dtype == DType::u16) with_moments(SplitMaster{static_cast<uint16_t*>(param_bf16.data), static_cast<uint16_t*>(param.data)});
  else with_moments(F32Master{param.ptr<float>(), static_cast<__nv_bfloat16*>(param_bf16.data)});
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
  with_storage(param, param_bf16, exp_avg, exp_avg_sq, [&](auto p, auto* m, auto* v) {
    using P = decltype(p);
    using M = std::remove_pointer_t<decltype(m)>;
    launch_dependent(vec4 ? adamw_step_rows_kernel<true, P, M> : adamw_step_rows_kernel<false, P, M>, grid, threads, 0, stream, p, m, v,
                     grad.ptr<float>(), known_zero.ptr<int32_t>(), rows, per_row, k);
  });
}

void launch_step(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hp,
                 Stream stream) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const Constants k = constants(hp);
  const bool vec4 = takes_vec4(param, param_bf16, exp_avg, exp_avg_sq, grad);
  with_storage(param, param_bf16, exp_avg, exp_avg_sq, [&](auto p, auto* m, auto* v) {
    using P = decltype(p);
    using M = std::remove_pointer_t<decltype(m)>;
    launch_dependent(vec4 ? adamw_step_kernel<true, P, M> : adamw_step_kernel<false, P, M>, grid_stride_blocks(n / (vec4 ? 4 : 1), 256, 8192),
                     256, 0, stream, p, m, v, grad.ptr<float>(), n, k);
  });
}
#endif

// adamw_step's checks; returns whether the tensors are on the GPU.
bool check_step(const char* op, const Tensor& param, const Tensor& param_bf16, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& grad, const AdamWHyper& hyper) {
  const bool copy = param_bf16.data != nullptr, split = param.dtype == DType::u16;
  for (auto [name, t] : {std::pair{"grad", &grad}, std::pair{"exp_avg", &exp_avg}, std::pair{"exp_avg_sq", &exp_avg_sq}})
    MARROW_CHECK(t->numel() == param.numel(), "{}: {} has {} elements but param has {}", op, name, t->numel(), param.numel());
  MARROW_CHECK(!split || copy, "{}: param is u16 (the low halves of split master weights) but param_bf16, their high halves, is missing", op);
  if (split) expect_dtype(op, "grad", grad, DType::f32);
  else expect_same_dtype(op, {{"param", &param}, {"grad", &grad}});
  expect_same_dtype(op, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  MARROW_CHECK(exp_avg.dtype == grad.dtype || (exp_avg.dtype == DType::bf16 && grad.dtype == DType::f32),
               "{}: the moments are {} but grad is {}: they take grad's dtype, or bf16 with f32 grad", op, dtype_name(exp_avg.dtype),
               dtype_name(grad.dtype));
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
  expect_dtype(op, "grad", grad, DType::f32);
  return true;
}

// step_cpu over the tensors' scalar type (known_zero: rows of per_row elements, may be null). Split
// master weights are joined into fp32, stepped as fp32 ones and split again.
void step_on_cpu(const char* op, Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hyper,
                 const int32_t* known_zero, int64_t per_row) {
  if (param.dtype == DType::u16) {
    Buffer joined(DType::f32, Device::cpu, {param.numel()});
    join_f32(joined.view(), param_bf16, param);
    step_on_cpu(op, joined.view(), Tensor{}, exp_avg, exp_avg_sq, grad, hyper, known_zero, per_row);
    return split_f32(param_bf16, param, joined.view());
  }
  auto* copy = param_bf16.data ? static_cast<uint16_t*>(param_bf16.data) : nullptr;
  if (exp_avg.dtype == DType::bf16)
    return step_cpu_bf16_moments(param.ptr<float>(), copy, static_cast<uint16_t*>(exp_avg.data), static_cast<uint16_t*>(exp_avg_sq.data),
                                 grad.ptr<float>(), param.numel(), hyper, known_zero, per_row);
  with_cpu_scalar(op, param, [&](auto s) {
    using T = decltype(s);
    step_cpu(param.ptr<T>(), copy, exp_avg.ptr<T>(), exp_avg_sq.ptr<T>(), grad.ptr<T>(), param.numel(), hyper, known_zero, per_row);
  });
}
}  // namespace

void adamw_step(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hyper,
                Stream stream) {
  const char* op = "adamw_step";
  if (check_step(op, param, param_bf16, exp_avg, exp_avg_sq, grad, hyper))
    MARROW_GPU_RETURN(op, stream, launch_step(param, param_bf16, exp_avg, exp_avg_sq, grad, hyper, stream));
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
  if (gpu) MARROW_GPU_RETURN(op, stream, launch_step_rows(param, param_bf16, exp_avg, exp_avg_sq, grad, known_zero, hyper, stream));
  step_on_cpu(op, param, param_bf16, exp_avg, exp_avg_sq, grad, hyper, known_zero.ptr<int32_t>(), param.numel() / known_zero.numel());
}

}  // namespace marrow
