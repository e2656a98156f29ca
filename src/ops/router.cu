#include "ops/router.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

// The GPU kernels keep a token's E probabilities in shared memory: up to 512 experts fit 48 KiB.
constexpr int64_t kMaxGpuExperts = 512;

template <typename T>
void forward_cpu(T* probs, int32_t* topk_index, T* topk_weight, const T* logits, int64_t n, int64_t e, int64_t k,
                 bool normalize) {
  std::vector<char> taken(e);
  for (int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * e;
    T* p = probs + t * e;
    double max = l[0], sum = 0;
    for (int64_t i = 1; i < e; ++i) max = std::max<double>(max, l[i]);
    for (int64_t i = 0; i < e; ++i) sum += std::exp(l[i] - max);
    for (int64_t i = 0; i < e; ++i) p[i] = T(std::exp(l[i] - max) / sum);

    // Selection over the stored probabilities (not the logits), as torch.topk sees them: two
    // logits that round to one probability are a tie, resolved to the lower index by the strict >.
    std::fill(taken.begin(), taken.end(), 0);
    int32_t* idx = topk_index + t * k;
    double topk_sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t i = 0; i < e; ++i)
        if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
      taken[best] = 1;
      idx[j] = int32_t(best);
      topk_sum += p[best];
    }
    for (int64_t j = 0; j < k; ++j) topk_weight[t * k + j] = normalize ? T(p[idx[j]] / topk_sum) : p[idx[j]];
  }
}

template <typename T>
void statistics_cpu(T* stats, const T* probs, const int32_t* topk_index, int64_t n, int64_t e, int64_t k) {
  std::vector<int64_t> count(e, 0);
  for (int64_t i = 0; i < n * k; ++i) ++count[topk_index[i]];
  std::vector<double> prob_sum(e, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < e; ++i) prob_sum[i] += probs[t * e + i];
  for (int64_t i = 0; i < e; ++i) {
    stats[i] = T(count[i]);
    stats[e + i] = T(prob_sum[i]);
  }
  stats[2 * e] = T(n);
}

// Gradient with respect to the probabilities, then through the softmax:
//   normalized weights w_j = p_j / S (S = sum of the top-k probs): dp_j = (g_j - sum_m g_m w_m) / S;
//   aux loss: d/dp[t, e] = E * f_e / T = E * count_e / T^2, scaled by aux_grad, with count_e and
//   T from stats (T may exceed n: statistics summed over processes);
//   softmax: dlogits = p * (dp - sum_e p * dp).
template <typename T>
void backward_cpu(T* dlogits, const T* dtopk_weight, const T* probs, const int32_t* topk_index, const T* topk_weight,
                  const T* stats, int64_t n, int64_t e, int64_t k, bool normalize, double aux_grad) {
  const double total = double(stats[2 * e]);
  const double aux_scale = aux_grad * double(e) / (total * total);
  std::vector<double> dp(e);
  for (int64_t t = 0; t < n; ++t) {
    const T *p = probs + t * e, *g = dtopk_weight + t * k, *w = topk_weight + t * k;
    const int32_t* idx = topk_index + t * k;
    for (int64_t i = 0; i < e; ++i) dp[i] = aux_scale * double(stats[i]);
    if (normalize) {
      double topk_sum = 0, gw = 0;
      for (int64_t j = 0; j < k; ++j) {
        topk_sum += p[idx[j]];
        gw += double(g[j]) * w[j];
      }
      for (int64_t j = 0; j < k; ++j) dp[idx[j]] += (g[j] - gw) / topk_sum;
    } else {
      for (int64_t j = 0; j < k; ++j) dp[idx[j]] += g[j];
    }
    double dot = 0;
    for (int64_t i = 0; i < e; ++i) dot += p[i] * dp[i];
    for (int64_t i = 0; i < e; ++i) dlogits[t * e + i] = T(p[i] * (dp[i] - dot));
  }
}

