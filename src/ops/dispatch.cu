#include "ops/dispatch.h"

#include <algorithm>
#include <array>
#include <limits>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"

#include <cub/device/device_radix_sort.cuh>
#endif

namespace marrow {

namespace {

void plan_cpu(int32_t* expert_offsets, int32_t* copy_row, const int32_t* topk_index, int64_t copies, int64_t experts) {
  std::vector<int32_t> next(experts + 1, 0);
  for (int64_t i = 0; i < copies; ++i) ++next[topk_index[i] + 1];
  for (int64_t e = 0; e < experts; ++e) next[e + 1] += next[e];
  for (int64_t e = 0; e <= experts; ++e) expert_offsets[e] = next[e];
  // Copies are visited in (token, slot) order, which is the order within each expert's block.
  for (int64_t i = 0; i < copies; ++i) copy_row[i] = next[topk_index[i]]++;
}

template <typename T>
void forward_cpu(T* x_perm, const T* x, const int32_t* copy_row, int64_t n, int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j)
      if (copy_row[t * k + j] != -1) std::copy(x + t * h, x + (t + 1) * h, x_perm + int64_t(copy_row[t * k + j]) * h);
}

template <typename T>
void backward_cpu(T* dx, const T* dx_perm, const int32_t* copy_row, int64_t n, int64_t k, int64_t h) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j)
        if (copy_row[t * k + j] != -1) sum += dx_perm[int64_t(copy_row[t * k + j]) * h + c];
      dx[t * h + c] = T(sum);
    }
}

// Checks the shapes and dtypes of copy_row[T, K] (i32), tokens[T, H] and rows[R, H]; returns (T, K, H).
std::array<int64_t, 3> check_permute(const char* op, const char* tokens_name, const Tensor& tokens, const char* rows_name,
                                     const Tensor& rows, const Tensor& copy_row) {
  MARROW_CHECK(tokens.ndim == 2, "{}: {} must be [tokens, hidden], got {}", op, tokens_name, tokens.shape_string());
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  MARROW_CHECK(rows.ndim == 2, "{}: {} must be [rows, hidden], got {}", op, rows_name, rows.shape_string());
  const int64_t n = tokens.size(0), h = tokens.size(1), k = copy_row.size(1);
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, rows_name, rows, {rows.size(0), h});
  expect_same_dtype(op, {{tokens_name, &tokens}, {rows_name, &rows}});
  return {n, k, h};
}

// On the GPU the [T, H] and [R, H] tensors are both bf16 or both f32.
void expect_gpu_dtype(const char* op, const char* name, const Tensor& t) {
  MARROW_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32, "{}: on the GPU {} must be bf16 or f32, got {}", op, name,
               dtype_name(t.dtype));
}


#ifdef __CUDACC__
using bf16 = __nv_bfloat16;

// N elements loaded and stored as one piece: 16-byte accesses (two for 8 floats).
template <typename T, int N> struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// The plan is a stable radix sort of the copies (t * K + j) by expert (cub, deterministic). Its keys:
// each copy's expert, an index outside [0, E) replaced by E so that it sorts after every expert (the
// plan's check then finds offsets[E] < copies); so the sort needs only the bits of E (one pass of
// cub's onesweep for E < 256, where all 32 bits took four). Its values: the copy's own index.
__global__ void dispatch_keys_kernel(int32_t* keys, int32_t* copies_ids, const int32_t* topk_index, int64_t copies, int e) {
  begin_after_previous_grid();
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= copies) return;
  const int32_t expert = topk_index[i];
  keys[i] = 0 <= expert && expert < e ? expert : e;
  copies_ids[i] = int32_t(i);
}

