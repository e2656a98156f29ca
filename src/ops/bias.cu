#include "ops/bias.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"
#include "ops/dispatch.h"
#include "ops/grouped_linear.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

// Columns one thread of the backward sums at a time: its double sums stay in L1 while it walks the rows.
constexpr int64_t kColumnBlock = 256;

// Rows [r0, r1) of y [., O] += bias [O]; rows are independent, so threads split them.
template <typename T> void add_rows_cpu(T* y, const T* bias, int64_t r0, int64_t r1, int64_t o) {
#pragma omp parallel for schedule(static) if ((r1 - r0) * o > kParallelWork)
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < o; ++c) y[r * o + c] += bias[c];
}

// dbias [O] (+)= the sum of rows [r0, r1) of dy [., O], in double, each column in row order. Threads
// split the columns, never the rows, so the bits do not depend on the thread count.
template <typename T>
void sum_rows_cpu(T* dbias, const T* dy, int64_t r0, int64_t r1, int64_t o, bool overwrite, const T* row_scale = nullptr) {
#pragma omp parallel if ((r1 - r0) * o > kParallelWork)
  {
    std::vector<double> sum(kColumnBlock);
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < o; c0 += kColumnBlock) {
      const int64_t width = std::min(kColumnBlock, o - c0);
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < width; ++c) sum[c] += row_scale ? double(row_scale[r]) * dy[r * o + c0 + c] : double(dy[r * o + c0 + c]);
      for (int64_t c = 0; c < width; ++c) dbias[c0 + c] = overwrite ? T(sum[c]) : T(dbias[c0 + c] + sum[c]);
    }
  }
}

// bias_forward's and bias_backward's shape checks of the rows [N, O] and the bias [O].
void check_plain(const char* op, const char* rows_name, const Tensor& rows, const char* bias_name, const Tensor& bias) {
  expect_ndim(op, rows_name, rows, 2, "[rows, out]");
  expect_shape(op, bias_name, bias, {rows.size(1)});
}

// The grouped ops' shape checks of the rows [R, O], the bias [E, O] and expert_offsets [E + 1]
// (grouped_linear's: those on the host must split the R rows).
void check_grouped(const char* op, const char* rows_name, const Tensor& rows, const char* bias_name, const Tensor& bias,
                   const Tensor& expert_offsets) {
  expect_ndim(op, rows_name, rows, 2, "[rows, out]");
  expect_ndim(op, bias_name, bias, 2, "[experts, out]");
  expect_shape(op, bias_name, bias, {bias.size(0), rows.size(1)});
  check_expert_offsets(op, expert_offsets, bias.size(0), rows.size(0));
}

// The CPU reference's walk over the experts: f(T{}, g, r0, r1) for every expert g and its rows
// [r0, r1) in turn (expert_offsets on the host), T the CPU scalar type of rows.
template <typename F> void for_each_expert_cpu(const char* op, const Tensor& rows, const Tensor& expert_offsets, F&& f) {
  expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
  const int32_t* offsets = expert_offsets.ptr<int32_t>();
  with_cpu_scalar(op, rows, [&](auto s) {
    for (int64_t g = 0; g + 1 < expert_offsets.numel(); ++g) f(s, g, int64_t(offsets[g]), int64_t(offsets[g + 1]));
  });
}

#ifdef __CUDACC__
// ---------------------------------------------------------------------------------------------
// GPU: bf16 rows and biases, f32 gradients, math in f32. The expert offsets are grouped_linear's,
// read in GPU memory (uploaded in stream order when on the host), so nothing waits for the GPU.
// Offsets in GPU memory are not checked (that would wait): rows outside [offsets[0], offsets[E])
// belong to no expert.
constexpr int kThreads = 256;              // the forward's block: one row at a time
constexpr int64_t kMaxRowBlocks = 16384;   // the forward's grid; its blocks stride over the rows
constexpr int kColumns = 32, kSlices = 16;  // the backward's block: 32 columns x 16 slices of the rows
constexpr int kDotWarps = 4;               // dot_add's block: one copy a warp

// The expert of row r: the last g with offsets[g] <= r (which skips empty experts), or -1 for a row
// outside [offsets[0], offsets[E]).
__device__ int expert_of_row(const int32_t* offsets, int experts, int64_t r) {
  if (r < offsets[0] || r >= offsets[experts]) return -1;
  int lo = 0, hi = experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid;
  }
  return lo;
}