// [tokens, experts] and [tokens, k] with 1 <= k <= experts; returns (T, E, K).
std::array<int64_t, 3> router_sizes(const char* op, const char* scores_name, const Tensor& scores, const Tensor& topk_index) {
  expect_ndim(op, scores_name, scores, 2, "[tokens, experts]");
  expect_ndim(op, "topk_index", topk_index, 2, "[tokens, k]");
  const int64_t n = scores.size(0), e = scores.size(1), k = topk_index.size(1);
  expect_shape(op, "topk_index", topk_index, {n, k});
  expect_dtype(op, "topk_index", topk_index, DType::i32);
  MARROW_CHECK(1 <= k && k <= e, "{}: k = {} must be between 1 and the number of experts {}", op, k, e);
  return {n, e, k};
}

// E * sum_e f_e * P_e in double from statistics [2E + 1] on the host.
template <typename T> double aux_loss_cpu(const char* op, const T* v, int64_t e) {
  const double n = double(v[2 * e]);
  MARROW_CHECK(n > 0, "{}: the statistics count no tokens, so the expert fractions are undefined", op);
  double loss = 0;
  for (int64_t i = 0; i < e; ++i) loss += double(v[i]) / n * (double(v[e + i]) / n);
  return double(e) * loss;
}

// The number of experts E of statistics [2E + 1].
int64_t statistics_experts(const char* op, const Tensor& stats) {
  MARROW_CHECK(stats.ndim == 1 && stats.numel() >= 3 && stats.numel() % 2 == 1,
               "{}: stats must be [2 * experts + 1] with at least one expert, got {}", op, stats.shape_string());
  return (stats.numel() - 1) / 2;
}

#ifdef __CUDACC__
constexpr int kWarps = 4;  // tokens per block of the per-token kernels

// A top-k candidate: the higher probability wins, equal probabilities go to the lower expert index
// (a total order, so every lane of a butterfly ends with the same winner); i < 0 is no candidate.
struct Candidate {
  float p;
  int i;
};
__device__ bool better(Candidate a, Candidate b) { return b.i < 0 || (a.i >= 0 && (a.p > b.p || (a.p == b.p && a.i < b.i))); }

// One warp per token. Lane l owns experts l, l + 32, ...; shared memory holds the token's
// exp(logit - max) (double), probabilities and taken flags. The softmax runs in double and lane 0
// sums the exponentials in expert order, as the CPU reference does, so the stored f32
// probabilities -- and the top-k choice made on them -- match it. K rounds of a warp argmax pick
// the experts; the top-k sum is added in slot order, again as on the CPU.
__global__ void router_forward_kernel(float* probs, int32_t* topk_index, float* topk_weight, const float* logits, int64_t n, int e,
                               int k, bool normalize) {
  begin_after_previous_grid();
  extern __shared__ double shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * int64_t(kWarps) + warp;
  if (t >= n) return;
  double* ex = shared + warp * e;
  float* p = reinterpret_cast<float*>(shared + kWarps * e) + warp * e;
  char* taken = reinterpret_cast<char*>(shared + kWarps * e) + kWarps * e * sizeof(float) + warp * e;
  const float* l = logits + t * e;
  float max = -INFINITY;
  for (int i = lane; i < e; i += 32) max = fmaxf(max, l[i]);
  max = warp_max(max);
  for (int i = lane; i < e; i += 32) ex[i] = exp(double(l[i]) - double(max));
  __syncwarp();
  double sum = 0;
  if (lane == 0)
    for (int i = 0; i < e; ++i) sum += ex[i];
  sum = __shfl_sync(0xffffffffu, sum, 0);
  for (int i = lane; i < e; i += 32) {
    p[i] = float(ex[i] / sum);
    probs[t * e + i] = p[i];
    taken[i] = 0;
  }
  double topk_sum = 0;
  for (int j = 0; j < k; ++j) {
    Candidate c{0.0f, -1};
    for (int i = lane; i < e; i += 32)
      if (!taken[i] && (c.i < 0 || p[i] > c.p)) c = {p[i], i};
    for (int m = 16; m > 0; m /= 2) {
      const Candidate o{__shfl_xor_sync(0xffffffffu, c.p, m), __shfl_xor_sync(0xffffffffu, c.i, m)};
      if (better(o, c)) c = o;
    }
    topk_sum += c.p;
    if (lane == c.i % 32) taken[c.i] = 1;  // only the owning lane reads this flag again
    if (lane == 0) topk_index[t * k + j] = c.i;
  }
  __syncwarp();
  for (int j = lane; j < k; j += 32) {
    const float pj = p[topk_index[t * k + j]];
    topk_weight[t * k + j] = normalize ? float(double(pj) / topk_sum) : pj;
  }
}