// After the sort, one thread per row r: the copy the sort put at row r gets copy_row = r; and one
// thread per expert boundary x in [0, E]: expert_offsets[x] = the number of sorted keys below x, by
// binary search.
__global__ void dispatch_rows_offsets_kernel(int32_t* copy_row, int32_t* offsets, const int32_t* sorted_copies,
                                             const int32_t* sorted_experts, int64_t copies, int e) {
  begin_after_previous_grid();
  const int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (x < copies) copy_row[sorted_copies[x]] = int32_t(x);
  if (x > e) return;
  int64_t lo = 0, hi = copies;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (sorted_experts[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  offsets[x] = int32_t(lo);
}

// One block per token; its threads stride the row in packs of N (8 elements when H % 8 == 0), each
// pack loaded once and stored to the token's rows. Pure copies: nothing to order. An entry of -1
// (copy not here) is skipped, and so is a row outside [0, R) (the GPU path does not check copy_row).
template <typename T, int N>
__global__ void dispatch_forward_kernel(T* x_perm, const T* x, const int32_t* copy_row, int64_t rows, int k, int64_t h) {
  begin_after_previous_grid();
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < h / N; c += blockDim.x) {
    const Pack<T, N> v = reinterpret_cast<const Pack<T, N>*>(x + t * h)[c];
    for (int j = 0; j < k; ++j) {
      const int64_t r = copy_row[t * k + j];
      if (0 <= r && r < rows) reinterpret_cast<Pack<T, N>*>(x_perm + r * h)[c] = v;
    }
  }
}

// One block per token, threads over the row in packs of N; each element sums the rows of its
// entries other than -1 in slot order in f32 (fixed order: deterministic), zeros when there are
// none. Any other row outside [0, R) makes the element NaN.
template <typename T, int N>
__global__ void dispatch_backward_kernel(T* dx, const T* dx_perm, const int32_t* copy_row, int64_t rows, int k, int64_t h) {
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
      const Pack<T, N> v = reinterpret_cast<const Pack<T, N>*>(dx_perm + r * h)[c];
      for (int l = 0; l < N; ++l) acc[l] += float(v.v[l]);
    }
    Pack<T, N> o;
    for (int l = 0; l < N; ++l) o.v[l] = T(acc[l]);
    reinterpret_cast<Pack<T, N>*>(dx + t * h)[c] = o;
  }
}

// Returns whether every expert index was inside [0, E): those outside sort after E - 1.
// Offsets in GPU memory are written there and not read back (no wait for the GPU): true then.
bool launch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream) {
  const int64_t copies = topk_index.numel(), e = expert_offsets.size(0) - 1;
  auto s = static_cast<cudaStream_t>(stream.handle);
  const bool on_device = expert_offsets.device == Device::cuda;
  Buffer host_bound;
  if (!on_device) host_bound = Buffer(DType::i32, Device::cuda, {e + 1}, stream);
  const Tensor offsets = on_device ? expert_offsets : host_bound.view();
  if (copies > 0) {
    Buffer keys(DType::i32, Device::cuda, {copies}, stream), ids(DType::i32, Device::cuda, {copies}, stream),
        sorted_experts(DType::i32, Device::cuda, {copies}, stream), sorted_copies(DType::i32, Device::cuda, {copies}, stream);
    launch_dependent(dispatch_keys_kernel, unsigned((copies + 255) / 256), 256, 0, s, keys.ptr<int32_t>(), ids.ptr<int32_t>(),
                                                                      topk_index.ptr<int32_t>(), copies, int(e));
    MARROW_CUDA_CHECK_LAUNCH();
    int key_bits = 1;  // enough bits for the keys 0..E
    while ((int64_t(1) << key_bits) <= e) ++key_bits;
    size_t temp_bytes = 0;
    MARROW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.ptr<int32_t>(), sorted_experts.ptr<int32_t>(),
                                                      ids.ptr<int32_t>(), sorted_copies.ptr<int32_t>(), int(copies), 0, key_bits, s));
    Buffer temp(DType::i64, Device::cuda, {int64_t(temp_bytes / 8 + 1)}, stream);
    MARROW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.view().data, temp_bytes, keys.ptr<int32_t>(), sorted_experts.ptr<int32_t>(),
                                                      ids.ptr<int32_t>(), sorted_copies.ptr<int32_t>(), int(copies), 0, key_bits, s));
    const int64_t threads = std::max(copies, e + 1);
    launch_dependent(dispatch_rows_offsets_kernel, unsigned((threads + 255) / 256), 256, 0, s, 
        copy_row.ptr<int32_t>(), offsets.ptr<int32_t>(), sorted_copies.ptr<int32_t>(), sorted_experts.ptr<int32_t>(), copies, int(e));
    MARROW_CUDA_CHECK_LAUNCH();
  } else {
    MARROW_CUDA_CHECK(cudaMemsetAsync(offsets.data, 0, offsets.bytes(), s));
  }
  if (on_device) return true;
  copy(expert_offsets, offsets, stream);  // waits for the stream: the offsets are wanted on the host
  const int32_t* host = expert_offsets.ptr<int32_t>();
  return host[0] == 0 && host[e] == copies;
}

