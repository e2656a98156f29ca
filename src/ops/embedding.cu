#include "ops/embedding.h"

#include <cstdint>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"

#include <cub/device/device_radix_sort.cuh>
#endif

namespace marrow {

namespace {

// Ids are checked before anything is written: a bad id would otherwise read or write outside the
// table, and a half-written output is harder to reason about than none.
void check_ids(const char* op, const int32_t* ids, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t)
    MARROW_CHECK(0 <= ids[t] && ids[t] < vocab, "{}: id {} at position {} is outside the vocabulary [0, {})", op,
                 ids[t], t, vocab);
}

template <typename T>
void forward_cpu(T* out, const int32_t* ids, const T* table, int64_t n, int64_t h) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = table + int64_t(ids[t]) * h;
    for (int64_t j = 0; j < h; ++j) out[t * h + j] = row[j];
  }
}

template <typename T>
void backward_cpu(T* dtable, const T* dout, const int32_t* ids, int64_t n, int64_t h, int32_t* known_zero) {
  for (int64_t t = 0; t < n; ++t) {
    T* row = dtable + int64_t(ids[t]) * h;
    for (int64_t j = 0; j < h; ++j) row[j] += dout[t * h + j];
    if (known_zero) known_zero[ids[t]] = 0;
  }
}

#ifdef __CUDACC__
// One block per token, its threads over the row in packs of N (8 bf16 = 16 bytes when H % 8 == 0).
// Ids cannot be checked on the host without a sync: an id outside [0, V) gives a NaN row, which
// the loss then shows, instead of a stray read.
template <int N> __global__ void embedding_forward_kernel(bf16* out, const int32_t* ids, const bf16* table, int64_t vocab, int64_t h) {
  using P = Pack<bf16, N>;
  const int64_t t = blockIdx.x, id = ids[t];
  P* dst = reinterpret_cast<P*>(out + t * h);
  for (int64_t c = threadIdx.x; c < h / N; c += blockDim.x) {
    P v;
    if (0 <= id && id < vocab) v = reinterpret_cast<const P*>(table + id * h)[c];
    else
      for (int l = 0; l < N; ++l) v.v[l] = bf16(NAN);
    dst[c] = v;
  }
}

__global__ void embedding_iota_kernel(int32_t* out, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = int32_t(i);
}

// After a stable sort of (id, position) by id, block i handles sorted entry i; only the first entry
// of a run of equal ids does work: its threads, over the row in packs of N, sum the dout rows of the
// run in position order onto dtable's own value -- the CPU reference's order exactly. Each table
// row has a single writer, so there are no atomics and the result is deterministic. A run is read
// kRunBatch entries at a time (their ids and positions, then their dout packs, all loads in flight
// together) and added in order: one entry at a time, a frequent token's run (hundreds of copies of
// a common word in a sequence) was a chain of dependent loads that set the kernel's time. With
// known_zero, a flagged row starts from zero unread (+0.0, the value it holds) and its flag is
// cleared once every thread has read it.
constexpr int kRunBatch = 8;
template <int N>
__global__ void embedding_backward_kernel(float* dtable, const bf16* dout, const int32_t* sorted_ids, const int32_t* sorted_pos, int64_t n,
                                int64_t vocab, int64_t h, int32_t* known_zero) {
  const int64_t i = blockIdx.x;
  const int32_t id = sorted_ids[i];
  if ((i > 0 && sorted_ids[i - 1] == id) || id < 0 || id >= vocab) return;
  const bool zero = known_zero && known_zero[id];
  __syncthreads();
  if (known_zero && threadIdx.x == 0) known_zero[id] = 0;
  for (int64_t c = threadIdx.x; c < h / N; c += blockDim.x) {
    float acc[N];
    Pack<float, N> old;
    if (zero)
      for (int l = 0; l < N; ++l) old.v[l] = 0.0f;
    else old = reinterpret_cast<const Pack<float, N>*>(dtable + id * h)[c];
    for (int l = 0; l < N; ++l) acc[l] = old.v[l];
    for (int64_t j0 = i;; j0 += kRunBatch) {
      bool in_run[kRunBatch];
      Pack<bf16, N> g[kRunBatch];
#pragma unroll
      for (int b = 0; b < kRunBatch; ++b) {
        in_run[b] = j0 + b < n && sorted_ids[j0 + b] == id;  // the run is contiguous: ids are sorted
        if (in_run[b]) g[b] = reinterpret_cast<const Pack<bf16, N>*>(dout + int64_t(sorted_pos[j0 + b]) * h)[c];
      }
#pragma unroll
      for (int b = 0; b < kRunBatch; ++b)
        if (in_run[b])
          for (int l = 0; l < N; ++l) acc[l] += float(g[b].v[l]);
      if (!in_run[kRunBatch - 1]) break;
    }
    Pack<float, N> out;
    for (int l = 0; l < N; ++l) out.v[l] = acc[l];
    reinterpret_cast<Pack<float, N>*>(dtable + id * h)[c] = out;
  }
}

