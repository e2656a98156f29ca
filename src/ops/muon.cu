#include "ops/muon.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/memory.h"
#include "core/split_f32.h"
#include "ops/cast.h"
#include "ops/common.h"
#include "ops/grad_norm.h"
#include "ops/linear.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr double kNormEpsilon = 1e-7;

template <typename T> void momentum_cpu(T* update, T* momentum, const T* grad, int64_t n, T beta, T grad_scale) {
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i] * grad_scale;
    momentum[i] = beta * momentum[i] + (1 - beta) * g;
    update[i] = (1 - beta) * g + beta * momentum[i];
  }
}

// One element of muon_apply, each product rounded on its own (as the kernel's __fmul_rn / __fsub_rn).
inline float applied(float p, float o, float decay, float lr, float scale) {
  const float u = scale * o, kept = p * decay, step = lr * u;
  return kept - step;
}

inline float orth_value(float o) { return o; }
inline float orth_value(uint16_t o) { return bf16_to_float(o); }

template <typename O> void apply_cpu(float* value, uint16_t* high, uint16_t* low, const O* orth, int64_t n, float decay, float lr, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = applied(value ? value[i] : bits_float(split_join(high[i], low[i])), orth_value(orth[i]), decay, lr, scale);
    if (value) {
      value[i] = p;
      if (high) high[i] = split_high(float_bits(p));
    } else {
      split_bits(float_bits(p), high[i], low[i]);
    }
  }
}

// out = alpha x + beta y (y absent: alpha x), elementwise, in out's dtype.
template <typename T> void combine_cpu(T* out, const T* x, const T* y, int64_t n, double alpha, double beta) {
  for (int64_t i = 0; i < n; ++i) out[i] = T(alpha * x[i] + (y ? beta * y[i] : 0.0));
}

#ifdef __CUDACC__
__global__ void momentum_kernel(float* update, float* momentum, const float* grad, int64_t n, float beta, float grad_scale) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) {
    const float g = __fmul_rn(grad[i], grad_scale);
    const float m = __fadd_rn(__fmul_rn(beta, momentum[i]), __fmul_rn(1.0f - beta, g));
    momentum[i] = m;
    update[i] = __fadd_rn(__fmul_rn(1.0f - beta, g), __fmul_rn(beta, m));
  }
}

// Matrix blockIdx.y of out (bf16) = u / (sqrt(sum of its parts) + eps): every block sums the
// kSumParts parts in the same fixed tree (so all agree on the scale), then scales its grid-stride share.
__global__ void unit_norm_kernel(bf16* out, const float* u, const double* parts, int64_t n, double epsilon) {
  begin_after_previous_grid();
  out += blockIdx.y * n;
  u += blockIdx.y * n;
  parts += blockIdx.y * kSumParts;
  __shared__ double sums[256];
  double s = 0;
  for (int64_t p = threadIdx.x; p < kSumParts; p += blockDim.x) s += parts[p];
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  const float scale = float(1.0 / (sqrt(sums[0]) + epsilon));
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) out[i] = bf16(u[i] * scale);
}

__global__ void combine_kernel(bf16* out, const bf16* x, const bf16* y, int64_t n, float alpha, float beta) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) out[i] = bf16(alpha * float(x[i]) + (y ? beta * float(y[i]) : 0.0f));
}

template <typename O>
__global__ void apply_kernel(float* value, uint16_t* high, uint16_t* low, const O* orth, int64_t n, float decay, float lr, float scale) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) {
    const float p0 = value ? value[i] : __uint_as_float(split_join(high[i], low[i]));
    const float p = __fsub_rn(__fmul_rn(p0, decay), __fmul_rn(lr, __fmul_rn(scale, float(orth[i]))));
    if (value) {
      value[i] = p;
      if (high) high[i] = split_high(__float_as_uint(p));
    } else {
      split_bits(__float_as_uint(p), high[i], low[i]);
    }
  }
}

void launch_momentum(Tensor update, Tensor momentum, Tensor grad, double beta, double grad_scale, Stream stream) {
  const int64_t n = update.numel();
  if (n == 0) return;
  launch_dependent(momentum_kernel, grid_stride_blocks(n, 256, 8192), 256, 0, stream, update.ptr<float>(), momentum.ptr<float>(),
                   grad.ptr<float>(), n, float(beta), float(grad_scale));
}

// u [B, R, C]: each matrix's sum of squares into its row of parts, then the scaling, one grid row a matrix.
void launch_unit_norm(Tensor out, Tensor u, Stream stream) {
  const int64_t batch = u.size(0), n = u.numel() / batch;
  Buffer parts(DType::f64, Device::cuda, {batch * kSumParts});
  for (int64_t b = 0; b < batch; ++b) sum_squares_parts(parts.view().rows(b * kSumParts, (b + 1) * kSumParts), u.rows(b, b + 1), stream);
  const dim3 grid(unsigned(grid_stride_blocks(n, 256, std::max<int64_t>(1, 2048 / batch))), unsigned(batch));
  launch_dependent(unit_norm_kernel, grid, 256, 0, stream, static_cast<bf16*>(out.data), u.ptr<float>(), parts.ptr<double>(), n,
                   kNormEpsilon);
}