// kernel<T, 8> when rows are whole packs and every pointer is 16-byte aligned, else kernel<T, 1>.
// `rows` is R, the row count of the [R, H] side.
template <typename T, typename Kernel8, typename Kernel1>
void launch_permute(Kernel8 kernel8, Kernel1 kernel1, Tensor out, Tensor in, Tensor copy_row, int64_t rows, Stream stream) {
  const int64_t n = copy_row.size(0), k = copy_row.size(1), h = out.size(1);
  if (n == 0 || h == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  auto* o = static_cast<T*>(out.data);
  auto* i = static_cast<const T*>(in.data);
  if (packable(h, {out.data, in.data})) launch_dependent(kernel8, unsigned(n), 128, 0, s, o, i, copy_row.ptr<int32_t>(), rows, int(k), h);
  else launch_dependent(kernel1, unsigned(n), 128, 0, s, o, i, copy_row.ptr<int32_t>(), rows, int(k), h);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

void dispatch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream) {
  const char* op = "dispatch_plan";
  MARROW_CHECK(topk_index.ndim == 2, "{}: topk_index must be [tokens, k], got {}", op, topk_index.shape_string());
  MARROW_CHECK(expert_offsets.ndim == 1 && expert_offsets.size(0) >= 1, "{}: expert_offsets must be [experts + 1], got {}", op,
               expert_offsets.shape_string());
  const int64_t n = topk_index.size(0), k = topk_index.size(1), e = expert_offsets.size(0) - 1;
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "topk_index", topk_index, DType::i32);
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_dtype(op, "expert_offsets", expert_offsets, DType::i32);
  MARROW_CHECK(n * k <= std::numeric_limits<int32_t>::max(), "{}: {} token copies do not fit the i32 row indices", op, n * k);
  if (common_device(op, {{"topk_index", &topk_index}, {"copy_row", &copy_row}}) == Device::cuda) {
#ifdef __CUDACC__
    MARROW_CHECK(launch_plan(expert_offsets, copy_row, topk_index, stream), "{}: topk_index has entries outside [0, {})", op, e);
    return;
#else
    no_cuda_kernel(op);
#endif
  }
  expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
  (void)stream;
  expect_indices_below(op, "topk_index", topk_index, e);
  plan_cpu(expert_offsets.ptr<int32_t>(), copy_row.ptr<int32_t>(), topk_index.ptr<int32_t>(), n * k, e);
}

void expect_copy_rows(const char* op, const Tensor& copy_row, int64_t rows) {
  const int32_t* idx = copy_row.ptr<int32_t>();
  const int64_t k = copy_row.ndim > 1 ? copy_row.size(1) : 1;
  for (int64_t i = 0; i < copy_row.numel(); ++i)
    MARROW_CHECK(idx[i] == -1 || (0 <= idx[i] && idx[i] < rows), "{}: copy_row[{}, {}] = {} is neither -1 nor inside [0, {})", op,
                 i / k, i % k, idx[i], rows);
}

void dispatch_forward(Tensor x_perm, Tensor x, Tensor copy_row, Stream stream) {
  const char* op = "dispatch_forward";
  const std::array<int64_t, 3> size = check_permute(op, "x", x, "x_perm", x_perm, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2], rows = x_perm.size(0);
  if (common_device(op, {{"x", &x}, {"x_perm", &x_perm}, {"copy_row", &copy_row}}) == Device::cuda) {
    expect_gpu_dtype(op, "x", x);
#ifdef __CUDACC__
    if (x.dtype == DType::bf16)
      return launch_permute<bf16>(dispatch_forward_kernel<bf16, 8>, dispatch_forward_kernel<bf16, 1>, x_perm, x, copy_row, rows,
                                  stream);
    return launch_permute<float>(dispatch_forward_kernel<float, 8>, dispatch_forward_kernel<float, 1>, x_perm, x, copy_row, rows,
                                 stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_copy_rows(op, copy_row, rows);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(x_perm.ptr<T>(), x.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

void dispatch_backward(Tensor dx, Tensor dx_perm, Tensor copy_row, Stream stream) {
  const char* op = "dispatch_backward";
  const std::array<int64_t, 3> size = check_permute(op, "dx", dx, "dx_perm", dx_perm, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2], rows = dx_perm.size(0);
  if (common_device(op, {{"dx", &dx}, {"dx_perm", &dx_perm}, {"copy_row", &copy_row}}) == Device::cuda) {
    expect_gpu_dtype(op, "dx", dx);
#ifdef __CUDACC__
    if (dx.dtype == DType::bf16)
      return launch_permute<bf16>(dispatch_backward_kernel<bf16, 8>, dispatch_backward_kernel<bf16, 1>, dx, dx_perm, copy_row,
                                  rows, stream);
    return launch_permute<float>(dispatch_backward_kernel<float, 8>, dispatch_backward_kernel<float, 1>, dx, dx_perm, copy_row,
                                 rows, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_copy_rows(op, copy_row, rows);
  (void)stream;
  with_cpu_scalar(op, dx, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dx_perm.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

}  // namespace marrow