// Statistics: one block per expert; its threads sum probs[:, e] over tokens in double and the block
// reduces them in a fixed tree, and count the copies routed to e (integers: the order does not
// matter; an index outside [0, E) counts for no expert). Block 0 also writes the token count.
__global__ void router_statistics_kernel(float* stats, const float* probs, const int32_t* topk_index, int64_t n, int64_t copies, int e) {
  begin_after_previous_grid();
  __shared__ double warp_sums[32];
  __shared__ int warp_counts[32];
  double acc = 0;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) acc += probs[t * e + blockIdx.x];
  // Four indices a load where aligned (one scalar load at a time took 33 us a call at the bench shape).
  const int expert = int(blockIdx.x);
  int count = 0;
  int64_t scalar_from = 0;
  if (reinterpret_cast<uintptr_t>(topk_index) % 16 == 0) {
    const int4* quads = reinterpret_cast<const int4*>(topk_index);
    scalar_from = copies / 4 * 4;
#pragma unroll 8
    for (int64_t i = threadIdx.x; i < copies / 4; i += blockDim.x) {
      const int4 q = quads[i];
      count += (q.x == expert) + (q.y == expert) + (q.z == expert) + (q.w == expert);
    }
  }
  for (int64_t i = scalar_from + threadIdx.x; i < copies; i += blockDim.x) count += topk_index[i] == expert;
  acc = warp_sum(acc);
  count = warp_sum(count);
  if (threadIdx.x % 32 == 0) {
    warp_sums[threadIdx.x / 32] = acc;
    warp_counts[threadIdx.x / 32] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    int total = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) {
      sum += warp_sums[w];
      total += warp_counts[w];
    }
    stats[blockIdx.x] = float(total);
    stats[e + blockIdx.x] = float(sum);
    if (blockIdx.x == 0) stats[2 * e] = float(n);
  }
}

// One warp per token: dp (shared, lanes own experts l, l + 32, ...) starts at the aux gradient
// aux_grad * E * count_e / T^2, computed from stats in double as on the CPU; the top-k sums are
// reduced in a fixed tree and lane 0 adds the K slot terms in slot order; the softmax's dot
// product is one more fixed-tree reduction.
__global__ void router_backward_kernel(__nv_bfloat16* dlogits, const float* dtopk_weight, const float* probs, const int32_t* topk_index,
                                const float* topk_weight, const float* stats, int64_t n, int e, int k, bool normalize,
                                double aux_grad) {
  begin_after_previous_grid();
  extern __shared__ float dp_shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * int64_t(kWarps) + warp;
  if (t >= n) return;
  float* dp = dp_shared + warp * e;
  const float *p = probs + t * e, *g = dtopk_weight + t * k, *w = topk_weight + t * k;
  const int32_t* idx = topk_index + t * k;
  const double aux_scale = aux_grad * double(e) / (double(stats[2 * e]) * double(stats[2 * e]));
  for (int i = lane; i < e; i += 32) dp[i] = float(aux_scale * double(stats[i]));
  float topk_sum = 0, gw = 0;
  for (int j = lane; j < k; j += 32)
    if (0 <= idx[j] && idx[j] < e) {
      topk_sum += p[idx[j]];
      gw += g[j] * w[j];
    }
  topk_sum = warp_sum(topk_sum);
  gw = warp_sum(gw);
  __syncwarp();
  if (lane == 0)
    for (int j = 0; j < k; ++j)
      if (0 <= idx[j] && idx[j] < e) dp[idx[j]] += normalize ? (g[j] - gw) / topk_sum : g[j];
  __syncwarp();
  float dot = 0;
  for (int i = lane; i < e; i += 32) dot += p[i] * dp[i];
  dot = warp_sum(dot);
  for (int i = lane; i < e; i += 32) dlogits[t * e + i] = __nv_bfloat16(p[i] * (dp[i] - dot));
}