void launch_apply(Tensor param, Tensor param_bf16, Tensor orth, float decay, float lr, float scale, Stream stream) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const bool split = param.dtype == DType::u16;
  auto* value = split ? nullptr : param.ptr<float>();
  auto* high = param_bf16.data ? static_cast<uint16_t*>(param_bf16.data) : nullptr;
  auto* low = split ? static_cast<uint16_t*>(param.data) : nullptr;
  const int64_t blocks = grid_stride_blocks(n, 256, 8192);
  if (orth.dtype == DType::bf16)
    launch_dependent(apply_kernel<bf16>, blocks, 256, 0, stream, value, high, low, static_cast<const bf16*>(orth.data), n, decay, lr, scale);
  else
    launch_dependent(apply_kernel<float>, blocks, 256, 0, stream, value, high, low, orth.ptr<float>(), n, decay, lr, scale);
}

void launch_combine(Tensor out, Tensor x, Tensor y, double alpha, double beta, Stream stream) {
  const int64_t n = out.numel();
  launch_dependent(combine_kernel, grid_stride_blocks(n, 256, 8192), 256, 0, stream, static_cast<bf16*>(out.data),
                   static_cast<const bf16*>(x.data), y.data ? static_cast<const bf16*>(y.data) : nullptr, n, float(alpha), float(beta));
}
#endif

void combine(Tensor out, Tensor x, Tensor y, double alpha, double beta, Stream stream) {
  if (out.device == Device::cuda) MARROW_GPU_RETURN("newton_schulz", stream, launch_combine(out, x, y, alpha, beta, stream));
  with_cpu_scalar("newton_schulz", out, [&](auto s) {
    using T = decltype(s);
    combine_cpu<T>(out.ptr<T>(), x.ptr<T>(), y.data ? y.ptr<T>() : nullptr, out.numel(), alpha, beta);
  });
}

// Each matrix of x [B, R, C] (out's dtype) = the matrix of u / (its ||u||_F + eps).
void unit_norm(Tensor x, Tensor u, Stream stream) {
  if (x.device == Device::cuda) MARROW_GPU_RETURN("newton_schulz", stream, launch_unit_norm(x, u, stream));
  with_cpu_scalar("newton_schulz", u, [&](auto s) {
    using T = decltype(s);
    const int64_t batch = u.size(0), n = u.numel() / batch;
    for (int64_t b = 0; b < batch; ++b) {
      const T* ub = u.ptr<T>() + b * n;
      double squares = 0;
      for (int64_t i = 0; i < n; ++i) squares += double(ub[i]) * double(ub[i]);
      combine_cpu<T>(x.ptr<T>() + b * n, ub, nullptr, n, 1.0 / (std::sqrt(squares) + kNormEpsilon), 0.0);
    }
  });
}

// One iteration from x into next (both [B, R, C]). Wide (R <= C): A = X X^T [R, R], next = a X + B X.
// Tall: A = X^T X [C, C] (the weight-gradient GEMM, f32 on the GPU, then cast), next = a X + X B.
// A and B are symmetric, so A A = A A^T and X B = X B^T are the plain GEMMs of ops/linear.h.
void newton_schulz_step(Tensor next, Tensor x, Stream stream) {
  const int64_t batch = x.size(0), rows = x.size(1), cols = x.size(2), n = std::min(rows, cols);
  Buffer a(x.dtype, x.device, {batch, n, n}), aa(x.dtype, x.device, {batch, n, n});
  if (rows <= cols) {
    linear_forward(a, x, x, stream);
  } else {
    Buffer gram(x.device == Device::cuda ? DType::f32 : x.dtype, x.device, {batch, n, n});
    linear_backward_weight(gram, x, x, true, stream);
    cast(a, gram, stream);
  }
  linear_forward(aa, a, a, stream);
  combine(a, a, aa, kMuonB, kMuonC, stream);  // B, in a's place
  if (rows <= cols) {
    combine(next, x, {}, kMuonA, 0, stream);
    linear_backward_input(next, a, x, true, stream);
  } else {
    Buffer xb(x.dtype, x.device, {batch, rows, cols});
    linear_forward(xb, x, a, stream);
    combine(next, x, xb, kMuonA, 1, stream);
  }
}

}  // namespace

