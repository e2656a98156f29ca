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
#include "ops/cuda_common.cuh"

#include <cub/block/block_scan.cuh>
#endif

namespace marrow {

namespace {

void plan_cpu(int32_t* expert_offsets, int32_t* copy_row, const int32_t* topk_index, int64_t copies, int64_t experts) {
  std::vector<int32_t> next(experts + 1, 0);
  for (int64_t i = 0; i < copies; ++i)
    if (topk_index[i] >= 0) ++next[topk_index[i] + 1];
  for (int64_t e = 0; e < experts; ++e) next[e + 1] += next[e];
  for (int64_t e = 0; e <= experts; ++e) expert_offsets[e] = next[e];
  // Copies are visited in (token, slot) order, which is the order within each expert's block.
  for (int64_t i = 0; i < copies; ++i) copy_row[i] = topk_index[i] >= 0 ? next[topk_index[i]]++ : -1;
}

// Every entry of topk_index (read as rows of k) -1 (not here) or an expert in [0, experts).
void expect_plan_indices(const char* op, const Tensor& topk_index, int64_t k, int64_t experts) {
  const int32_t* idx = topk_index.ptr<int32_t>();
  for (int64_t i = 0; i < topk_index.numel(); ++i)
    MARROW_CHECK(-1 <= idx[i] && idx[i] < experts, "{}: topk_index[{}, {}] = {} is neither -1 nor inside [0, {})", op, i / k, i % k, idx[i],
                 experts);
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

// On the GPU the [T, H] and [R, H] tensors are both bf16 or both f32.
void expect_gpu_dtype(const char* op, const char* name, const Tensor& t) {
  MARROW_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32, "{}: on the GPU {} must be bf16 or f32, got {}", op, name, dtype_name(t.dtype));
}

#ifdef __CUDACC__
// The plan on the GPU: a stable counting sort of the copies (t * K + j) by bucket in one block, the
// bucket of a copy its expert, or E for an index outside [0, E) (-1: not here), which gets
// copy_row -1 and no row, so offsets[E] counts the copies that are here. Warp w takes the w-th of kPlanWarps contiguous
// runs of copies, 32 at a time in copy order: lanes of equal bucket find each other
// (__match_any_sync), so a copy's rank among its warp's copies of its bucket is the count before
// the round plus its lower peers. Then the start of (warp w, bucket b) is the copies of buckets
// below b plus those of bucket b in warps below w, and a copy's row is its start plus its rank.
// One kernel replaces cub's onesweep sort (six launches and memsets, ~27 us a bench layer).
constexpr int kPlanThreads = 1024, kPlanWarps = kPlanThreads / 32, kPlanAhead = 8;
constexpr int kMaxPlanBuckets = kPlanThreads;  // one scanning thread per bucket

__device__ __forceinline__ int plan_bucket(int32_t expert, int e) { return 0 <= expert && expert < e ? expert : e; }

// Pass 1 over warp w's run [begin, end) of copies: copy_row = the copy's rank among the run's copies
// of its bucket; mine (the warp's row of counts) ends as the run's count of each bucket.
__device__ void rank_in_run(int32_t* __restrict__ copy_row, int32_t* mine, const int32_t* __restrict__ topk_index, int begin, int end,
                            int e) {
  const int lane = int(threadIdx.x) % 32;
  for (int base = begin; base < end; base += 32 * kPlanAhead) {
    int bucket[kPlanAhead];  // loads of kPlanAhead rounds in flight before the first is used
#pragma unroll
    for (int r = 0; r < kPlanAhead; ++r) {
      const int i = base + 32 * r + lane;
      bucket[r] = i < end ? plan_bucket(topk_index[i], e) : -1;
    }
#pragma unroll
    for (int r = 0; r < kPlanAhead; ++r) {
      const int i = base + 32 * r + lane;
      const unsigned peers = __match_any_sync(~0u, bucket[r]);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int before = i < end ? mine[bucket[r]] : 0;
      __syncwarp();
      if (i < end && rank == 0) mine[bucket[r]] = before + __popc(peers);
      __syncwarp();
      if (i < end) copy_row[i] = before + rank;
    }
  }
}

// counts[w][b] (kPlanWarps rows of `buckets`) from warp w's copies of bucket b to the first row of
// them: the copies of buckets below b plus those of bucket b in warps below w. offsets[b] = the
// first row of bucket b. Thread b takes bucket b's column; a block scan orders the buckets.
template <typename Scan>
__device__ void bucket_starts(int32_t* counts, int32_t* __restrict__ offsets, int buckets, typename Scan::TempStorage& scan_storage) {
  int total = 0;
  if (int(threadIdx.x) < buckets)
    for (int w = 0; w < kPlanWarps; ++w) {
      const int c = counts[w * buckets + threadIdx.x];
      counts[w * buckets + threadIdx.x] = total;
      total += c;
    }
  int start = 0;
  Scan(scan_storage).ExclusiveSum(total, start);
  if (int(threadIdx.x) < buckets) {
    offsets[threadIdx.x] = start;
    for (int w = 0; w < kPlanWarps; ++w) counts[w * buckets + threadIdx.x] += start;
  }
}

// Pass 2 over the same run: copy_row += the first row of the copy's (warp, bucket), both loads of
// kPlanAhead rounds in flight first.
__device__ void add_starts(int32_t* __restrict__ copy_row, const int32_t* mine, const int32_t* __restrict__ topk_index, int begin, int end,
                           int e) {
  const int lane = int(threadIdx.x) % 32;
  for (int base = begin; base < end; base += 32 * kPlanAhead) {
    int bucket[kPlanAhead], rank[kPlanAhead];
#pragma unroll
    for (int r = 0; r < kPlanAhead; ++r) {
      const int i = base + 32 * r + lane;
      bucket[r] = i < end ? plan_bucket(topk_index[i], e) : 0;
      rank[r] = i < end ? copy_row[i] : 0;
    }
#pragma unroll
    for (int r = 0; r < kPlanAhead; ++r) {
      const int i = base + 32 * r + lane;
      if (i < end) copy_row[i] = bucket[r] == e ? -1 : mine[bucket[r]] + rank[r];
    }
  }
}

// counts: kPlanWarps x (E + 1) ints of dynamic shared memory, warp w's row first counting its copies
// of each bucket, then holding where they start.
__global__ void __launch_bounds__(kPlanThreads)
    dispatch_plan_kernel(int32_t* __restrict__ copy_row, int32_t* __restrict__ offsets, const int32_t* __restrict__ topk_index, int copies,
                         int e) {
  extern __shared__ int32_t counts[];
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  begin_after_previous_grid();
  const int buckets = e + 1, warp = int(threadIdx.x) / 32;
  for (int i = int(threadIdx.x); i < kPlanWarps * buckets; i += kPlanThreads) counts[i] = 0;
  __syncthreads();
  const int64_t run = (int64_t(copies) + kPlanWarps * 32 - 1) / (kPlanWarps * 32) * 32;
  const int begin = int(std::min<int64_t>(copies, warp * run)), end = int(std::min<int64_t>(copies, warp * run + run));
  int32_t* mine = counts + warp * buckets;
  rank_in_run(copy_row, mine, topk_index, begin, end, e);
  __syncthreads();
  bucket_starts<Scan>(counts, offsets, buckets, scan_storage);
  __syncthreads();
  add_starts(copy_row, mine, topk_index, begin, end, e);
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

// Offsets in GPU memory are written there and not read back (no wait for the GPU); offsets on the
// host wait for the stream, and the indices are checked there.
void launch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream) {
  const int64_t copies = topk_index.numel(), e = expert_offsets.size(0) - 1;
  const bool on_device = expert_offsets.device == Device::cuda;
  Buffer host_bound;
  if (!on_device) host_bound = Buffer(DType::i32, Device::cuda, {e + 1}, stream);
  const Tensor offsets = on_device ? expert_offsets : host_bound.view();
  if (copies > 0) {
    MARROW_CHECK(e + 1 <= kMaxPlanBuckets, "dispatch_plan: the GPU plan serves at most {} experts, got {}", kMaxPlanBuckets - 1, e);
    static const bool allowed = [] {  // the most any E takes
      MARROW_CUDA_CHECK(cudaFuncSetAttribute(dispatch_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(kPlanWarps * kMaxPlanBuckets * sizeof(int32_t))));
      return true;
    }();
    (void)allowed;
    const int smem = int(kPlanWarps * (e + 1) * sizeof(int32_t));
    launch_dependent(dispatch_plan_kernel, 1, kPlanThreads, size_t(smem), stream, copy_row.ptr<int32_t>(), offsets.ptr<int32_t>(),
                     topk_index.ptr<int32_t>(), int(copies), int(e));
  } else {
    MARROW_CUDA_CHECK(cudaMemsetAsync(offsets.data, 0, offsets.bytes(), cuda_stream(stream)));
  }
  if (on_device) return;
  copy(expert_offsets, offsets, stream);  // waits for the stream: the offsets are wanted on the host
  expect_plan_indices("dispatch_plan", to_host(topk_index, stream), topk_index.size(1), e);
}

// kernel8 (T, 8) when rows are whole packs and every pointer is 16-byte aligned, else kernel1 (T, 1);
// `rows` is R, the row count of the [R, H] side.
template <typename T, typename Kernel>
void launch_permute(Kernel kernel8, Kernel kernel1, Tensor out, Tensor in, Tensor copy_row, int64_t rows, Stream stream) {
  const int64_t n = copy_row.size(0), k = copy_row.size(1), h = out.size(1);
  if (n > 0 && h > 0)
    launch_dependent(packable(h, {out.data, in.data}) ? kernel8 : kernel1, unsigned(n), 128, 0, stream, static_cast<T*>(out.data),
                     static_cast<const T*>(in.data), copy_row.ptr<int32_t>(), rows, int(k), h);
}
template <typename T> void launch_forward(Tensor x_perm, Tensor x, Tensor copy_row, Stream stream) {
  launch_permute<T>(dispatch_forward_kernel<T, 8>, dispatch_forward_kernel<T, 1>, x_perm, x, copy_row, x_perm.size(0), stream);
}
template <typename T> void launch_backward(Tensor dx, Tensor dx_perm, Tensor copy_row, Stream stream) {
  launch_permute<T>(dispatch_backward_kernel<T, 8>, dispatch_backward_kernel<T, 1>, dx, dx_perm, copy_row, dx_perm.size(0), stream);
}
#endif

}  // namespace

void dispatch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream) {
  const char* op = "dispatch_plan";
  expect_ndim(op, "topk_index", topk_index, 2, "[tokens, k]");
  MARROW_CHECK(expert_offsets.ndim == 1 && expert_offsets.size(0) >= 1, "{}: expert_offsets must be [experts + 1], got {}", op,
               expert_offsets.shape_string());
  const int64_t n = topk_index.size(0), k = topk_index.size(1), e = expert_offsets.size(0) - 1;
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "topk_index", topk_index, DType::i32);
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_dtype(op, "expert_offsets", expert_offsets, DType::i32);
  MARROW_CHECK(n * k <= std::numeric_limits<int32_t>::max(), "{}: {} token copies do not fit the i32 row indices", op, n * k);
  if (common_device(op, {{"topk_index", &topk_index}, {"copy_row", &copy_row}}) == Device::cuda)
    MARROW_GPU_RETURN(op, stream, launch_plan(expert_offsets, copy_row, topk_index, stream));
  expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
  expect_plan_indices(op, topk_index, k, e);
  plan_cpu(expert_offsets.ptr<int32_t>(), copy_row.ptr<int32_t>(), topk_index.ptr<int32_t>(), n * k, e);
}

