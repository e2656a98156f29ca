#include "ops/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

#ifdef __CUDACC__
// A fixed partition, independent of the GPU: block b's threads take elements (or float4s) in a
// grid-stride loop, so which element lands in which partial sum depends only on n.
constexpr int kBlocks = int(kSumParts), kThreads = 256;

// The block's sum of the threads' acc in a fixed tree (butterfly in each warp, then warp 0 over
// the warps) into parts[block].
__device__ void store_block_sum(double* parts, double acc) {
  __shared__ double warp_sums[kThreads / 32];
  acc = warp_sum(acc);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int w = 0; w < kThreads / 32; ++w) sum += warp_sums[w];
    parts[blockIdx.x] = sum;
  }
}

// How ZeroRows finds an element's row: no rows, a 32-bit division (rows spanning less than 2^31
// elements; a 64-bit one, ~70 instructions, per float4 would cost more than the loads), a 64-bit one.
enum class RowIndex { none, narrow, wide };

// Rows of x known zero (KnownZeroRows on the device, at least one row). whole_float4s: the rows
// start and end on float4 boundaries, so one flag covers a float4.
struct ZeroRows {
  const int32_t* flags = nullptr;
  int64_t begin = 0, end = 0, per_row = 1;
  bool whole_float4s = true;
  // Whether element i lies in a flagged row. The flag is loaded whatever i (row 0 outside the rows),
  // so that a thread's flag loads carry no branch and go out together.
  template <RowIndex R> __device__ bool zero(int64_t i) const {
    if constexpr (R == RowIndex::none) {
      return false;
    } else {
      const bool inside = i >= begin && i < end;
      const int64_t offset = inside ? i - begin : 0;
      const int64_t row = R == RowIndex::narrow ? int64_t(uint32_t(offset) / uint32_t(per_row)) : offset / per_row;
      return (flags[row] != 0) & inside;
    }
  }
  // The elements of float4 i in flagged rows, as bits 0-3.
  template <RowIndex R> __device__ unsigned zero_mask(int64_t i) const {
    if (whole_float4s) return zero<R>(4 * i) ? 0xfu : 0u;
    return unsigned(zero<R>(4 * i)) | unsigned(zero<R>(4 * i + 1)) << 1 | unsigned(zero<R>(4 * i + 2)) << 2 |
           unsigned(zero<R>(4 * i + 3)) << 3;
  }
};

// float4 i of x with the elements in mask's bits as +0.0, not loaded when all four are.
__device__ float4 load_masked(const float4* x4, int64_t i, unsigned mask) {
  if (mask == 0xfu) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float4 v = x4[i];
  if (mask & 1u) v.x = 0.0f;
  if (mask & 2u) v.y = 0.0f;
  if (mask & 4u) v.z = 0.0f;
  if (mask & 8u) v.w = 0.0f;
  return v;
}

// Per-thread sums of squares in double, then store_block_sum. Elements of known-zero rows are
// taken as +0.0. Vec4 depends on x's alignment alone, never on the rows, so that a call with known
// rows partitions x as the same call without them and gives the same bits.
template <bool Vec4, RowIndex R> __global__ void sum_squares_kernel(double* parts, const float* x, int64_t n, ZeroRows known) {
  begin_after_previous_grid();
  const int64_t first = blockIdx.x * int64_t(kThreads) + threadIdx.x, stride = int64_t(kBlocks) * kThreads;
  double acc = 0;
  int64_t done = 0;
  if (Vec4) {
    // Four loads in flight a thread (one left it ~4% short of the copy rate), added in the same
    // order; with known rows, the four flags first, then the loads of the float4s not all zero.
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int64_t n4 = n / 4;
    auto add = [&acc](float4 v) { acc += double(v.x) * v.x + double(v.y) * v.y + double(v.z) * v.z + double(v.w) * v.w; };
    int64_t i = first;
    for (; i + 3 * stride < n4; i += 4 * stride) {
      const unsigned ma = known.zero_mask<R>(i), mb = known.zero_mask<R>(i + stride), mc = known.zero_mask<R>(i + 2 * stride),
                     md = known.zero_mask<R>(i + 3 * stride);
      const float4 a = load_masked(x4, i, ma), b = load_masked(x4, i + stride, mb), c = load_masked(x4, i + 2 * stride, mc),
                   d = load_masked(x4, i + 3 * stride, md);
      add(a);
      add(b);
      add(c);
      add(d);
    }
    for (; i < n4; i += stride) add(load_masked(x4, i, known.zero_mask<R>(i)));
    done = n4 * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    const float v = known.zero<R>(i) ? 0.0f : x[i];
    acc += double(v) * v;
  }
  store_block_sum(parts, acc);
}

__global__ void sum_values_kernel(double* parts, const double* x, int64_t n) {
  begin_after_previous_grid();
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(kBlocks) * kThreads) acc += x[i];
  store_block_sum(parts, acc);
}

template <RowIndex R> void launch_squares(Tensor parts, Tensor x, const ZeroRows& rows, Stream stream) {
  const bool vec4 = reinterpret_cast<uintptr_t>(x.data) % 16 == 0;
  launch_dependent(vec4 ? sum_squares_kernel<true, R> : sum_squares_kernel<false, R>, kBlocks, kThreads, 0, stream, parts.ptr<double>(),
                   x.ptr<float>(), x.numel(), rows);
}

