#include "ops/init.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/rng.h"
#include "ops/common.h"

namespace marrow {

namespace {

#ifdef __CUDACC__
__global__ void fill_normal_kernel(float* out, int64_t n, int64_t first, Philox rng, float std) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = std * rng.normal(uint64_t(first + i));
}

__global__ void fill_constant_kernel(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) out[i] = value;
}

int grid_for(int64_t n) { return int(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 8192))); }
#endif

}  // namespace

void fill_normal(Tensor out, uint64_t seed, std::string_view name, double std, int64_t first, Stream stream) {
  const Philox rng = philox_for(seed, name);
  if (out.device == Device::cpu) {
    with_cpu_scalar("fill_normal", out, [&](auto s) {
      using T = decltype(s);
      T* p = out.ptr<T>();
      for (int64_t i = 0; i < out.numel(); ++i) p[i] = T(std * rng.normal(uint64_t(first + i)));
    });
    return;
  }
#ifdef __CUDACC__
  expect_dtype("fill_normal", "out", out, DType::f32);
  if (out.numel() == 0) return;
  fill_normal_kernel<<<grid_for(out.numel()), 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(out.ptr<float>(), out.numel(), first, rng,
                                                                                                  float(std));
  MARROW_CUDA_CHECK_LAUNCH();
#else
  (void)stream;
  no_cuda_kernel("fill_normal");
#endif
}

void fill_constant(Tensor out, double value, Stream stream) {
  if (out.device == Device::cpu) {
    with_cpu_scalar("fill_constant", out, [&](auto s) {
      using T = decltype(s);
      std::fill(out.ptr<T>(), out.ptr<T>() + out.numel(), T(value));
    });
    return;
  }
#ifdef __CUDACC__
  expect_dtype("fill_constant", "out", out, DType::f32);
  if (out.numel() == 0) return;
  fill_constant_kernel<<<grid_for(out.numel()), 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(out.ptr<float>(), out.numel(),
                                                                                                    float(value));
  MARROW_CUDA_CHECK_LAUNCH();
#else
  (void)stream;
  no_cuda_kernel("fill_constant");
#endif
}

}  // namespace marrow