std::array<int64_t, 3> check_token_rows(const char* op, const char* tokens_name, const Tensor& tokens, const char* rows_name,
                                        const Tensor& rows, const Tensor& copy_row) {
  expect_ndim(op, tokens_name, tokens, 2, "[tokens, hidden]");
  expect_ndim(op, "copy_row", copy_row, 2, "[tokens, k]");
  expect_ndim(op, rows_name, rows, 2, "[rows, hidden]");
  const int64_t n = tokens.size(0), h = tokens.size(1), k = copy_row.size(1);
  expect_shape(op, "copy_row", copy_row, {n, k});
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, rows_name, rows, {rows.size(0), h});
  return {n, k, h};
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
  const std::array<int64_t, 3> size = check_token_rows(op, "x", x, "x_perm", x_perm, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2], rows = x_perm.size(0);
  expect_same_dtype(op, {{"x", &x}, {"x_perm", &x_perm}});
  if (common_device(op, {{"x", &x}, {"x_perm", &x_perm}, {"copy_row", &copy_row}}) == Device::cuda) {
    expect_gpu_dtype(op, "x", x);
    MARROW_GPU_RETURN(op, stream, x.dtype == DType::bf16 ? launch_forward<bf16>(x_perm, x, copy_row, stream)
                                                         : launch_forward<float>(x_perm, x, copy_row, stream));
  }
  expect_copy_rows(op, copy_row, rows);
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(x_perm.ptr<T>(), x.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

void dispatch_backward(Tensor dx, Tensor dx_perm, Tensor copy_row, Stream stream) {
  const char* op = "dispatch_backward";
  const std::array<int64_t, 3> size = check_token_rows(op, "dx", dx, "dx_perm", dx_perm, copy_row);
  const int64_t n = size[0], k = size[1], h = size[2], rows = dx_perm.size(0);
  expect_same_dtype(op, {{"dx", &dx}, {"dx_perm", &dx_perm}});
  if (common_device(op, {{"dx", &dx}, {"dx_perm", &dx_perm}, {"copy_row", &copy_row}}) == Device::cuda) {
    expect_gpu_dtype(op, "dx", dx);
    MARROW_GPU_RETURN(op, stream, dx.dtype == DType::bf16 ? launch_backward<bf16>(dx, dx_perm, copy_row, stream)
                                                          : launch_backward<float>(dx, dx_perm, copy_row, stream));
  }
  expect_copy_rows(op, copy_row, rows);
  with_cpu_scalar(op, dx, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dx_perm.ptr<T>(), copy_row.ptr<int32_t>(), n, k, h);
  });
}

}  // namespace marrow