// y[r, :] += bias[e, :] in f32, rounded to bf16 once, e the expert of row r (offsets null: e = 0
// for every row, bias_forward). One block per row, grid-stride over the rows; its threads take the
// row's packs of N columns (N = 8 when O % 8 == 0 and y, bias are 16-byte aligned, else 1). Rows of
// no expert are left alone. Elementwise: nothing to order.
template <int N>
__global__ void bias_add_kernel(bf16* y, const bf16* bias, const int32_t* offsets, int experts, int64_t rows, int64_t cols) {
  begin_after_previous_grid();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int e = offsets ? expert_of_row(offsets, experts, r) : 0;
    if (e < 0) continue;
    for (int64_t c = int64_t(threadIdx.x) * N; c < cols; c += int64_t(blockDim.x) * N) {
      Pack<bf16, N> out = load<N>(y + r * cols + c);
      const Pack<bf16, N> b = load<N>(bias + int64_t(e) * cols + c);
#pragma unroll
      for (int l = 0; l < N; ++l) out.v[l] = __float2bfloat16(__bfloat162float(out.v[l]) + __bfloat162float(b.v[l]));
      store<N>(y + r * cols + c, out);
    }
  }
}

// y[r, :] += bias in f32 for y f32 (the router's logits): one thread per element, grid-stride.
__global__ void bias_add_f32_kernel(float* y, const bf16* bias, int64_t rows, int64_t cols) {
  begin_after_previous_grid();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += __bfloat162float(bias[i % cols]);
}

// dbias[e, c] (+)= sum over expert e's rows r of w_r dy[r, c] (w_r = row_scale[r], or 1) for the
// kColumns columns c of blockIdx.x and the expert e = blockIdx.y (offsets null: every row, one
// expert). Thread (x, y) sums rows begin + y, begin + y + kSlices, ... of its column in row order
// (one fma each: the product w_r dy exact, as the CPU's double one); after the barrier the slice-0
// thread adds the kSlices partials in slice order. The order of every addition is fixed by the
// shape alone: deterministic, no atomics. An expert without rows writes zeros when overwriting and
// is left alone when accumulating (the CPU reference's rule).
__global__ void bias_sum_kernel(float* dbias, const bf16* dy, const float* row_scale, const int32_t* offsets, int64_t rows, int64_t cols,
                                bool overwrite) {
  begin_after_previous_grid();
  const int e = blockIdx.y;
  const int64_t begin = offsets ? offsets[e] : 0, end = offsets ? offsets[e + 1] : rows;
  if (begin == end && !overwrite) return;  // the same for the whole block: before its barrier
  const int64_t c = int64_t(blockIdx.x) * kColumns + threadIdx.x;
  float sum = 0;
  if (c < cols)
    for (int64_t r = begin + threadIdx.y; r < end; r += kSlices)
      sum = fmaf(row_scale ? row_scale[r] : 1.0f, __bfloat162float(dy[r * cols + c]), sum);
  __shared__ float partial[kSlices][kColumns];
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float total = 0;
  for (int s = 0; s < kSlices; ++s) total += partial[s][threadIdx.x];
  float* out = dbias + int64_t(e) * cols + c;
  *out = overwrite ? total : *out + total;
}

// dtopk_weight[i] += dot(dy[r], bias[e]) for r = copy_row[i] (-1: left alone) and e its expert: one
// warp per copy, lane l summing columns l, l + 32, ... in order, then warp_sum's fixed butterfly:
// deterministic. A row outside [0, R) or of no expert (neither copy_row nor offsets in GPU memory
// are checked) gets NaN.
__global__ void bias_dot_add_kernel(float* dtopk_weight, const bf16* dy, const bf16* bias, const int32_t* offsets, const int32_t* copy_row,
                                    int experts, int64_t copies, int64_t rows, int64_t cols) {
  begin_after_previous_grid();
  const int64_t i = int64_t(blockIdx.x) * kDotWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= copies) return;
  const int64_t r = copy_row[i];
  if (r == -1) return;
  const int e = 0 <= r && r < rows ? expert_of_row(offsets, experts, r) : -1;
  if (e < 0) {
    if (lane == 0) dtopk_weight[i] = NAN;
    return;
  }
  float dot = 0;
  for (int64_t c = lane; c < cols; c += 32)
    dot = fmaf(__bfloat162float(dy[r * cols + c]), __bfloat162float(bias[int64_t(e) * cols + c]), dot);
  dot = warp_sum(dot);
  if (lane == 0) dtopk_weight[i] += dot;
}

