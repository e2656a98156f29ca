// On the GPU a group of G lanes takes a row (G = 16 for the model's rows of 128 in packs of 8: a
// warp a row would leave half its lanes idle), summing in a fixed order (each lane its packs in
// order, then a butterfly over the group). dweight: column sums per chunk of kChunkRows rows, then
// over the chunks in order (as ops/rmsnorm.cu's): deterministic.
#include "ops/gated_rmsnorm.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

template <typename T> T sigmoid(T v) { return T(1) / (T(1) + std::exp(-v)); }

template <typename T> void forward_cpu(T* y, T* rstd, const T* x, const T* z, const T* w, int64_t n, int64_t d, double eps) {
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < d; ++j) sum += double(x[i * d + j]) * x[i * d + j];
    const T r = rstd[i] = T(1.0 / std::sqrt(sum / double(d) + eps));
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = w[j] * (x[i * d + j] * r) * (z[i * d + j] / (1 + std::exp(-z[i * d + j])));
  }
}

// With n = x rstd, s = sigmoid(z): dweight += dy n silu(z), dz = dy w n s (1 + z (1 - s)), and dx
// = rstd (gn - n mean(gn n)), the plain norm's backward of gn = dy w silu(z).
template <typename T> void backward_cpu(T* dx, T* dz, T* dw, const T* dy, const T* x, const T* z, const T* w, const T* rstd, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const T r = rstd[i];
    double dot = 0;
    for (int64_t j = 0; j < d; ++j) dot += double(dy[i * d + j] * w[j] * (z[i * d + j] * sigmoid(z[i * d + j]))) * (x[i * d + j] * r);
    const T mean = T(dot / double(d));
    for (int64_t j = 0; j < d; ++j) {
      const int64_t e = i * d + j;
      const T nj = x[e] * r, s = sigmoid(z[e]), silu = z[e] * s;
      dx[e] = r * (dy[e] * w[j] * silu - nj * mean);
      dz[e] = dy[e] * w[j] * nj * s * (1 + z[e] * (1 - s));
      dw[j] += dy[e] * nj * silu;
    }
  }
}

#ifdef __CUDACC__
constexpr int kThreads = 256;
constexpr int64_t kChunkRows = 256;  // rows a dweight partial sums

__device__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// G lanes a row (a lane past the last row still joins its group's shuffles), lanes striding the row
// in packs of N. Pass 1 sums x^2 (forward) or gn n (backward) per lane in order, then over the group;
// pass 2 writes y (forward: y aliases dx, rstd is written) or dx and dz (backward: rstd is read).
template <int N, int G, bool Backward> __global__ void gated_rmsnorm_kernel(bf16* dx, bf16* dz, float* rstd, const bf16* dy, const bf16* x,
                                                                            const bf16* z, const bf16* weight, int64_t rows, int64_t d, float eps) {
  begin_after_previous_grid();
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / G, o = row * d;
  const int lane = int(threadIdx.x % G);
  const bool valid = row < rows;
  const float saved = Backward && valid ? rstd[row] : 0.0f;
  float acc = 0;
  for (int64_t c = lane * N; valid && c < d; c += G * N) {
    const Pack<bf16, N> xp = load<N>(x + o + c), zp = load<N>(z + o + c), wp = load<N>(weight + c);
    const Pack<bf16, N> gp = Backward ? load<N>(dy + o + c) : Pack<bf16, N>{};
    for (int l = 0; l < N; ++l) {
      const float xv = float(xp.v[l]), v = float(zp.v[l]);
      acc = Backward ? fmaf(float(gp.v[l]) * float(wp.v[l]) * (v * sigmoidf(v)), xv * saved, acc) : fmaf(xv, xv, acc);
    }
  }
  for (int m = G / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (!valid) return;
  const float r = Backward ? saved : 1.0f / sqrtf(acc / float(d) + eps), mean = acc / float(d);
  if (!Backward && lane == 0) rstd[row] = r;
  for (int64_t c = lane * N; c < d; c += G * N) {
    const Pack<bf16, N> xp = load<N>(x + o + c), zp = load<N>(z + o + c), wp = load<N>(weight + c);
    const Pack<bf16, N> gp = Backward ? load<N>(dy + o + c) : Pack<bf16, N>{};
    Pack<bf16, N> first, second;
    for (int l = 0; l < N; ++l) {
      const float xv = float(xp.v[l]), v = float(zp.v[l]), w = float(wp.v[l]), s = sigmoidf(v), nj = xv * r, gw = float(gp.v[l]) * w;
      // The forward rounds as torch: x rstd to bf16, its product with the bf16 weight in bf16.
      first.v[l] = Backward ? bf16(r * (gw * (v * s) - nj * mean)) : bf16(float(bf16(w * float(bf16(nj)))) * (v / (1.0f + expf(-v))));
      second.v[l] = bf16(gw * nj * s * (1.0f + v * (1.0f - s)));
    }
    store<N>(dx + o + c, first);
    if (Backward) store<N>(dz + o + c, second);
  }
}

// partial[chunk, c] = the sum over the chunk's rows, in order, of dy n silu(z) (a thread a column).
__global__ void gated_rmsnorm_dweight_partial_kernel(float* partial, const bf16* dy, const bf16* x, const bf16* z, const float* rstd, int64_t rows,
                                                     int64_t d) {
  begin_after_previous_grid();
  const int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x, chunk = blockIdx.x;
  if (c >= d) return;
  float acc = 0;
  for (int64_t r = chunk * kChunkRows; r < min(rows, (chunk + 1) * kChunkRows); ++r) {
    const float v = float(z[r * d + c]);
    acc = fmaf(float(dy[r * d + c]) * (v * sigmoidf(v)), float(x[r * d + c]) * rstd[r], acc);
  }
  partial[chunk * d + c] = acc;
}

// dweight[c] += the sum over chunks of partial[chunk, c], in chunk order.
__global__ void gated_rmsnorm_dweight_sum_kernel(float* dweight, const float* partial, int64_t chunks, int64_t d) {
  begin_after_previous_grid();
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  float acc = 0;
  for (int64_t k = 0; c < d && k < chunks; ++k) acc += partial[k * d + c];
  if (c < d) dweight[c] += acc;
}

// The row kernel: 16 lanes for rows of at most 128 in packs of 8, 32 for longer ones and for rows
// that do not split into 16-byte packs (one element at a time).
template <bool Backward>
void launch_rows(Tensor dx, Tensor dz, Tensor rstd, Tensor dy, Tensor x, Tensor z, Tensor weight, double eps, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  const bool packed = packable(d, {dx.data, dz.data, dy.data, x.data, z.data, weight.data}), narrow = packed && d <= 128;
  if (n > 0)
    launch_dependent(!packed  ? gated_rmsnorm_kernel<1, 32, Backward>
                     : narrow ? gated_rmsnorm_kernel<8, 16, Backward>
                              : gated_rmsnorm_kernel<8, 32, Backward>,
                     unsigned((n * (narrow ? 16 : 32) + kThreads - 1) / kThreads), kThreads, 0, stream, bf16_ptr(dx), bf16_ptr(dz),
                     rstd.ptr<float>(), bf16_ptr(dy), bf16_ptr(x), bf16_ptr(z), bf16_ptr(weight), n, d, float(eps));
}

void launch_backward(Tensor dx, Tensor dz, Tensor dweight, Tensor dy, Tensor x, Tensor z, Tensor weight, Tensor rstd, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1), chunks = (n + kChunkRows - 1) / kChunkRows;
  if (n == 0 || d == 0) return;
  launch_rows<true>(dx, dz, rstd, dy, x, z, weight, 0, stream);
  Buffer partial(DType::f32, Device::cuda, {chunks, d}, stream);
  launch_dependent(gated_rmsnorm_dweight_partial_kernel, dim3(unsigned(chunks), unsigned((d + 127) / 128)), 128, 0, stream, partial.ptr<float>(),
                   bf16_ptr(dy), bf16_ptr(x), bf16_ptr(z), rstd.ptr<float>(), n, d);
  launch_dependent(gated_rmsnorm_dweight_sum_kernel, unsigned((d + 127) / 128), 128, 0, stream, dweight.ptr<float>(), partial.ptr<float>(),
                   chunks, d);
}
#endif

