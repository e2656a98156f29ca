#include "ops/muon.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/memory.h"
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

template <typename T> void momentum_cpu(T* update, T* momentum, const T* grad, int64_t n, T beta) {
  for (int64_t i = 0; i < n; ++i) {
    momentum[i] = beta * momentum[i] + (1 - beta) * grad[i];
    update[i] = (1 - beta) * grad[i] + beta * momentum[i];
  }
}

// out = alpha x + beta y (y absent: alpha x), elementwise, in out's dtype.
template <typename T> void combine_cpu(T* out, const T* x, const T* y, int64_t n, double alpha, double beta) {
  for (int64_t i = 0; i < n; ++i) out[i] = T(alpha * x[i] + (y ? beta * y[i] : 0.0));
}

#ifdef __CUDACC__
__global__ void momentum_kernel(float* update, float* momentum, const float* grad, int64_t n, float beta) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) {
    const float m = beta * momentum[i] + (1.0f - beta) * grad[i];
    momentum[i] = m;
    update[i] = (1.0f - beta) * grad[i] + beta * m;
  }
}

// out (bf16) = u / (sqrt(sum of parts) + eps): every block sums the kSumParts parts in the same fixed
// tree (so all agree on the scale), then scales its grid-stride share.
__global__ void unit_norm_kernel(bf16* out, const float* u, const double* parts, int64_t n, double epsilon) {
  begin_after_previous_grid();
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

void launch_momentum(Tensor update, Tensor momentum, Tensor grad, double beta, Stream stream) {
  const int64_t n = update.numel();
  if (n == 0) return;
  launch_dependent(momentum_kernel, grid_stride_blocks(n, 256, 8192), 256, 0, stream, update.ptr<float>(), momentum.ptr<float>(),
                   grad.ptr<float>(), n, float(beta));
}

void launch_unit_norm(Tensor out, Tensor u, Stream stream) {
  Buffer parts(DType::f64, Device::cuda, {kSumParts});
  sum_squares_parts(parts, u, stream);
  const int64_t n = u.numel();
  launch_dependent(unit_norm_kernel, grid_stride_blocks(n, 256, 2048), 256, 0, stream, static_cast<bf16*>(out.data), u.ptr<float>(),
                   parts.ptr<double>(), n, kNormEpsilon);
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

// x (out's dtype) = u / (||u||_F + eps).
void unit_norm(Tensor x, Tensor u, Stream stream) {
  if (x.device == Device::cuda) MARROW_GPU_RETURN("newton_schulz", stream, launch_unit_norm(x, u, stream));
  with_cpu_scalar("newton_schulz", u, [&](auto s) {
    using T = decltype(s);
    double squares = 0;
    for (int64_t i = 0; i < u.numel(); ++i) squares += double(u.ptr<T>()[i]) * double(u.ptr<T>()[i]);
    combine_cpu<T>(x.ptr<T>(), u.ptr<T>(), nullptr, u.numel(), 1.0 / (std::sqrt(squares) + kNormEpsilon), 0.0);
  });
}

// One iteration from x into next (both [R, C]). Wide (R <= C): A = X X^T [R, R], next = a X + B X.
// Tall: A = X^T X [C, C] (the weight-gradient GEMM, f32 on the GPU, then cast), next = a X + X B.
// A and B are symmetric, so A A = A A^T and X B = X B^T are the plain GEMMs of ops/linear.h.
void newton_schulz_step(Tensor next, Tensor x, Stream stream) {
  const int64_t rows = x.size(0), cols = x.size(1), n = std::min(rows, cols);
  Buffer a(x.dtype, x.device, {n, n}), aa(x.dtype, x.device, {n, n});
  if (rows <= cols) {
    linear_forward(a, x, x, stream);
  } else {
    Buffer gram(x.device == Device::cuda ? DType::f32 : x.dtype, x.device, {n, n});
    linear_backward_weight(gram, x, x, true, stream);
    cast(a, gram, stream);
  }
  linear_forward(aa, a, a, stream);
  combine(a, a, aa, kMuonB, kMuonC, stream);  // B, in a's place
  if (rows <= cols) {
    combine(next, x, {}, kMuonA, 0, stream);
    linear_backward_input(next, a, x, true, stream);
  } else {
    Buffer xb(x.dtype, x.device, {rows, cols});
    linear_forward(xb, x, a, stream);
    combine(next, x, xb, kMuonA, 1, stream);
  }
}

}  // namespace

void muon_momentum(Tensor update, Tensor momentum, Tensor grad, double beta, Stream stream) {
  const char* op = "muon_momentum";
  for (auto [name, t] : {std::pair{"momentum", &momentum}, std::pair{"grad", &grad}})
    MARROW_CHECK(t->numel() == update.numel(), "{}: {} has shape {} but update has shape {}", op, name, t->shape_string(),
                 update.shape_string());
  MARROW_CHECK(beta >= 0 && beta < 1, "{}: the momentum must be in [0, 1), got {}", op, beta);
  expect_same_dtype(op, {{"update", &update}, {"momentum", &momentum}, {"grad", &grad}});
  if (common_device(op, {{"update", &update}, {"momentum", &momentum}, {"grad", &grad}}) == Device::cuda) {
    expect_dtype(op, "update", update, DType::f32);
    MARROW_GPU_RETURN(op, stream, launch_momentum(update, momentum, grad, beta, stream));
  }
  with_cpu_scalar(op, update, [&](auto s) {
    using T = decltype(s);
    momentum_cpu<T>(update.ptr<T>(), momentum.ptr<T>(), grad.ptr<T>(), update.numel(), T(beta));
  });
}

void newton_schulz(Tensor out, Tensor update, int steps, Stream stream) {
  const char* op = "newton_schulz";
  expect_ndim(op, "update", update, 2, "[rows, cols]");
  expect_shape(op, "out", out, {update.size(0), update.size(1)});
  MARROW_CHECK(steps >= 0, "{}: the number of iterations must be at least 0, got {}", op, steps);
  const bool gpu = common_device(op, {{"out", &out}, {"update", &update}}) == Device::cuda;
  if (gpu) {
    expect_dtype(op, "update", update, DType::f32);
    expect_dtype(op, "out", out, DType::bf16);
  } else {
    expect_same_dtype(op, {{"out", &out}, {"update", &update}});
  }
  if (update.numel() == 0) return;
  Buffer other(out.dtype, out.device, {update.size(0), update.size(1)});
  Tensor x = steps % 2 == 0 ? out : other.view(), next = steps % 2 == 0 ? other.view() : out;
  unit_norm(x, update, stream);
  for (int i = 0; i < steps; ++i) {
    newton_schulz_step(next, x, stream);
    std::swap(x, next);
  }
}

}  // namespace marrow