void launch_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream) {
  const int64_t n = logits.size(0), e = logits.size(1), k = topk_index.size(1);
  if (n == 0) return;
  const size_t smem = size_t(kWarps) * e * (sizeof(double) + sizeof(float) + 1);
  launch_dependent(router_forward_kernel, unsigned((n + kWarps - 1) / kWarps), 32 * kWarps, smem, stream, probs.ptr<float>(),
                   topk_index.ptr<int32_t>(), topk_weight.ptr<float>(), logits.ptr<float>(), n, int(e), int(k), normalize);
}

// The arithmetic of aux_loss_cpu, each operation rounded on its own (no fused multiply-adds): the
// block's threads compute the experts' terms (two f64 divisions each: one thread doing all of them
// took ~40 us), then thread 0 adds them in expert order, so the device's sum is the host's to the
// bit. A count of zero tokens gives NaN (the host version refuses it).
__global__ void router_aux_loss_add_kernel(double* total, const float* stats, int e) {
  begin_after_previous_grid();
  extern __shared__ double terms[];
  const double n = stats[2 * e];
  for (int i = threadIdx.x; i < e; i += blockDim.x)
    terms[i] = __dmul_rn(__ddiv_rn(double(stats[i]), n), __ddiv_rn(double(stats[e + i]), n));
  __syncthreads();
  if (threadIdx.x != 0) return;
  double loss = 0;
  for (int i = 0; i < e; ++i) loss = __dadd_rn(loss, terms[i]);
  total[0] = __dadd_rn(total[0], __dmul_rn(double(e), loss));
}

void launch_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Tensor stats, Stream stream) {
  const int64_t n = probs.size(0), e = probs.size(1), k = topk_index.size(1);
  if (n > 0)
    launch_dependent(router_backward_kernel, unsigned((n + kWarps - 1) / kWarps), 32 * kWarps, size_t(kWarps) * e * sizeof(float), stream,
                     bf16_ptr(dlogits), dtopk_weight.ptr<float>(), probs.ptr<float>(), topk_index.ptr<int32_t>(), topk_weight.ptr<float>(),
                     stats.ptr<float>(), n, int(e), int(k), normalize, aux_grad);
}
#endif

}  // namespace

void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream) {
  const char* op = "router_forward";
  const std::array<int64_t, 3> size = router_sizes(op, "logits", logits, topk_index);
  const int64_t n = size[0], e = size[1], k = size[2];
  expect_shape(op, "probs", probs, {n, e});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  if (on_gpu(op, {{"logits", &logits, DType::f32}, {"probs", &probs, DType::f32}, {"topk_index", &topk_index, DType::i32},
                  {"topk_weight", &topk_weight, DType::f32}})) {
    MARROW_CHECK(e <= kMaxGpuExperts, "{}: {} experts, but the GPU kernel takes at most {}", op, e, kMaxGpuExperts);
    MARROW_GPU_RETURN(op, stream, launch_forward(probs, topk_index, topk_weight, logits, normalize, stream));
  }
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(probs.ptr<T>(), topk_index.ptr<int32_t>(), topk_weight.ptr<T>(), logits.ptr<T>(), n, e, k, normalize);
  });
}

