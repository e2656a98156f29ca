#include "ops/add.h"

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#endif

namespace marrow {

namespace {

template <typename T>
void add_cpu(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

#ifdef __CUDACC__
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// One thread per pack of N elements (16 bytes when every pointer is 16-byte aligned, else one
// element) in a grid-stride loop, then the n % N tail. Elementwise: nothing to order, and each
// element is read before the same thread writes it, so out may alias a or b.
template <typename T, int N> __global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
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
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((n / (aligned ? kPack : 1) + threads) / threads, 8192));
  auto s = static_cast<cudaStream_t>(stream.handle);
  auto* o = static_cast<T*>(out.data);
  auto *pa = static_cast<const T*>(a.data), *pb = static_cast<const T*>(b.data);
  if (aligned) add_kernel<T, kPack><<<blocks, threads, 0, s>>>(o, pa, pb, n);
  else add_kernel<T, 1><<<blocks, threads, 0, s>>>(o, pa, pb, n);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

void add(Tensor out, Tensor a, Tensor b, Stream stream) {
  const char* op = "add";
  for (auto [name, t] : {std::pair{"a", &a}, std::pair{"b", &b}})
    MARROW_CHECK(t->numel() == out.numel(), "{}: {} has shape {} ({} elements) but out has shape {} ({} elements)", op,
                 name, t->shape_string(), t->numel(), out.shape_string(), out.numel());
  expect_same_dtype(op, {{"out", &out}, {"a", &a}, {"b", &b}});
  if (common_device(op, {{"out", &out}, {"a", &a}, {"b", &b}}) == Device::cuda) {
    MARROW_CHECK(out.dtype == DType::bf16 || out.dtype == DType::f32, "{}: on the GPU the tensors must be bf16 or f32, got {}",
                 op, dtype_name(out.dtype));
#ifdef __CUDACC__
    if (out.dtype == DType::bf16) return launch_add<__nv_bfloat16>(out, a, b, stream);
    return launch_add<float>(out, a, b, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    add_cpu<T>(out.ptr<T>(), a.ptr<T>(), b.ptr<T>(), out.numel());
  });
}

}  // namespace marrow
