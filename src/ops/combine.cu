#include "ops/combine.h"

#include <array>
#include <cstdint>

#include "core/cuda_check.h"
#include "ops/common.h"
#include "ops/dispatch.h"

#ifdef __CUDACC__
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

#ifdef __CUDACC__
constexpr int kWarps = 4;  // (token, slot) pairs per block of the backward

// Pack `pack` of a row (indexed by packs: ops/cuda_common.cuh's load and store address otherwise).
template <int N> __device__ Pack<bf16, N> load_pack(const bf16* row, int64_t pack) { return reinterpret_cast<const Pack<bf16, N>*>(row)[pack]; }
template <int N> __device__ void store_pack(bf16* row, int64_t pack, const Pack<bf16, N>& v) { reinterpret_cast<Pack<bf16, N>*>(row)[pack] = v; }


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
      const Pack<bf16, N> y = load_pack<N>(y_perm + r * h, c);
      for (int l = 0; l < N; ++l) acc[l] += w * float(y.v[l]);
    }
    Pack<bf16, N> o;
    if (residual) {
      const Pack<bf16, N> res = load_pack<N>(residual + t * h, c);
      for (int l = 0; l < N; ++l) o.v[l] = bf16(float(res.v[l]) + acc[l]);
    } else {
      for (int l = 0; l < N; ++l) o.v[l] = bf16(acc[l]);
    }
    store_pack<N>(out + t * h, c, o);
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
    const Pack<bf16, N> g = load_pack<N>(dout + t * h, c), y = load_pack<N>(y_perm + r * h, c);
    Pack<bf16, N> o;
    for (int l = 0; l < N; ++l) {
      dot += float(g.v[l]) * float(y.v[l]);
      o.v[l] = bf16(w * float(g.v[l]));
    }
    store_pack<N>(dy_perm + r * h, c, o);
  }
  dot = warp_sum(dot);
  if (lane == 0) dtopk_weight[copy] = dot;
}

void launch_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const int64_t n = copy_row.size(0), k = copy_row.size(1), h = out.size(1);
  if (n == 0 || h == 0) return;
  // A null residual (none) passes packable's alignment test.
  launch_dependent(packable(h, {out.data, residual.data, y_perm.data}) ? combine_forward_kernel<8> : combine_forward_kernel<1>, unsigned(n),
                   128, 0, stream, static_cast<bf16*>(out.data), static_cast<const bf16*>(residual.data),
                   static_cast<const bf16*>(y_perm.data), topk_weight.ptr<float>(), copy_row.ptr<int32_t>(), y_perm.size(0), int(k), h);
}

void launch_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const int64_t n = copy_row.size(0), k = copy_row.size(1), h = dout.size(1);
  if (n * k == 0) return;
  launch_dependent(packable(h, {dy_perm.data, dout.data, y_perm.data}) ? combine_backward_kernel<8> : combine_backward_kernel<1>,
                   unsigned((n * k + kWarps - 1) / kWarps), 32 * kWarps, 0, stream, static_cast<bf16*>(dy_perm.data), dtopk_weight.ptr<float>(),
                   static_cast<const bf16*>(dout.data), static_cast<const bf16*>(y_perm.data), topk_weight.ptr<float>(),
                   copy_row.ptr<int32_t>(), n, int(k), y_perm.size(0), h);
}
#endif

}  // namespace

void combine_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream) {
  const char* op = "combine_forward";
  const std::array<int64_t, 3> size = check_token_rows(op, "out", out, "y_perm", y_perm, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2];
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  const bool has_residual = residual.ndim != 0 || residual.data != nullptr;  // Tensor{}: no residual
  if (has_residual) expect_shape(op, "residual", residual, {n, h});
  const bool gpu = on_gpu(op, {{"out", &out, DType::bf16}, {"y_perm", &y_perm, DType::bf16}, {"topk_weight", &topk_weight, DType::f32},
                               {"copy_row", &copy_row, DType::i32}});
  if (has_residual) on_gpu(op, {{"out", &out, DType::bf16}, {"residual", &residual, DType::bf16}});
  if (gpu) MARROW_GPU_RETURN(op, stream, launch_forward(out, residual, y_perm, topk_weight, copy_row, stream));
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
  const std::array<int64_t, 3> size = check_token_rows(op, "dout", dout, "y_perm", y_perm, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2];
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_shape(op, "dy_perm", dy_perm, {y_perm.size(0), h});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  if (on_gpu(op, {{"dout", &dout, DType::bf16}, {"dy_perm", &dy_perm, DType::bf16}, {"dtopk_weight", &dtopk_weight, DType::f32},
                  {"y_perm", &y_perm, DType::bf16}, {"topk_weight", &topk_weight, DType::f32}, {"copy_row", &copy_row, DType::i32}}))
    MARROW_GPU_RETURN(op, stream, launch_backward(dy_perm, dtopk_weight, dout, y_perm, topk_weight, copy_row, stream));
  expect_copy_rows(op, copy_row, y_perm.size(0));
  with_cpu_scalar(op, dout, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dy_perm.ptr<T>(), dtopk_weight.ptr<T>(), dout.ptr<T>(), y_perm.ptr<T>(), topk_weight.ptr<T>(),
                    copy_row.ptr<int32_t>(), n, k, h);
  });
}

}  // namespace marrow