// The offsets in GPU memory, or null for the plain ops (no expert_offsets).
const int32_t* gpu_offsets(const Tensor& expert_offsets, Buffer& holder, Stream stream) {
  return expert_offsets.data ? expert_offsets_on_device(expert_offsets, holder, stream) : nullptr;
}

// bias [O] (expert_offsets empty) or [E, O]; y bf16, or f32 with a plain bias.
void add_rows_gpu(Tensor y, Tensor bias, Tensor expert_offsets, Stream stream) {
  const int64_t rows = y.size(0), cols = y.size(1);
  if (rows == 0 || cols == 0) return;
  if (y.dtype == DType::f32)
    return launch_dependent(bias_add_f32_kernel, grid_stride_blocks(rows * cols, kThreads, kMaxRowBlocks), kThreads, 0, stream, y.ptr<float>(),
                            static_cast<const bf16*>(bias.data), rows, cols);
  Buffer holder;
  launch_dependent(packable(cols, {y.data, bias.data}) ? bias_add_kernel<8> : bias_add_kernel<1>, unsigned(std::min(rows, kMaxRowBlocks)),
                   kThreads, 0, stream, static_cast<bf16*>(y.data), static_cast<const bf16*>(bias.data), gpu_offsets(expert_offsets, holder, stream),
                   bias.ndim == 2 ? int(bias.size(0)) : 1, rows, cols);
}

// dbias [O] (expert_offsets empty) or [E, O]; row_scale empty or [R].
void sum_rows_gpu(const char* op, Tensor dbias, Tensor dy, Tensor expert_offsets, bool overwrite, Tensor row_scale, Stream stream) {
  const int64_t rows = dy.size(0), cols = dy.size(1), experts = dbias.ndim == 2 ? dbias.size(0) : 1;
  MARROW_CHECK(experts <= 65535, "{}: the GPU kernel takes at most 65535 experts (a grid's y), got {}", op, experts);
  if (cols == 0 || experts == 0) return;
  Buffer holder;
  const int32_t* offsets = gpu_offsets(expert_offsets, holder, stream);
  const dim3 grid(unsigned((cols + kColumns - 1) / kColumns), unsigned(experts)), block(kColumns, kSlices);
  launch_dependent(bias_sum_kernel, grid, block, 0, stream, static_cast<float*>(dbias.data), static_cast<const bf16*>(dy.data),
                   row_scale.data ? static_cast<const float*>(row_scale.data) : nullptr, offsets, rows, cols, overwrite);
}

void dot_add_gpu(Tensor dtopk_weight, Tensor dy, Tensor bias, Tensor expert_offsets, Tensor copy_row, Stream stream) {
  const int64_t copies = copy_row.numel();
  if (copies == 0) return;
  Buffer holder;
  launch_dependent(bias_dot_add_kernel, unsigned((copies + kDotWarps - 1) / kDotWarps), kDotWarps * 32, 0, stream,
                   static_cast<float*>(dtopk_weight.data), static_cast<const bf16*>(dy.data), static_cast<const bf16*>(bias.data),
                   gpu_offsets(expert_offsets, holder, stream), copy_row.ptr<int32_t>(), int(bias.size(0)), copies, dy.size(0), dy.size(1));
}
#endif

}  // namespace

