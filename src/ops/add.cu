#include "ops/add.h"

#include <algorithm>
#include <cstdint>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

template <typename T>
void add_cpu(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

#ifdef __CUDACC__
// One thread per pack of N elements (16 bytes when every pointer is 16-byte aligned, else one
// element) in a grid-stride loop, then the n % N tail. Elementwise: nothing to order, and each
// element is read before the same thread writes it, so out may alias a or b.
template <typename T, int N> __global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  begin_after_previous_grid();
  using P = Pack<T, N>;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n / N; i += stride) {
    const P pa = reinterpret_cast<const P*>(a)[i], pb = reinterpret_cast<const P*>(b)[i];
    P po;
#pragma unroll
    for (int l = 0; l < N; ++l) po.v[l] = T(float(pa.v[l]) + float(pb.v[l]));
    reinterpret_cast<P*>(out)[i] = po;
  }
  for (int64_t i = n / N * N + first; i < n; i += stride) out[i] = T(float(a[i]) + float(b[i]));
}

template <typename T> void launch_add(Tensor out, Tensor a, Tensor b, Stream stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  constexpr int kPack = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(out.data) | reinterpret_cast<uintptr_t>(a.data) |
                        reinterpret_cast<uintptr_t>(b.data)) % 16 == 0;
  launch_dependent(aligned ? add_kernel<T, kPack> : add_kernel<T, 1>, grid_stride_blocks(n / (aligned ? kPack : 1), 256, 8192), 256, 0,
                   stream, static_cast<T*>(out.data), static_cast<const T*>(a.data), static_cast<const T*>(b.data), n);
}

// acc (f32) += x: one thread per pack of 4 (acc 16-byte, x 4-element aligned) or per element.
template <typename T, int N> __global__ void add_into_kernel(float* acc, const T* x, int64_t n) {
  begin_after_previous_grid();
  using PA = Pack<float, N>;
  using PX = Pack<T, N>;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n / N; i += stride) {
    PA pa = reinterpret_cast<const PA*>(acc)[i];
    const PX px = reinterpret_cast<const PX*>(x)[i];
#pragma unroll
    for (int l = 0; l < N; ++l) pa.v[l] += float(px.v[l]);
    reinterpret_cast<PA*>(acc)[i] = pa;
  }
  for (int64_t i = n / N * N + first; i < n; i += stride) acc[i] += float(x[i]);
}

template <typename T> void launch_add_into(Tensor acc, Tensor x, Stream stream) {
  const int64_t n = acc.numel();
  if (n == 0) return;
  constexpr int kPack = 4;
  const bool aligned =
      reinterpret_cast<uintptr_t>(acc.data) % 16 == 0 && reinterpret_cast<uintptr_t>(x.data) % (kPack * sizeof(T)) == 0;
  launch_dependent(aligned ? add_into_kernel<T, kPack> : add_into_kernel<T, 1>, grid_stride_blocks(n / (aligned ? kPack : 1), 256, 8192),
                   256, 0, stream, static_cast<float*>(acc.data), static_cast<const T*>(x.data), n);
}
#endif

}  // namespace

void add(Tensor out, Tensor a, Tensor b, Stream stream) {
  const char* op = "add";
  for (auto [name, t] : {std::pair{"a", &a}, std::pair{"b", &b}})
    MARROW_CHECK(t->numel() == out.numel(), "{}: {} has shape {} ({} elements) but out has shape {} ({} elements)", op, name,
                 t->shape_string(), t->numel(), out.shape_string(), out.numel());
  expect_same_dtype(op, {{"out", &out}, {"a", &a}, {"b", &b}});
  if (common_device(op, {{"out", &out}, {"a", &a}, {"b", &b}}) == Device::cuda) {
    MARROW_CHECK(out.dtype == DType::bf16 || out.dtype == DType::f32, "{}: on the GPU the tensors must be bf16 or f32, got {}", op,
                 dtype_name(out.dtype));
    MARROW_GPU_RETURN(op, stream, out.dtype == DType::bf16 ? launch_add<bf16>(out, a, b, stream) : launch_add<float>(out, a, b, stream));
  }
  with_cpu_scalar(op, out, [&](auto s) { using T = decltype(s); add_cpu<T>(out.ptr<T>(), a.ptr<T>(), b.ptr<T>(), out.numel()); });
}

void add_into(Tensor acc, Tensor x, Stream stream) {
  const char* op = "add_into";
  MARROW_CHECK(x.numel() == acc.numel(), "{}: x has shape {} ({} elements) but acc has shape {} ({} elements)", op, x.shape_string(),
               x.numel(), acc.shape_string(), acc.numel());
  expect_dtype(op, "acc", acc, DType::f32);
  MARROW_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, "{}: x must be f32 or bf16, got {}", op, dtype_name(x.dtype));
  if (common_device(op, {{"acc", &acc}, {"x", &x}}) == Device::cuda)
    MARROW_GPU_RETURN(op, stream, x.dtype == DType::bf16 ? launch_add_into<bf16>(acc, x, stream) : launch_add_into<float>(acc, x, stream));
  float* a = acc.ptr<float>();
  for (int64_t i = 0; i < acc.numel(); ++i)
    a[i] += x.dtype == DType::f32 ? x.ptr<float>()[i] : bf16_to_float(static_cast<const uint16_t*>(x.data)[i]);
}

}  // namespace marrow