void muon_momentum(Tensor update, Tensor momentum, Tensor grad, double beta, double grad_scale, Stream stream) {
  const char* op = "muon_momentum";
  for (auto [name, t] : {std::pair{"momentum", &momentum}, std::pair{"grad", &grad}})
    MARROW_CHECK(t->numel() == update.numel(), "{}: {} has shape {} but update has shape {}", op, name, t->shape_string(),
                 update.shape_string());
  MARROW_CHECK(beta >= 0 && beta < 1, "{}: the momentum must be in [0, 1), got {}", op, beta);
  MARROW_CHECK(std::isfinite(grad_scale), "{}: grad_scale must be finite, got {}", op, grad_scale);
  expect_same_dtype(op, {{"update", &update}, {"momentum", &momentum}, {"grad", &grad}});
  if (common_device(op, {{"update", &update}, {"momentum", &momentum}, {"grad", &grad}}) == Device::cuda) {
    expect_dtype(op, "update", update, DType::f32);
    MARROW_GPU_RETURN(op, stream, launch_momentum(update, momentum, grad, beta, grad_scale, stream));
  }
  with_cpu_scalar(op, update, [&](auto s) {
    using T = decltype(s);
    momentum_cpu<T>(update.ptr<T>(), momentum.ptr<T>(), grad.ptr<T>(), update.numel(), T(beta), T(grad_scale));
  });
}

void newton_schulz(Tensor out, Tensor update, int steps, Stream stream) {
  const char* op = "newton_schulz";
  MARROW_CHECK(update.ndim == 2 || update.ndim == 3, "{}: update has shape {} but expected [rows, cols] or [batch, rows, cols]", op,
               update.shape_string());
  const int64_t batch = update.ndim == 3 ? update.size(0) : 1, rows = update.size(-2), cols = update.size(-1);
  MARROW_CHECK(out.ndim == update.ndim && out.numel() == update.numel() && out.size(-2) == rows && out.size(-1) == cols,
               "{}: out has shape {} but update has shape {}", op, out.shape_string(), update.shape_string());
  MARROW_CHECK(steps >= 0, "{}: the number of iterations must be at least 0, got {}", op, steps);
  const bool gpu = common_device(op, {{"out", &out}, {"update", &update}}) == Device::cuda;
  if (gpu) {
    expect_dtype(op, "update", update, DType::f32);
    expect_dtype(op, "out", out, DType::bf16);
  } else {
    expect_same_dtype(op, {{"out", &out}, {"update", &update}});
  }
  if (update.numel() == 0) return;
  Buffer other(out.dtype, out.device, {batch, rows, cols});
  const Tensor out3 = out.reshape({batch, rows, cols});
  Tensor x = steps % 2 == 0 ? out3 : other.view(), next = steps % 2 == 0 ? other.view() : out3;
  unit_norm(x, update.reshape({batch, rows, cols}), stream);
  for (int i = 0; i < steps; ++i) {
    newton_schulz_step(next, x, stream);
    std::swap(x, next);
  }
}

void muon_apply(Tensor param, Tensor param_bf16, Tensor orth, double lr, double weight_decay, double scale, Stream stream) {
  const char* op = "muon_apply";
  const bool copy = param_bf16.data != nullptr, split = param.dtype == DType::u16;
  MARROW_CHECK(!split || copy, "{}: param is u16 (the low halves of split master weights) but param_bf16, their high halves, is missing", op);
  MARROW_CHECK(split || param.dtype == DType::f32, "{}: param has dtype {} but expected f32 or u16 (split master)", op, dtype_name(param.dtype));
  MARROW_CHECK(orth.dtype == DType::f32 || orth.dtype == DType::bf16, "{}: orth has dtype {} but expected f32 or bf16", op,
               dtype_name(orth.dtype));
  MARROW_CHECK(orth.numel() == param.numel() && (!copy || param_bf16.numel() == param.numel()),
               "{}: orth has {} elements and param_bf16 {} but param has {}", op, orth.numel(), param_bf16.numel(), param.numel());
  if (copy) expect_dtype(op, "param_bf16", param_bf16, DType::bf16);
  const float decay = float(1 - lr * weight_decay), lr_f = float(lr), scale_f = float(scale);
  auto* high = copy ? static_cast<uint16_t*>(param_bf16.data) : nullptr;
  if (common_device(op, {{"param", &param}, {"orth", &orth}}) == Device::cuda)
    MARROW_GPU_RETURN(op, stream, launch_apply(param, param_bf16, orth, decay, lr_f, scale_f, stream));
  float* value = split ? nullptr : param.ptr<float>();
  auto* low = split ? static_cast<uint16_t*>(param.data) : nullptr;
  if (orth.dtype == DType::bf16)
    return apply_cpu(value, high, low, static_cast<const uint16_t*>(orth.data), param.numel(), decay, lr_f, scale_f);
  apply_cpu(value, high, low, orth.ptr<float>(), param.numel(), decay, lr_f, scale_f);
}

}  // namespace marrow