void router_statistics(Tensor stats, Tensor probs, Tensor topk_index, Stream stream) {
  const char* op = "router_statistics";
  const std::array<int64_t, 3> size = router_sizes(op, "probs", probs, topk_index);
  const int64_t n = size[0], e = size[1], k = size[2];
  expect_shape(op, "stats", stats, {2 * e + 1});
  // Indices on the GPU are not checked: an entry outside [0, E) is left out of the counts.
  if (on_gpu(op, {{"probs", &probs, DType::f32}, {"topk_index", &topk_index, DType::i32}, {"stats", &stats, DType::f32}}))
    MARROW_GPU_RETURN(op, stream, launch_dependent(router_statistics_kernel, unsigned(e), 256, 0, stream, stats.ptr<float>(), probs.ptr<float>(),
                                                   topk_index.ptr<int32_t>(), n, topk_index.numel(), int(e)));
  expect_indices_below(op, "topk_index", topk_index, e);
  with_cpu_scalar(op, probs, [&](auto s) {
    using T = decltype(s);
    statistics_cpu<T>(stats.ptr<T>(), probs.ptr<T>(), topk_index.ptr<int32_t>(), n, e, k);
  });
}

double router_aux_loss(Tensor stats, Stream stream) {
  const char* op = "router_aux_loss";
  const int64_t e = statistics_experts(op, stats);
  Buffer host = to_host(stats, stream);
  double loss = 0;
  with_cpu_scalar(op, host, [&](auto s) { loss = aux_loss_cpu(op, host.ptr<decltype(s)>(), e); });
  return loss;
}

void router_aux_loss_add(Tensor total, Tensor stats, Stream stream) {
  const char* op = "router_aux_loss_add";
  const int64_t e = statistics_experts(op, stats);
  expect_shape(op, "total", total, {1});
  expect_dtype(op, "total", total, DType::f64);
  if (common_device(op, {{"total", &total}, {"stats", &stats}}) == Device::cuda) {
    expect_dtype(op, "stats", stats, DType::f32);
    MARROW_CHECK(e <= 4096, "{}: {} experts exceed the GPU kernel's shared memory (4096 at most)", op, e);
    MARROW_GPU_RETURN(op, stream, launch_dependent(router_aux_loss_add_kernel, 1, unsigned(std::min<int64_t>(e, 256)), size_t(e) * sizeof(double),
                                                   stream, total.ptr<double>(), stats.ptr<float>(), int(e)));
  }
  with_cpu_scalar(op, stats, [&](auto s) { total.ptr<double>()[0] += aux_loss_cpu(op, stats.ptr<decltype(s)>(), e); });
}

void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Tensor stats, Stream stream) {
  const char* op = "router_backward";
  const std::array<int64_t, 3> size = router_sizes(op, "probs", probs, topk_index);
  const int64_t n = size[0], e = size[1], k = size[2];
  expect_shape(op, "dlogits", dlogits, {n, e});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_shape(op, "stats", stats, {2 * e + 1});
  // Indices on the GPU are not checked: an entry outside [0, E) is skipped.
  if (on_gpu(op, {{"probs", &probs, DType::f32}, {"dlogits", &dlogits, DType::bf16}, {"dtopk_weight", &dtopk_weight, DType::f32},
                  {"topk_index", &topk_index, DType::i32}, {"topk_weight", &topk_weight, DType::f32}, {"stats", &stats, DType::f32}})) {
    MARROW_CHECK(e <= kMaxGpuExperts, "{}: {} experts, but the GPU kernel takes at most {}", op, e, kMaxGpuExperts);
    MARROW_GPU_RETURN(op, stream, launch_backward(dlogits, dtopk_weight, probs, topk_index, topk_weight, normalize, aux_grad, stats, stream));
  }
  expect_indices_below(op, "topk_index", topk_index, e);
  with_cpu_scalar(op, probs, [&](auto s) {
    using T = decltype(s);
    const double tokens = double(stats.ptr<T>()[2 * e]);
    MARROW_CHECK(tokens >= double(n), "{}: stats counts {} tokens, fewer than the {} rows of probs", op, tokens, n);
    backward_cpu<T>(dlogits.ptr<T>(), dtopk_weight.ptr<T>(), probs.ptr<T>(), topk_index.ptr<int32_t>(), topk_weight.ptr<T>(),
                    stats.ptr<T>(), n, e, k, normalize, aux_grad);
  });
}

}  // namespace marrow
