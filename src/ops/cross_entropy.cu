// Forward and backward stay two kernels. A fused version capped at one block per SM (shared memory
// as the lever) so that its second pass over a row hits L2 ran +0.5 ms a bench step slower: the
// idle time of each block's reductions and barriers cost more than L2 saved.
#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

void check_targets(const char* op, const int32_t* targets, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t)
    MARROW_CHECK(targets[t] == kIgnoreIndex || (0 <= targets[t] && targets[t] < vocab),
                 "{}: target {} at position {} is outside the vocabulary [0, {}) and is not the ignore index {}", op,
                 targets[t], t, vocab, kIgnoreIndex);
}

// The maximum is subtracted before exponentiating so large logits cannot overflow.
template <typename T>
void forward_cpu(T* token_loss, T* lse, const T* logits, const int32_t* targets, int64_t n, int64_t vocab) {
#pragma omp parallel for schedule(static) if (n * vocab > kParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    const T* row = logits + t * vocab;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - m);
    lse[t] = T(m + std::log(sum));
    token_loss[t] = targets[t] == kIgnoreIndex ? T(0) : lse[t] - row[targets[t]];
  }
}

// Each element is read before it is written at the same index, which is what lets dlogits alias
// logits.
template <typename T>
void backward_cpu(T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t n, int64_t vocab,
                  T scale) {
#pragma omp parallel for schedule(static) if (n * vocab > kParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    T* drow = dlogits + t * vocab;
    const T* row = logits + t * vocab;
    if (targets[t] == kIgnoreIndex) {
      std::fill(drow, drow + vocab, T(0));
      continue;
    }
    for (int64_t j = 0; j < vocab; ++j) drow[j] = scale * std::exp(row[j] - lse[t]);
    drow[targets[t]] -= scale;
  }
}

#ifdef __CUDACC__
constexpr int kThreads = 512;

// The forward's exponentials are of x - max <= 0 and run on the SFU (__expf: one multiply by
// log2(e) and ex2.approx, ~2 + 1.2 |x - max| ulp; the terms that dominate the sum have small
// |x - max|): expf's accurate range reduction made the kernel issue-bound at ~16 instructions a
// logit (ncu: 84% of issue slots, 2.6 TB/s). The backward keeps expf (it is bound by its bytes).
// Merges the softmax state (max m2, sum s2 of exp(x - m2)) into (m, s). Symmetric in its two
// arguments, so the lanes of a butterfly all end with the same bits.
__device__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

// The largest of a pack's logits (packs of 8: pairwise on bf16x2, no conversion until the last).
template <int N> __device__ __forceinline__ float pack_max(const Pack<bf16, N>& p) {
  if constexpr (N == 8) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&p);
    const __nv_bfloat162 m2 = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));
    return fmaxf(__low2float(m2), __high2float(m2));
  } else {
    float m = -INFINITY;
    for (int l = 0; l < N; ++l) m = fmaxf(m, float(p.v[l]));
    return m;
  }
}

// One block per row; each thread keeps an online (max, sum) over its packs of N logits (8 bf16 =
// 16 bytes when V % 8 == 0), rescaling when the max grows, so the logits are read once and never
// copied to f32. The states are merged in a fixed tree (butterfly within warps, then warp 0 over
// the warps), so lse is deterministic. A target outside [0, V) other than the ignore index gives
// a NaN loss (the GPU path does not check targets on the host).
template <int N>
__global__ void cross_entropy_forward_kernel(float* token_loss, float* lse, const bf16* logits, const int32_t* targets, int64_t vocab) {
  __shared__ float warp_m[kThreads / 32], warp_s[kThreads / 32];
  const int64_t t = blockIdx.x;
  const bf16* row = logits + t * vocab;
  float m = -INFINITY, s = 0;
  // Unrolled so that a thread has several loads in flight (the sums keep their order).
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < vocab / N; c += kThreads) {
    const Pack<bf16, N> p = reinterpret_cast<const Pack<bf16, N>*>(row)[c];
    const float largest = pack_max<N>(p);
    if (largest > m) {
      s *= __expf(m - largest);
      m = largest;
    }
    if (m > -INFINITY)
      for (int l = 0; l < N; ++l) s += __expf(float(p.v[l]) - m);
  }
  for (int d = 16; d > 0; d /= 2) merge(m, s, __shfl_xor_sync(0xffffffffu, m, d), __shfl_xor_sync(0xffffffffu, s, d));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (warp != 0) return;
  m = lane < kThreads / 32 ? warp_m[lane] : -INFINITY;
  s = lane < kThreads / 32 ? warp_s[lane] : 0.0f;
  for (int d = 16; d > 0; d /= 2) merge(m, s, __shfl_xor_sync(0xffffffffu, m, d), __shfl_xor_sync(0xffffffffu, s, d));
  if (lane == 0) {
    const float l = m + logf(s);
    const int32_t target = targets[t];
    lse[t] = l;
    if (target == kIgnoreIndex) token_loss[t] = 0;
    else token_loss[t] = 0 <= target && target < vocab ? l - float(row[target]) : NAN;
  }
}

