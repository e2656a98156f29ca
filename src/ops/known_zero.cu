#include "ops/known_zero.h"

#include <cstdint>
#include <cstring>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

void restart_cpu(float* grad, int32_t* flags, int64_t rows, int64_t per_row) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!flags[r]) std::memset(grad + r * per_row, 0, size_t(per_row) * sizeof(float));
    flags[r] = 1;
  }
}

#ifdef __CUDACC__
// One warp a row: its lanes read the flag, and where it is clear zero the row (16-byte stores when
// the row allows them) and set it. A step touches few of an embedding's rows, so most warps only
// read their flag.
constexpr int kWarps = 8;
__global__ void restart_kernel(float* grad, int32_t* flags, int64_t rows, int64_t per_row) {
  const int64_t r = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  const int lane = int(threadIdx.x % 32);
  if (r >= rows || flags[r]) return;
  float* row = grad + r * per_row;
  if (per_row % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    for (int64_t i = lane; i < per_row / 4; i += 32) reinterpret_cast<float4*>(row)[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  } else {
    for (int64_t i = lane; i < per_row; i += 32) row[i] = 0.0f;
  }
  __syncwarp();
  if (lane == 0) flags[r] = 1;
}
#endif

}  // namespace

void restart_known_zero(Tensor grad, Tensor flags, Stream stream) {
  const char* op = "restart_known_zero";
  expect_dtype(op, "grad", grad, DType::f32);
  expect_dtype(op, "flags", flags, DType::i32);
  const int64_t rows = flags.numel();
  MARROW_CHECK(rows > 0 && grad.numel() % rows == 0, "{}: grad has {} elements, not {} equal rows (one a flag)", op, grad.numel(), rows);
  const int64_t per_row = grad.numel() / rows;
  if (common_device(op, {{"grad", &grad}, {"flags", &flags}}) == Device::cuda)
    MARROW_GPU_RETURN(op, stream, launch_plain(restart_kernel, unsigned((rows + kWarps - 1) / kWarps), 32 * kWarps, 0, stream, grad.ptr<float>(),
                                               flags.ptr<int32_t>(), rows, per_row));
  restart_cpu(grad.ptr<float>(), flags.ptr<int32_t>(), rows, per_row);
}

}  // namespace marrow