void bias_forward(Tensor y, Tensor bias, Stream stream) {
  const char* op = "bias_forward";
  check_plain(op, "y", y, "bias", bias);
  // On the GPU y is bf16, or f32 (the router's logits).
  if (on_gpu(op, {{"y", &y, y.dtype == DType::f32 ? DType::f32 : DType::bf16}, {"bias", &bias, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, add_rows_gpu(y, bias, Tensor{}, stream));
  with_cpu_scalar(op, y, [&](auto s) { using T = decltype(s); add_rows_cpu<T>(y.ptr<T>(), bias.ptr<T>(), 0, y.size(0), y.size(1)); });
}

void bias_backward(Tensor dbias, Tensor dy, bool overwrite, Stream stream) {
  const char* op = "bias_backward";
  check_plain(op, "dy", dy, "dbias", dbias);
  if (on_gpu(op, {{"dy", &dy, DType::bf16}, {"dbias", &dbias, DType::f32}}))
    MARROW_GPU_RETURN(op, stream, sum_rows_gpu(op, dbias, dy, Tensor{}, overwrite, Tensor{}, stream));
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    sum_rows_cpu<T>(dbias.ptr<T>(), dy.ptr<T>(), 0, dy.size(0), dy.size(1), overwrite);
  });
}

void grouped_bias_forward(Tensor y, Tensor bias, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_bias_forward";
  check_grouped(op, "y", y, "bias", bias, expert_offsets);
  if (on_gpu(op, {{"y", &y, DType::bf16}, {"bias", &bias, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, add_rows_gpu(y, bias, expert_offsets, stream));
  for_each_expert_cpu(op, y, expert_offsets, [&](auto s, int64_t g, int64_t r0, int64_t r1) {
    using T = decltype(s);
    add_rows_cpu<T>(y.ptr<T>(), bias.ptr<T>() + g * y.size(1), r0, r1, y.size(1));
  });
}

void grouped_bias_backward(Tensor dbias, Tensor dy, Tensor expert_offsets, bool overwrite, Tensor row_scale, Stream stream) {
  const char* op = "grouped_bias_backward";
  check_grouped(op, "dy", dy, "dbias", dbias, expert_offsets);
  const bool gpu = on_gpu(op, {{"dy", &dy, DType::bf16}, {"dbias", &dbias, DType::f32}});
  if (row_scale.data) {
    expect_shape(op, "row_scale", row_scale, {dy.size(0)});
    on_gpu(op, {{"dy", &dy, DType::bf16}, {"row_scale", &row_scale, DType::f32}});
  }
  if (gpu) MARROW_GPU_RETURN(op, stream, sum_rows_gpu(op, dbias, dy, expert_offsets, overwrite, row_scale, stream));
  for_each_expert_cpu(op, dy, expert_offsets, [&](auto s, int64_t g, int64_t r0, int64_t r1) {
    using T = decltype(s);
    const T* scale = row_scale.data ? row_scale.ptr<T>() : nullptr;
    if (overwrite || r1 > r0) sum_rows_cpu<T>(dbias.ptr<T>() + g * dy.size(1), dy.ptr<T>(), r0, r1, dy.size(1), overwrite, scale);
  });
}

void grouped_bias_dot_add(Tensor dtopk_weight, Tensor dy, Tensor bias, Tensor expert_offsets, Tensor copy_row, Stream stream) {
  const char* op = "grouped_bias_dot_add";
  expect_ndim(op, "copy_row", copy_row, 2, "[tokens, k]");
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "dtopk_weight", dtopk_weight, {copy_row.size(0), copy_row.size(1)});
  check_grouped(op, "dy", dy, "bias", bias, expert_offsets);
  const bool gpu = on_gpu(op, {{"dy", &dy, DType::bf16}, {"bias", &bias, DType::bf16}, {"dtopk_weight", &dtopk_weight, DType::f32}});
  expect_device(op, "copy_row", copy_row, dy.device);
  if (gpu) MARROW_GPU_RETURN(op, stream, dot_add_gpu(dtopk_weight, dy, bias, expert_offsets, copy_row, stream));
  expect_copy_rows(op, copy_row, dy.size(0));
  std::vector<int64_t> expert_of(size_t(dy.size(0)));
  for_each_expert_cpu(op, dy, expert_offsets, [&](auto, int64_t g, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) expert_of[size_t(r)] = g;
  });
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    const int64_t o = dy.size(1);
    const int32_t* rows = copy_row.ptr<int32_t>();
    T* d = dtopk_weight.ptr<T>();
    for (int64_t c = 0; c < copy_row.numel(); ++c) {
      if (rows[c] < 0) continue;
      const T *y = dy.ptr<T>() + rows[c] * o, *b = bias.ptr<T>() + expert_of[size_t(rows[c])] * o;
      double dot = 0;
      for (int64_t i = 0; i < o; ++i) dot += double(y[i]) * b[i];
      d[c] = T(d[c] + dot);
    }
  });
}

}  // namespace marrow