// x [N, D] and the tensors shaped like it; weight [D]; rstd [N].
void check_shapes(const char* op, const Tensor& x, std::initializer_list<std::pair<const char*, const Tensor*>> like_x, const Tensor& weight,
                  const Tensor& rstd) {
  expect_ndim(op, "x", x, 2, "[rows, dim]");
  for (auto [name, t] : like_x) expect_shape(op, name, *t, {x.size(0), x.size(1)});
  expect_shape(op, "weight", weight, {x.size(1)});
  expect_shape(op, "rstd", rstd, {x.size(0)});
}

}  // namespace

void gated_rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor z, Tensor weight, double eps, Stream stream) {
  const char* op = "gated_rmsnorm_forward";
  check_shapes(op, x, {{"z", &z}, {"y", &y}}, weight, rstd);
  if (on_gpu(op, {{"x", &x, DType::bf16}, {"z", &z, DType::bf16}, {"y", &y, DType::bf16}, {"rstd", &rstd, DType::f32},
                  {"weight", &weight, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, launch_rows<false>(y, Tensor{}, rstd, Tensor{}, x, z, weight, eps, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(y.ptr<T>(), rstd.ptr<T>(), x.ptr<T>(), z.ptr<T>(), weight.ptr<T>(), x.size(0), x.size(1), eps);
  });
}

void gated_rmsnorm_backward(Tensor dx, Tensor dz, Tensor dweight, Tensor dy, Tensor x, Tensor z, Tensor weight, Tensor rstd, Stream stream) {
  const char* op = "gated_rmsnorm_backward";
  check_shapes(op, x, {{"z", &z}, {"dy", &dy}, {"dx", &dx}, {"dz", &dz}}, weight, rstd);
  expect_shape(op, "dweight", dweight, {x.size(1)});
  if (on_gpu(op, {{"x", &x, DType::bf16}, {"z", &z, DType::bf16}, {"dy", &dy, DType::bf16}, {"dx", &dx, DType::bf16}, {"dz", &dz, DType::bf16},
                  {"dweight", &dweight, DType::f32}, {"weight", &weight, DType::bf16}, {"rstd", &rstd, DType::f32}}))
    MARROW_GPU_RETURN(op, stream, launch_backward(dx, dz, dweight, dy, x, z, weight, rstd, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dz.ptr<T>(), dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), z.ptr<T>(), weight.ptr<T>(), rstd.ptr<T>(), x.size(0),
                    x.size(1));
  });
}

}  // namespace marrow
