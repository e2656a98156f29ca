#include "ops/combine.h"

#include <array>
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

// Each element of out is written once, after its own residual element is read, so out may alias
// residual; residual is null when there is none.
template <typename T>
void forward_cpu(T* out, const T* residual, const T* y_perm, const T* topk_weight, const int32_t* copy_row, int64_t n,
                 int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j)
        if (copy_row[t * k + j] != -1)
          sum += double(topk_weight[t * k + j]) * y_perm[int64_t(copy_row[t * k + j]) * h + c];
      out[t * h + c] = residual ? T(residual[t * h + c] + sum) : T(sum);
    }
}

template <typename T>
void backward_cpu(T* dy_perm, T* dtopk_weight, const T* dout, const T* y_perm, const T* topk_weight, const int32_t* copy_row,
                  int64_t n, int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = copy_row[t * k + j];
      if (row == -1) {
        dtopk_weight[t * k + j] = T(0);
        continue;
      }
      const double w = topk_weight[t * k + j];
      double dot = 0;
      for (int64_t c = 0; c < h; ++c) {
        dot += double(dout[t * h + c]) * y_perm[row * h + c];
        dy_perm[row * h + c] = T(w * dout[t * h + c]);
      }
      dtopk_weight[t * k + j] = T(dot);
    }
}

// Checks tokens[T, H] against rows[R, H], topk_weight[T, K] and copy_row[T, K] (i32); returns (T, K, H).
std::array<int64_t, 3> check_combine(const char* op, const char* tokens_name, const Tensor& tokens, const char* rows_name,
                                     const Tensor& rows, const Tensor& topk_weight, const Tensor& copy_row) {
  MARROW_CHECK(tokens.ndim == 2, "{}: {} must be [tokens, hidden], got {}", op, tokens_name, tokens.shape_string());
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  MARROW_CHECK(rows.ndim == 2, "{}: {} must be [rows, hidden], got {}", op, rows_name, rows.shape_string());
  const int64_t n = tokens.size(0), h = tokens.size(1), k = copy_row.size(1);
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_shape(op, rows_name, rows, {rows.size(0), h});
  return {n, k, h};
}

#ifdef __CUDACC__
using bf16 = __nv_bfloat16;
constexpr int kWarps = 4;  // (token, slot) pairs per block of the backward

template <int N> struct alignas(2 * N) Pack {
  bf16 v[N];
};
template <int N> __device__ Pack<N> load(const bf16* row, int64_t pack) { return reinterpret_cast<const Pack<N>*>(row)[pack]; }
template <int N> __device__ void store(bf16* row, int64_t pack, const Pack<N>& v) { reinterpret_cast<Pack<N>*>(row)[pack] = v; }

// One block per token; threads stride the row in packs of N (8 bf16 when H % 8 == 0). Each
// element sums its weighted rows in slot order in f32, skipping entries of -1, then adds the
// residual (none when residual is null): a fixed order, so deterministic. Each element is read and
// written by one thread, so out may alias residual. Any other row outside [0, R) (copy_row is not
// checked on the GPU) makes the element NaN.
template <int N>
__global__ void combine_forward_kernel(bf16* out, const bf16* residual, const bf16* y_perm, const float* topk_weight,
                               const int32_t* copy_row, int64_t rows, int k, int64_t h) {
  begin_after_previous_grid();
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < h / N; c += blockDim.x) {
    float acc[N] = {};
    for (int j = 0; j < k; ++j) {
      const int64_t r = copy_row[t * k + j];
      if (r == -1) continue;
      if (r < 0 || r >= rows) {
        for (int l = 0; l < N; ++l) acc[l] = NAN;
        continue;
      }
      const float w = topk_weight[t * k + j];
      const Pack<N> y = load<N>(y_perm + r * h, c);
      for (int l = 0; l < N; ++l) acc[l] += w * float(y.v[l]);
    }
    Pack<N> o;
    if (residual) {
      const Pack<N> res = load<N>(residual + t * h, c);
      for (int l = 0; l < N; ++l) o.v[l] = bf16(float(res.v[l]) + acc[l]);
    } else {
      for (int l = 0; l < N; ++l) o.v[l] = bf16(acc[l]);
    }
    store<N>(out + t * h, c, o);
  }
}

// One warp per copy (t, j): lanes stride the row in packs of N, write dy_perm = w * dout and
// reduce dot(dout, y_perm row) in a fixed butterfly tree, so dtopk_weight is deterministic. An
// entry of -1 gets dtopk_weight = 0 and writes no row; any other row outside [0, R) gets NaN.
template <int N>
__global__ void combine_backward_kernel(bf16* dy_perm, float* dtopk_weight, const bf16* dout, const bf16* y_perm,
                                const float* topk_weight, const int32_t* copy_row, int64_t n, int k, int64_t rows, int64_t h) {
  begin_after_previous_grid();
  const int64_t copy = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32, t = copy / k;
  const int lane = threadIdx.x % 32;
  if (copy >= n * k) return;
  const int64_t r = copy_row[copy];
  if (r == -1) {
    if (lane == 0) dtopk_weight[copy] = 0;
    return;
  }
  if (r < 0 || r >= rows) {
    if (lane == 0) dtopk_weight[copy] = NAN;
    return;
  }
  const float w = topk_weight[copy];
  float dot = 0;
  for (int64_t c = lane; c < h / N; c += 32) {
    const Pack<N> g = load<N>(dout + t * h, c), y = load<N>(y_perm + r * h, c);
    Pack<N> o;
    for (int l = 0; l < N; ++l) {
      dot += float(g.v[l]) * float(y.v[l]);
      o.v[l] = bf16(w * float(g.v[l]));
    }
    store<N>(dy_perm + r * h, c, o);
  }
  for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (lane == 0) dtopk_weight[copy] = dot;
}

