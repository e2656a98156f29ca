#include "ops/grouped_linear_fp8.h"

#include "core/memory.h"
#include "ops/common.h"
#include "ops/grouped_linear.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ops/wgmma_fp8.cuh"
#endif

namespace marrow {

namespace {

const char* kOp = "grouped_linear_fp8";

// ---- CPU reference: the dequantized operands through grouped_linear_forward's ----------------------
void grouped_linear_fp8_cpu(Tensor y, Fp8Tensor x, Fp8Tensor weight, Tensor expert_offsets) {
  Buffer x_values(DType::f32, Device::cpu, {x.values.size(0), x.values.size(1)});
  Buffer w_values(DType::f32, Device::cpu, {weight.values.size(0), weight.values.size(1), weight.values.size(2)});
  dequantize_rows(x_values, x);
  dequantize_blocks(w_values, weight);
  grouped_linear_forward(y, x_values, w_values, expert_offsets);
}

// ---- CUDA kernels --------------------------------------------------------------------------------
#ifdef __CUDACC__
__device__ __forceinline__ float e4m3_value(uint8_t byte) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, __NV_E4M3))); }

// y[r, n] by the formula of ops/grouped_linear_fp8.h, one thread per output, f32 sums in a fixed
// order. Only for shapes the wgmma kernel cannot take (TMA's alignment rule): slow.
__global__ void grouped_fp8_simple_kernel(bf16* y, const uint8_t* xq, const float* xs, const uint8_t* wq, const float* ws,
                                          const int32_t* offsets, int experts, int64_t rows, int n, int k) {
  begin_after_previous_grid();
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= rows * n) return;
  const int64_t r = idx / n;
  const int c = int(idx % n);
  int lo = 0, hi = experts;  // the last expert whose first row is <= r
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid;
  }
  const int k_blocks = (k + int(kFp8Block) - 1) / int(kFp8Block), n_blocks = (n + int(kFp8Block) - 1) / int(kFp8Block);
  const uint8_t* w = wq + (int64_t(lo) * n + c) * k;
  float sum = 0;
  for (int b = 0; b < k_blocks; ++b) {
    float part = 0;
    for (int j = b * int(kFp8Block); j < min(k, (b + 1) * int(kFp8Block)); ++j) part += e4m3_value(xq[r * k + j]) * e4m3_value(w[j]);
    sum += part * (xs[int64_t(b) * rows + r] * ws[(int64_t(lo) * n_blocks + c / int(kFp8Block)) * k_blocks + b]);
  }
  y[idx] = __float2bfloat16(sum);
}

bool wgmma_shape(Tensor y, Fp8Tensor x, Fp8Tensor weight) {
  return x.values.size(1) % 16 == 0 && packable(y.size(1), {y.data, x.values.data, weight.values.data}) &&
         weight.values.size(0) <= wgmma::fp8::kMaxExperts;
}

void grouped_linear_fp8_gpu(Tensor y, Fp8Tensor x, Fp8Tensor weight, Tensor expert_offsets, Stream stream) {
  const int64_t R = x.values.size(0), K = x.values.size(1), E = weight.values.size(0), N = weight.values.size(1);
  if (R == 0 || N == 0) return;
  Buffer holder;
  const int32_t* offsets = expert_offsets_on_device(expert_offsets, holder, stream);
  const auto* xq = static_cast<const uint8_t*>(x.values.data);
  const auto* wq = static_cast<const uint8_t*>(weight.values.data);
  if (wgmma_shape(y, x, weight)) {
    const int tiles = expert_offsets.device == Device::cpu ? wgmma::tile_count(expert_offsets.ptr<int32_t>(), E, N) : -1;
    return wgmma::fp8::grouped_gemm(bf16_ptr(y), xq, x.scales.ptr<float>(), wq, weight.scales.ptr<float>(), offsets, tiles, E, N, K, R,
                                    cuda_stream(stream));
  }
  launch_dependent(grouped_fp8_simple_kernel, unsigned((R * N + 255) / 256), 256, 0, stream, bf16_ptr(y), xq, x.scales.ptr<float>(), wq,
                   weight.scales.ptr<float>(), offsets, int(E), R, int(N), int(K));
}
#endif

void check_operands(Tensor y, Fp8Tensor x, Fp8Tensor weight) {
  MARROW_CHECK(x.values.ndim == 2, "{}: x's values must be [rows, K], got {}", kOp, x.values.shape_string());
  MARROW_CHECK(weight.values.ndim == 3, "{}: weight's values must be [experts, N, K], got {}", kOp, weight.values.shape_string());
  const int64_t R = x.values.size(0), K = x.values.size(1), E = weight.values.size(0), N = weight.values.size(1);
  expect_shape(kOp, "weight values", weight.values, {E, N, K});
  expect_shape(kOp, "x scales", x.scales, {fp8_blocks(K), R});
  expect_shape(kOp, "weight scales", weight.scales, {E, fp8_blocks(N), fp8_blocks(K)});
  expect_shape(kOp, "y", y, {R, N});
  for (auto [name, t] : {std::pair{"x values", &x.values}, std::pair{"weight values", &weight.values}})
    expect_dtype(kOp, name, *t, DType::fp8_e4m3);
  for (auto [name, t] : {std::pair{"x scales", &x.scales}, std::pair{"weight scales", &weight.scales}})
    expect_dtype(kOp, name, *t, DType::f32);
}

bool expert_fp8_on = false;

}  // namespace

void set_expert_fp8(bool on) { expert_fp8_on = on; }
bool expert_fp8() { return expert_fp8_on; }

void grouped_linear_fp8(Tensor y, Fp8Tensor x, Fp8Tensor weight, Tensor expert_offsets, Stream stream) {
  check_operands(y, x, weight);
  check_expert_offsets(kOp, expert_offsets, weight.values.size(0), x.values.size(0));
  const Device device = common_device(kOp, {{"y", &y}, {"x values", &x.values}, {"x scales", &x.scales},
                                            {"weight values", &weight.values}, {"weight scales", &weight.scales}});
  if (device == Device::cpu) {
    expect_dtype(kOp, "y", y, DType::f32);
    expect_device(kOp, "expert_offsets", expert_offsets, Device::cpu);
    return grouped_linear_fp8_cpu(y, x, weight, expert_offsets);
  }
  expect_dtype(kOp, "y", y, DType::bf16);
  MARROW_GPU_RETURN(kOp, stream, grouped_linear_fp8_gpu(y, x, weight, expert_offsets, stream));
}

}  // namespace marrow