void launch_sum_squares(Tensor parts, Tensor x, const KnownZeroRows* known, Stream stream) {
  ZeroRows rows;
  RowIndex index = RowIndex::none;
  if (known && known->flags.numel() > 0) {
    rows = {known->flags.ptr<int32_t>(), known->begin, known->begin + known->flags.numel() * known->per_row, known->per_row,
            known->begin % 4 == 0 && known->per_row % 4 == 0};
    index = rows.end - rows.begin < (int64_t(1) << 31) ? RowIndex::narrow : RowIndex::wide;
  }
  if (index == RowIndex::none) launch_squares<RowIndex::none>(parts, x, rows, stream);
  else if (index == RowIndex::narrow) launch_squares<RowIndex::narrow>(parts, x, rows, stream);
  else launch_squares<RowIndex::wide>(parts, x, rows, stream);
}
#endif

void check_parts(const char* op, Tensor parts, Tensor x) {
  expect_shape(op, "parts", parts, {kSumParts});
  expect_dtype(op, "parts", parts, DType::f64);
  expect_device(op, "parts", parts, x.device);
}

// The CPU's parts: the whole sum in parts[0], in index order.
template <typename F> void cpu_parts(Tensor parts, F&& sum) {
  double* p = parts.ptr<double>();
  std::fill(p, p + kSumParts, 0.0);
  p[0] = sum();
}

// sum_squares_parts under the name of the op that asked (errors name it); known may be null.
void squares_parts(const char* op, Tensor parts, Tensor x, const KnownZeroRows* known, Stream stream) {
  check_parts(op, parts, x);
  if (known) {
    expect_dtype(op, "known.flags", known->flags, DType::i32);
    expect_device(op, "known.flags", known->flags, x.device);
    MARROW_CHECK(known->per_row > 0 && known->begin >= 0 && known->begin + known->flags.numel() * known->per_row <= x.numel(),
                 "{}: {} known rows of {} from element {} pass the end of x ({} elements)", op, known->flags.numel(), known->per_row,
                 known->begin, x.numel());
  }
  if (x.device == Device::cuda) {
    expect_dtype(op, "x", x, DType::f32);
    MARROW_GPU_RETURN(op, stream, launch_sum_squares(parts, x, known, stream));
  }
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    cpu_parts(parts, [&] {
      const T* p = x.ptr<T>();
      auto zero = [&](int64_t i) {
        return known && i >= known->begin && i < known->begin + known->flags.numel() * known->per_row &&
               known->flags.ptr<int32_t>()[(i - known->begin) / known->per_row];
      };
      double sum = 0;
      for (int64_t i = 0; i < x.numel(); ++i) {
        const double v = zero(i) ? 0.0 : double(p[i]);
        sum += v * v;
      }
      return sum;
    });
  });
}

}  // namespace

double l2_norm(Tensor x, Stream stream) {
  Buffer parts(DType::f64, x.device, {kSumParts}, stream);
  squares_parts("l2_norm", parts, x, nullptr, stream);
  return std::sqrt(sum_parts_on_host(parts, stream));
}

void sum_squares_parts(Tensor parts, Tensor x, Stream stream) { squares_parts("sum_squares_parts", parts, x, nullptr, stream); }

void sum_squares_parts(Tensor parts, Tensor x, const KnownZeroRows& known, Stream stream) {
  squares_parts("sum_squares_parts", parts, x, &known, stream);
}

void sum_values_parts(Tensor parts, Tensor x, Stream stream) {
  const char* op = "sum_values_parts";
  check_parts(op, parts, x);
  expect_dtype(op, "x", x, DType::f64);
  if (x.device == Device::cuda)
    MARROW_GPU_RETURN(op, stream, launch_dependent(sum_values_kernel, kBlocks, kThreads, 0, stream, parts.ptr<double>(), x.ptr<double>(),
                                                   x.numel()));
  cpu_parts(parts, [&] {
    double sum = 0;
    for (int64_t i = 0; i < x.numel(); ++i) sum += x.ptr<double>()[i];
    return sum;
  });
}

double sum_parts_on_host(Tensor parts, Stream stream) {
  const char* op = "sum_parts_on_host";
  expect_dtype(op, "parts", parts, DType::f64);
  MARROW_CHECK(parts.numel() % kSumParts == 0, "{}: parts has {} elements, not a multiple of {}", op, parts.numel(), kSumParts);
  const double* p = parts.ptr<double>();
  if (parts.device == Device::cuda) {
    // Page-locked: the step waits on this copy before the optimizer, and a pageable one of the
    // ~140 KB of a bench step's parts left the GPU idle ~0.3 ms (trace of 2026-12-02).
    thread_local PinnedHost staging;
    const Tensor host = staging.tensor(DType::f64, {parts.numel()}, Device::cuda);
    copy_to_host_async(host, parts, stream).wait();
    p = host.ptr<double>();
  }
  double sum = 0;
  for (int64_t i = 0; i < parts.numel(); ++i) sum += p[i];
  return sum;
}

}  // namespace marrow