// One block per row, threads over its packs: dlogits = scale * exp(x - lse) - scale at the target,
// elementwise. Each element is read and written by one thread, so dlogits may alias logits.
template <int N>
__global__ void cross_entropy_backward_kernel(bf16* dlogits, const bf16* logits, const float* lse, const int32_t* targets, int64_t vocab,
                                float scale) {
  const int64_t t = blockIdx.x;
  const int32_t target = targets[t];
  const bool ignore = target == kIgnoreIndex, bad = !ignore && (target < 0 || target >= vocab);
  const float l = lse[t];
  for (int64_t c = threadIdx.x; c < vocab / N; c += kThreads) {
    const Pack<bf16, N> p = reinterpret_cast<const Pack<bf16, N>*>(logits + t * vocab)[c];
    Pack<bf16, N> o;
    for (int i = 0; i < N; ++i) {
      const float g = scale * expf(float(p.v[i]) - l) - (c * N + i == target ? scale : 0.0f);
      o.v[i] = bf16(ignore ? 0.0f : bad ? NAN : g);
    }
    reinterpret_cast<Pack<bf16, N>*>(dlogits + t * vocab)[c] = o;
  }
}

void launch_forward(Tensor token_loss, Tensor lse, Tensor logits, Tensor targets, Stream stream) {
  const int64_t n = logits.size(0), vocab = logits.size(1);
  if (n == 0) return;
  launch_plain(packable(vocab, {logits.data}) ? cross_entropy_forward_kernel<8> : cross_entropy_forward_kernel<1>, unsigned(n), kThreads, 0,
               stream, token_loss.ptr<float>(), lse.ptr<float>(), static_cast<const bf16*>(logits.data), targets.ptr<int32_t>(), vocab);
}

void launch_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, double scale, Stream stream) {
  const int64_t n = logits.size(0), vocab = logits.size(1);
  if (n == 0) return;
  launch_plain(packable(vocab, {dlogits.data, logits.data}) ? cross_entropy_backward_kernel<8> : cross_entropy_backward_kernel<1>,
               unsigned(n), kThreads, 0, stream, static_cast<bf16*>(dlogits.data), static_cast<const bf16*>(logits.data), lse.ptr<float>(),
               targets.ptr<int32_t>(), vocab, float(scale));
}
#endif

}  // namespace

void cross_entropy_forward(Tensor token_loss, Tensor lse, Tensor logits, Tensor targets, Stream stream) {
  const char* op = "cross_entropy_forward";
  expect_ndim(op, "logits", logits, 2, "[tokens, vocab]");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  expect_shape(op, "targets", targets, {n});
  expect_shape(op, "token_loss", token_loss, {n});
  expect_shape(op, "lse", lse, {n});
  expect_dtype(op, "targets", targets, DType::i32);
  if (on_gpu(op, {{"logits", &logits, DType::bf16}, {"token_loss", &token_loss, DType::f32}, {"lse", &lse, DType::f32},
                  {"targets", &targets, DType::i32}}))
    MARROW_GPU_RETURN(op, stream, launch_forward(token_loss, lse, logits, targets, stream));
  check_targets(op, targets.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(token_loss.ptr<T>(), lse.ptr<T>(), logits.ptr<T>(), targets.ptr<int32_t>(), n, vocab);
  });
}

void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, double scale, Stream stream) {
  const char* op = "cross_entropy_backward";
  expect_ndim(op, "logits", logits, 2, "[tokens, vocab]");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  expect_shape(op, "dlogits", dlogits, {n, vocab});
  expect_shape(op, "targets", targets, {n});
  expect_shape(op, "lse", lse, {n});
  expect_dtype(op, "targets", targets, DType::i32);
  if (on_gpu(op, {{"logits", &logits, DType::bf16}, {"dlogits", &dlogits, DType::bf16}, {"lse", &lse, DType::f32},
                  {"targets", &targets, DType::i32}}))
    MARROW_GPU_RETURN(op, stream, launch_backward(dlogits, logits, lse, targets, scale, stream));
  check_targets(op, targets.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dlogits.ptr<T>(), logits.ptr<T>(), lse.ptr<T>(), targets.ptr<int32_t>(), n, vocab, T(scale));
  });
}

}  // namespace marrow
