#include "ops/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

namespace marrow {

namespace {

#ifdef __CUDACC__
// A fixed partition, independent of the GPU: block b's threads take elements (or float4s) in a
// grid-stride loop, so which element lands in which partial sum depends only on n.
constexpr int kBlocks = int(kSumParts), kThreads = 256;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The block's sum of the threads' acc in a fixed tree (butterfly in each warp, then warp 0 over
// the warps) into parts[block].
__device__ void store_block_sum(double* parts, double acc) {
  __shared__ double warp_sums[kThreads / 32];
  for (int m = 16; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int w = 0; w < kThreads / 32; ++w) sum += warp_sums[w];
    parts[blockIdx.x] = sum;
  }
}

// Per-thread sums of squares in double, then store_block_sum.
template <bool Vec4> __global__ void sum_squares_kernel(double* parts, const float* x, int64_t n) {
  const int64_t first = blockIdx.x * int64_t(kThreads) + threadIdx.x, stride = int64_t(kBlocks) * kThreads;
  double acc = 0;
  int64_t done = 0;
  if (Vec4) {
    // Four loads in flight a thread (one left it ~4% short of the copy rate), added in the same order.
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int64_t n4 = n / 4;
    auto add = [&acc](float4 v) { acc += double(v.x) * v.x + double(v.y) * v.y + double(v.z) * v.z + double(v.w) * v.w; };
    int64_t i = first;
    for (; i + 3 * stride < n4; i += 4 * stride) {
      const float4 a = x4[i], b = x4[i + stride], c = x4[i + 2 * stride], d = x4[i + 3 * stride];
      add(a);
      add(b);
      add(c);
      add(d);
    }
    for (; i < n4; i += stride) add(x4[i]);
    done = n4 * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) acc += double(x[i]) * x[i];
  store_block_sum(parts, acc);
}

__global__ void sum_values_kernel(double* parts, const double* x, int64_t n) {
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(kBlocks) * kThreads) acc += x[i];
  store_block_sum(parts, acc);
}

void launch_sum_squares(Tensor parts, Tensor x, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream.handle);
  const int64_t n = x.numel();
  if (aligned16(x.data)) sum_squares_kernel<true><<<kBlocks, kThreads, 0, s>>>(parts.ptr<double>(), x.ptr<float>(), n);
  else sum_squares_kernel<false><<<kBlocks, kThreads, 0, s>>>(parts.ptr<double>(), x.ptr<float>(), n);
  MARROW_CUDA_CHECK_LAUNCH();
}

void launch_sum_values(Tensor parts, Tensor x, Stream stream) {
  sum_values_kernel<<<kBlocks, kThreads, 0, static_cast<cudaStream_t>(stream.handle)>>>(parts.ptr<double>(), x.ptr<double>(), x.numel());
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

void check_parts(const char* op, Tensor parts, Tensor x) {
  expect_shape(op, "parts", parts, {kSumParts});
  expect_dtype(op, "parts", parts, DType::f64);
  expect_device(op, "parts", parts, x.device);
}

// The CPU's parts: the whole sum in parts[0], in index order.
template <typename F> void cpu_parts(Tensor parts, F&& sum) {
  double* p = parts.ptr<double>();
  std::fill(p, p + kSumParts, 0.0);
  p[0] = sum();
}

// sum_squares_parts under the name of the op that asked (errors name it).
void squares_parts(const char* op, Tensor parts, Tensor x, Stream stream) {
  check_parts(op, parts, x);
  if (x.device == Device::cuda) {
    expect_dtype(op, "x", x, DType::f32);
#ifdef __CUDACC__
    return launch_sum_squares(parts, x, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    cpu_parts(parts, [&] {
      const T* p = x.ptr<T>();
      double sum = 0;
      for (int64_t i = 0; i < x.numel(); ++i) sum += double(p[i]) * p[i];
      return sum;
    });
  });
}

}  // namespace

double l2_norm(Tensor x, Stream stream) {
  Buffer parts(DType::f64, x.device, {kSumParts}, stream);
  squares_parts("l2_norm", parts, x, stream);
  return std::sqrt(sum_parts_on_host(parts, stream));
}

void sum_squares_parts(Tensor parts, Tensor x, Stream stream) { squares_parts("sum_squares_parts", parts, x, stream); }

void sum_values_parts(Tensor parts, Tensor x, Stream stream) {
  const char* op = "sum_values_parts";
  check_parts(op, parts, x);
  expect_dtype(op, "x", x, DType::f64);
  if (x.device == Device::cuda) {
#ifdef __CUDACC__
    return launch_sum_values(parts, x, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  cpu_parts(parts, [&] {
    double sum = 0;
    for (int64_t i = 0; i < x.numel(); ++i) sum += x.ptr<double>()[i];
    return sum;
  });
}

double sum_parts_on_host(Tensor parts, Stream stream) {
  const char* op = "sum_parts_on_host";
  expect_dtype(op, "parts", parts, DType::f64);
  MARROW_CHECK(parts.numel() % kSumParts == 0, "{}: parts has {} elements, not a multiple of {}", op, parts.numel(), kSumParts);
  Buffer host;
  const double* p = parts.ptr<double>();
  if (parts.device == Device::cuda) {
    host = to_host(parts, stream);
    p = host.ptr<double>();
  }
  double sum = 0;
  for (int64_t i = 0; i < parts.numel(); ++i) sum += p[i];
  return sum;
}

}  // namespace marrow
