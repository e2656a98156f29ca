#include "ops/rmsnorm.h"

#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"
#endif

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


#ifdef __CUDACC__
using bf16 = __nv_bfloat16;
constexpr int kWarpsPerBlock = 8;
constexpr int64_t kChunkRows = 64;  // rows per partial sum of dweight

template <int N> struct alignas(2 * N) Pack {
  bf16 v[N];
};
template <int N> __device__ Pack<N> load(const bf16* p) { return *reinterpret_cast<const Pack<N>*>(p); }

// One warp per row; lanes stride the row in packs of N (8 bf16 when D % 8 == 0). The sum of
// squares is reduced in a fixed tree (warp_sum), so the result does not depend on scheduling.
template <int N>
__global__ void rmsnorm_forward_kernel(bf16* y, float* rstd, const bf16* x, const bf16* weight, int64_t rows, int64_t d, float eps) {
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const bf16* xr = x + row * d;
  float ss = 0;
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<N> p = load<N>(xr + c);
    for (int l = 0; l < N; ++l) ss += float(p.v[l]) * float(p.v[l]);
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / float(d) + eps);
  if (lane == 0) rstd[row] = r;
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<N> p = load<N>(xr + c), w = load<N>(weight + c);
    Pack<N> o;
    for (int l = 0; l < N; ++l) o.v[l] = bf16(float(p.v[l]) * r * float(w.v[l]));
    *reinterpret_cast<Pack<N>*>(y + row * d + c) = o;
  }
}

// dx: one warp per row, as the forward; mean(dy * w * xhat) reduced in a fixed tree.
template <int N>
__global__ void rmsnorm_backward_dx_kernel(bf16* dx, const bf16* dy, const bf16* x, const bf16* weight, const float* rstd, int64_t rows,
                                   int64_t d) {
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float r = rstd[row];
  const bf16 *xr = x + row * d, *dyr = dy + row * d;
  float dot = 0;
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<N> xp = load<N>(xr + c), gp = load<N>(dyr + c), wp = load<N>(weight + c);
    for (int l = 0; l < N; ++l) dot += float(gp.v[l]) * float(wp.v[l]) * float(xp.v[l]) * r;
  }
  const float mean = warp_sum(dot) / float(d);
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<N> xp = load<N>(xr + c), gp = load<N>(dyr + c), wp = load<N>(weight + c);
    Pack<N> o;
    for (int l = 0; l < N; ++l) o.v[l] = bf16(r * (float(gp.v[l]) * float(wp.v[l]) - float(xp.v[l]) * r * mean));
    *reinterpret_cast<Pack<N>*>(dx + row * d + c) = o;
  }
}

// dweight, pass 1: block (chunk, column tile) -- each thread owns one column and sums dy * xhat
// over the chunk's kChunkRows rows in row order into partial[chunk, column].
__global__ void rmsnorm_dweight_partial_kernel(float* partial, const bf16* dy, const bf16* x, const float* rstd, int64_t rows,
                                       int64_t d) {
  const int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x, chunk = blockIdx.x;
  if (c >= d) return;
  float acc = 0;
  for (int64_t r = chunk * kChunkRows; r < min(rows, (chunk + 1) * kChunkRows); ++r)
    acc += float(dy[r * d + c]) * (float(x[r * d + c]) * rstd[r]);
  partial[chunk * d + c] = acc;
}

// dweight, pass 2: a block of 32 x 32 threads owns 32 columns; thread (column j, lane k) adds the
// chunks k, k + 32, k + 64, ... in order, then one thread per column adds the 32 sums in lane order.
// The partition depends only on the shape, so the result is the same on every run. (One thread per
// column over all chunks was a 2048-long serial chain for QK-norm's 131072 rows: ~120 us a call.)
constexpr int kReduceLanes = 32;
__global__ void rmsnorm_dweight_reduce_kernel(float* dweight, const float* partial, int64_t chunks, int64_t d) {
  __shared__ float sums[kReduceLanes][33];  // padded: the final pass reads a column
  const int j = threadIdx.x % 32, k = threadIdx.x / 32;
  const int64_t c = blockIdx.x * 32 + j;
  float acc = 0;
  if (c < d)
    for (int64_t chunk = k; chunk < chunks; chunk += kReduceLanes) acc += partial[chunk * d + c];
  sums[k][j] = acc;
  __syncthreads();
  if (k == 0 && c < d) {
    float total = 0;
    for (int lane = 0; lane < kReduceLanes; ++lane) total += sums[lane][j];
    dweight[c] += total;
  }
}