void launch_forward(Tensor out, Tensor ids, Tensor table, Stream stream) {
  const int64_t n = ids.size(0), vocab = table.size(0), h = table.size(1);
  if (n > 0 && h > 0)
    launch_plain(packable(h, {out.data, table.data}) ? embedding_forward_kernel<8> : embedding_forward_kernel<1>, unsigned(n), 128, 0, stream,
                 static_cast<bf16*>(out.data), ids.ptr<int32_t>(), static_cast<bf16*>(table.data), vocab, h);
}

void launch_backward(Tensor dtable, Tensor dout, Tensor ids, Tensor known_zero, Stream stream) {
  const int64_t n = ids.size(0), vocab = dtable.size(0), h = dtable.size(1);
  if (n == 0 || h == 0) return;
  auto s = cuda_stream(stream);
  Buffer pos(DType::i32, Device::cuda, {n}, stream), sorted_ids(DType::i32, Device::cuda, {n}, stream),
      sorted_pos(DType::i32, Device::cuda, {n}, stream);
  launch_plain(embedding_iota_kernel, unsigned((n + 255) / 256), 256, 0, stream, pos.ptr<int32_t>(), n);
  // All 32 key bits: ids outside [0, V) sort into runs of their own, which the kernel skips.
  size_t temp_bytes = 0;
  MARROW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids.ptr<int32_t>(), sorted_ids.ptr<int32_t>(),
                                                    pos.ptr<int32_t>(), sorted_pos.ptr<int32_t>(), int(n), 0, 32, s));
  Buffer temp(DType::i64, Device::cuda, {int64_t(temp_bytes / 8 + 1)}, stream);
  MARROW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.view().data, temp_bytes, ids.ptr<int32_t>(), sorted_ids.ptr<int32_t>(),
                                                    pos.ptr<int32_t>(), sorted_pos.ptr<int32_t>(), int(n), 0, 32, s));
  launch_plain(packable(h, {dtable.data, dout.data}) ? embedding_backward_kernel<8> : embedding_backward_kernel<1>, unsigned(n), 128, 0, stream,
               static_cast<float*>(dtable.data), static_cast<const bf16*>(dout.data), sorted_ids.ptr<int32_t>(), sorted_pos.ptr<int32_t>(), n,
               vocab, h, static_cast<int32_t*>(known_zero.data));
}
#endif

}  // namespace

void embedding_forward(Tensor out, Tensor ids, Tensor table, Stream stream) {
  const char* op = "embedding_forward";
  expect_ndim(op, "ids", ids, 1, "[tokens]");
  expect_ndim(op, "table", table, 2, "[vocab, hidden]");
  const int64_t n = ids.size(0), vocab = table.size(0), h = table.size(1);
  expect_shape(op, "out", out, {n, h});
  expect_dtype(op, "ids", ids, DType::i32);
  if (on_gpu(op, {{"table", &table, DType::bf16}, {"out", &out, DType::bf16}, {"ids", &ids, DType::i32}})) {
    MARROW_CHECK(n < (int64_t(1) << 31), "{}: {} tokens exceed the GPU kernel's i32 grid", op, n);
    MARROW_GPU_RETURN(op, stream, launch_forward(out, ids, table, stream));
  }
  check_ids(op, ids.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, table, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), ids.ptr<int32_t>(), table.ptr<T>(), n, h);
  });
}

void embedding_backward(Tensor dtable, Tensor dout, Tensor ids, Tensor known_zero, Stream stream) {
  const char* op = "embedding_backward";
  expect_ndim(op, "ids", ids, 1, "[tokens]");
  expect_ndim(op, "dtable", dtable, 2, "[vocab, hidden]");
  const int64_t n = ids.size(0), vocab = dtable.size(0), h = dtable.size(1);
  expect_shape(op, "dout", dout, {n, h});
  expect_dtype(op, "ids", ids, DType::i32);
  const bool flagged = known_zero.data != nullptr;
  if (flagged) {
    expect_shape(op, "known_zero", known_zero, {vocab});
    expect_dtype(op, "known_zero", known_zero, DType::i32);
    expect_device(op, "known_zero", known_zero, dtable.device);
  }
  if (on_gpu(op, {{"dtable", &dtable, DType::f32}, {"dout", &dout, DType::bf16}, {"ids", &ids, DType::i32}})) {
    MARROW_CHECK(n < (int64_t(1) << 31), "{}: {} tokens exceed the GPU kernel's i32 grid", op, n);
    MARROW_GPU_RETURN(op, stream, launch_backward(dtable, dout, ids, known_zero, stream));
  }
  check_ids(op, ids.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, dtable, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dtable.ptr<T>(), dout.ptr<T>(), ids.ptr<int32_t>(), n, h, flagged ? known_zero.ptr<int32_t>() : nullptr);
  });
}

}  // namespace marrow