void launch_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const int64_t n = copy_row.size(0), k = copy_row.size(1), h = out.size(1), rows = y_perm.size(0);
  if (n == 0 || h == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  auto* o = static_cast<bf16*>(out.data);
  auto *res = static_cast<const bf16*>(residual.data), *y = static_cast<const bf16*>(y_perm.data);
  const float* w = topk_weight.ptr<float>();
  const int32_t* slots = copy_row.ptr<int32_t>();
  // A null residual (none) passes packable's alignment test.
  if (packable(h, {out.data, residual.data, y_perm.data}))
    launch_dependent(combine_forward_kernel<8>, unsigned(n), 128, 0, s, o, res, y, w, slots, rows, int(k), h);
  else launch_dependent(combine_forward_kernel<1>, unsigned(n), 128, 0, s, o, res, y, w, slots, rows, int(k), h);
  MARROW_CUDA_CHECK_LAUNCH();
}

void launch_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, Tensor y_perm, Tensor topk_weight, Tensor copy_row,
                     Stream stream) {
  const int64_t n = copy_row.size(0), k = copy_row.size(1), h = dout.size(1), rows = y_perm.size(0);
  if (n * k == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  const unsigned blocks = unsigned((n * k + kWarps - 1) / kWarps);
  auto* dy = static_cast<bf16*>(dy_perm.data);
  float* dw = dtopk_weight.ptr<float>();
  auto *g = static_cast<const bf16*>(dout.data), *y = static_cast<const bf16*>(y_perm.data);
  const float* w = topk_weight.ptr<float>();
  const int32_t* slots = copy_row.ptr<int32_t>();
  if (packable(h, {dy_perm.data, dout.data, y_perm.data}))
    launch_dependent(combine_backward_kernel<8>, blocks, 32 * kWarps, 0, s, dy, dw, g, y, w, slots, n, int(k), rows, h);
  else launch_dependent(combine_backward_kernel<1>, blocks, 32 * kWarps, 0, s, dy, dw, g, y, w, slots, n, int(k), rows, h);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

void combine_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const char* op = "combine_forward";
  const std::array<int64_t, 3> size = check_combine(op, "out", out, "y_perm", y_perm, topk_weight, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2];
  const bool has_residual = residual.ndim != 0 || residual.data != nullptr;  // Tensor{}: no residual
  if (has_residual) expect_shape(op, "residual", residual, {n, h});
  const Device device =
      common_device(op, {{"out", &out}, {"y_perm", &y_perm}, {"topk_weight", &topk_weight}, {"copy_row", &copy_row}});
  if (has_residual) expect_device(op, "residual", residual, device);
  if (device == Device::cuda) {
    for (auto [name, t] : {std::pair{"out", &out}, std::pair{"y_perm", &y_perm}}) expect_dtype(op, name, *t, DType::bf16);
    if (has_residual) expect_dtype(op, "residual", residual, DType::bf16);
    expect_dtype(op, "topk_weight", topk_weight, DType::f32);
#ifdef __CUDACC__
    return launch_forward(out, residual, y_perm, topk_weight, copy_row, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"out", &out}, {"y_perm", &y_perm}, {"topk_weight", &topk_weight}});
  if (has_residual) expect_same_dtype(op, {{"out", &out}, {"residual", &residual}});
  (void)stream;
  expect_copy_rows(op, copy_row, y_perm.size(0));
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), has_residual ? residual.ptr<T>() : nullptr, y_perm.ptr<T>(), topk_weight.ptr<T>(),
                   copy_row.ptr<int32_t>(), n, k, h);
  });
}

void combine_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, Tensor y_perm, Tensor topk_weight, Tensor copy_row,
                      Stream stream) {
  const char* op = "combine_backward";
  const std::array<int64_t, 3> size = check_combine(op, "dout", dout, "y_perm", y_perm, topk_weight, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2];
  expect_shape(op, "dy_perm", dy_perm, {y_perm.size(0), h});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  if (common_device(op, {{"dout", &dout},
                         {"dy_perm", &dy_perm},
                         {"dtopk_weight", &dtopk_weight},
                         {"y_perm", &y_perm},
                         {"topk_weight", &topk_weight},
                         {"copy_row", &copy_row}}) == Device::cuda) {
    for (auto [name, t] : {std::pair{"dout", &dout}, std::pair{"dy_perm", &dy_perm}, std::pair{"y_perm", &y_perm}})
      expect_dtype(op, name, *t, DType::bf16);
    expect_dtype(op, "topk_weight", topk_weight, DType::f32);
    expect_dtype(op, "dtopk_weight", dtopk_weight, DType::f32);
#ifdef __CUDACC__
    return launch_backward(dy_perm, dtopk_weight, dout, y_perm, topk_weight, copy_row, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"dout", &dout},
                         {"dy_perm", &dy_perm},
                         {"dtopk_weight", &dtopk_weight},
                         {"y_perm", &y_perm},
                         {"topk_weight", &topk_weight}});
  (void)stream;
  expect_copy_rows(op, copy_row, y_perm.size(0));
  with_cpu_scalar(op, dout, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dy_perm.ptr<T>(), dtopk_weight.ptr<T>(), dout.ptr<T>(), y_perm.ptr<T>(), topk_weight.ptr<T>(),
                    copy_row.ptr<int32_t>(), n, k, h);
  });
}

}  // namespace marrow