void launch_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, double eps, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  const unsigned blocks = unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock), threads = 32 * kWarpsPerBlock;
  auto *out = static_cast<bf16*>(y.data), *in = static_cast<bf16*>(x.data), *w = static_cast<bf16*>(weight.data);
  if (packable(d, {y.data, x.data, weight.data}))
    rmsnorm_forward_kernel<8><<<blocks, threads, 0, s>>>(out, rstd.ptr<float>(), in, w, n, d, float(eps));
  else rmsnorm_forward_kernel<1><<<blocks, threads, 0, s>>>(out, rstd.ptr<float>(), in, w, n, d, float(eps));
  MARROW_CUDA_CHECK_LAUNCH();
}

void launch_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Tensor rstd, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  if (n == 0 || d == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  const unsigned blocks = unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock), threads = 32 * kWarpsPerBlock;
  auto *dxp = static_cast<bf16*>(dx.data), *dyp = static_cast<bf16*>(dy.data), *xp = static_cast<bf16*>(x.data),
       *w = static_cast<bf16*>(weight.data);
  if (packable(d, {dx.data, dy.data, x.data, weight.data}))
    rmsnorm_backward_dx_kernel<8><<<blocks, threads, 0, s>>>(dxp, dyp, xp, w, rstd.ptr<float>(), n, d);
  else rmsnorm_backward_dx_kernel<1><<<blocks, threads, 0, s>>>(dxp, dyp, xp, w, rstd.ptr<float>(), n, d);
  MARROW_CUDA_CHECK_LAUNCH();

  const int64_t chunks = (n + kChunkRows - 1) / kChunkRows;
  Buffer partial(DType::f32, Device::cuda, {chunks, d}, stream);
  const unsigned column_blocks = unsigned((d + 255) / 256);
  rmsnorm_dweight_partial_kernel<<<dim3(unsigned(chunks), column_blocks), 256, 0, s>>>(partial.ptr<float>(), dyp, xp, rstd.ptr<float>(),
                                                                               n, d);
  MARROW_CUDA_CHECK_LAUNCH();
  rmsnorm_dweight_reduce_kernel<<<unsigned((d + 31) / 32), 32 * kReduceLanes, 0, s>>>(dweight.ptr<float>(), partial.ptr<float>(), chunks, d);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, double eps, Stream stream) {
  const char* op = "rmsnorm_forward";
  MARROW_CHECK(x.ndim == 2, "{}: x must be [rows, dim], got {}", op, x.shape_string());
  const int64_t n = x.size(0), d = x.size(1);
  expect_shape(op, "y", y, {n, d});
  expect_shape(op, "rstd", rstd, {n});
  expect_shape(op, "weight", weight, {d});
  if (common_device(op, {{"x", &x}, {"y", &y}, {"rstd", &rstd}, {"weight", &weight}}) == Device::cuda) {
    for (auto [name, t] : {std::pair{"x", &x}, std::pair{"y", &y}, std::pair{"weight", &weight}})
      expect_dtype(op, name, *t, DType::bf16);
    expect_dtype(op, "rstd", rstd, DType::f32);
#ifdef __CUDACC__
    return launch_forward(y, rstd, x, weight, eps, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"rstd", &rstd}, {"weight", &weight}});
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
  if (common_device(op, {{"x", &x}, {"dx", &dx}, {"dy", &dy}, {"dweight", &dweight}, {"weight", &weight}, {"rstd", &rstd}}) ==
      Device::cuda) {
    for (auto [name, t] : {std::pair{"x", &x}, std::pair{"dx", &dx}, std::pair{"dy", &dy}, std::pair{"weight", &weight}})
      expect_dtype(op, name, *t, DType::bf16);
    expect_dtype(op, "rstd", rstd, DType::f32);
    expect_dtype(op, "dweight", dweight, DType::f32);
#ifdef __CUDACC__
    return launch_backward(dx, dweight, dy, x, weight, rstd, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"x", &x}, {"dx", &dx}, {"dy", &dy}, {"dweight", &dweight}, {"weight", &weight}, {"rstd", &rstd}});
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), rstd.ptr<T>(), n, d);
  });
}

}  // namespace marrow
