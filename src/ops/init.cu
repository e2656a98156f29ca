#include "ops/init.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/rng.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

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
#endif

}  // namespace

void fill_normal(Tensor out, uint64_t seed, std::string_view name, double std, int64_t first, Stream stream) {
  const Philox rng = philox_for(seed, name);
  if (out.device == Device::cpu) {
    return with_cpu_scalar("fill_normal", out, [&](auto s) {
      using T = decltype(s);
      for (int64_t i = 0; i < out.numel(); ++i) out.ptr<T>()[i] = T(std * rng.normal(uint64_t(first + i)));
    });
  }
  expect_dtype("fill_normal", "out", out, DType::f32);
  if (out.numel() == 0) return;
  MARROW_GPU_RETURN("fill_normal", stream, launch_plain(fill_normal_kernel, grid_stride_blocks(out.numel(), 256, 8192), 256, 0, stream,
                                                        out.ptr<float>(), out.numel(), first, rng, float(std)));
}

void fill_constant(Tensor out, double value, Stream stream) {
  if (out.device == Device::cpu)
    return with_cpu_scalar("fill_constant", out, [&](auto s) {
      std::fill(out.ptr<decltype(s)>(), out.ptr<decltype(s)>() + out.numel(), decltype(s)(value));
    });
  expect_dtype("fill_constant", "out", out, DType::f32);
  if (out.numel() == 0) return;
  MARROW_GPU_RETURN("fill_constant", stream, launch_plain(fill_constant_kernel, grid_stride_blocks(out.numel(), 256, 8192), 256, 0, stream,
                                                          out.ptr<float>(), out.numel(), float(value)));
}

}  // namespace marrow
