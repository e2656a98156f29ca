#include "ops/route_weight.h"

#include <cstdint>

#include "core/cuda_check.h"
#include "ops/common.h"
#include "ops/dispatch.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

template <typename T>
void backward_cpu(T* dtopk_weight, T* dact, T* act, const T* topk_weight, const int32_t* copy_row, int64_t copies, int64_t width) {
  for (int64_t c = 0; c < copies; ++c) {
    const int64_t r = copy_row[c];
    if (r == -1) {
      dtopk_weight[c] = T(0);
      continue;
    }
    T* g = dact + r * width;
    T* a = act + r * width;
    double dot = 0;
    for (int64_t i = 0; i < width; ++i) dot += double(g[i]) * a[i];
    dtopk_weight[c] = T(dot);
    const T w = topk_weight[c];
    for (int64_t i = 0; i < width; ++i) {
      g[i] = T(w * g[i]);
      a[i] = T(w * a[i]);
    }
  }
}

#ifdef __CUDACC__
using bf16 = __nv_bfloat16;
constexpr int kWarps = 4;  // copies per block

template <int N> struct alignas(2 * N) Pack {
  bf16 v[N];
};

// One warp per copy: the dot in f32 over lane-strided packs, reduced by a fixed butterfly (so
// deterministic), then the row scaled by each lane in the packs it read. Rows outside [0, R)
// other than -1 (copy_row is not checked on the GPU) get dtopk_weight = NaN and are not touched.
template <int N>
__global__ void route_weight_backward_kernel(float* dtopk_weight, bf16* dact, bf16* act, const float* topk_weight,
                                             const int32_t* copy_row, int64_t copies, int64_t rows, int64_t width) {
  const int64_t c = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (c >= copies) return;
  const int64_t r = copy_row[c];
  if (r < 0 || r >= rows) {
    if (lane == 0) dtopk_weight[c] = r == -1 ? 0.0f : NAN;
    return;
  }
  auto* g = reinterpret_cast<Pack<N>*>(dact + r * width);
  auto* a = reinterpret_cast<Pack<N>*>(act + r * width);
  float dot = 0;
  for (int64_t p = lane; p < width / N; p += 32) {
    const Pack<N> gp = g[p], ap = a[p];
    for (int l = 0; l < N; ++l) dot += float(gp.v[l]) * float(ap.v[l]);
  }
  for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (lane == 0) dtopk_weight[c] = dot;
  const float w = topk_weight[c];
  for (int64_t p = lane; p < width / N; p += 32) {
    Pack<N> gp = g[p], ap = a[p];
    for (int l = 0; l < N; ++l) {
      gp.v[l] = bf16(w * float(gp.v[l]));
      ap.v[l] = bf16(w * float(ap.v[l]));
    }
    g[p] = gp;
    a[p] = ap;
  }
}

void launch_backward(Tensor dtopk_weight, Tensor dact, Tensor act, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const int64_t copies = copy_row.numel(), rows = dact.size(0), width = dact.size(1);
  if (copies == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  const unsigned blocks = unsigned((copies + kWarps - 1) / kWarps);
  float* dw = dtopk_weight.ptr<float>();
  auto *g = static_cast<bf16*>(dact.data), *a = static_cast<bf16*>(act.data);
  const float* w = topk_weight.ptr<float>();
  const int32_t* slots = copy_row.ptr<int32_t>();
  if (packable(width, {dact.data, act.data}))
    route_weight_backward_kernel<8><<<blocks, 32 * kWarps, 0, s>>>(dw, g, a, w, slots, copies, rows, width);
  else route_weight_backward_kernel<1><<<blocks, 32 * kWarps, 0, s>>>(dw, g, a, w, slots, copies, rows, width);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

void route_weight_backward(Tensor dtopk_weight, Tensor dact, Tensor act, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const char* op = "route_weight_backward";
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  MARROW_CHECK(dact.ndim == 2, "{}: dact must be [rows, width], got {}", op, dact.shape_string());
  const int64_t n = copy_row.size(0), k = copy_row.size(1), rows = dact.size(0), width = dact.size(1);
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "act", act, {rows, width});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  if (common_device(op, {{"dtopk_weight", &dtopk_weight},
                         {"dact", &dact},
                         {"act", &act},
                         {"topk_weight", &topk_weight},
                         {"copy_row", &copy_row}}) == Device::cuda) {
    for (auto [name, t] : {std::pair{"dact", &dact}, std::pair{"act", &act}}) expect_dtype(op, name, *t, DType::bf16);
    for (auto [name, t] : {std::pair{"topk_weight", &topk_weight}, std::pair{"dtopk_weight", &dtopk_weight}})
      expect_dtype(op, name, *t, DType::f32);
#ifdef __CUDACC__
    return launch_backward(dtopk_weight, dact, act, topk_weight, copy_row, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"dtopk_weight", &dtopk_weight}, {"dact", &dact}, {"act", &act}, {"topk_weight", &topk_weight}});
  (void)stream;
  expect_copy_rows(op, copy_row, rows);
  with_cpu_scalar(op, dact, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dtopk_weight.ptr<T>(), dact.ptr<T>(), act.ptr<T>(), topk_weight.ptr<T>(), copy_row.ptr<int32_t>(), n * k, width);
  });
}

}  // namespace marrow
