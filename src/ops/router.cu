#include "ops/router.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
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

// Group-limited selection: marks taken the experts of every group outside the top_groups of highest
// score (the group's highest probability; equal scores go to the lower group index, the strict >).
// score [groups] is scratch, a chosen group's becoming -1.
template <typename T>
void mask_groups_cpu(char* taken, const T* p, int64_t e, std::vector<T>& score, int64_t top_groups) {
  const int64_t groups = int64_t(score.size()), size = e / groups;
  for (int64_t g = 0; g < groups; ++g) score[g] = *std::max_element(p + g * size, p + (g + 1) * size);
  for (int64_t r = 0; r < top_groups; ++r) {
    int64_t best = -1;
    for (int64_t g = 0; g < groups; ++g)
      if (score[g] >= 0 && (best < 0 || score[g] > score[best])) best = g;
    score[best] = -1;
  }
  for (int64_t i = 0; i < e; ++i) taken[i] = score[i / size] >= 0;
}

template <typename T>
void forward_cpu(T* probs, int32_t* topk_index, T* topk_weight, const T* logits, int64_t n, int64_t e, int64_t k,
                 const RouterOptions& options) {
  std::vector<char> taken(e);
  std::vector<T> score(options.groups), chosen_by(e);
  const float* bias = options.selection_bias.data ? options.selection_bias.ptr<float>() : nullptr;
  for (int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * e;
    T* p = probs + t * e;
    double max = l[0], sum = 0;
    for (int64_t i = 1; i < e; ++i) max = std::max<double>(max, l[i]);
    for (int64_t i = 0; i < e; ++i) sum += std::exp(l[i] - max);
    for (int64_t i = 0; i < e; ++i) p[i] = T(std::exp(l[i] - max) / sum);

    // Selection over the stored probabilities (not the logits), as torch.topk sees them: two
    // logits that round to one probability are a tie, resolved to the lower index by the strict >.
    for (int64_t i = 0; i < e; ++i) chosen_by[i] = bias ? T(p[i] + T(bias[i])) : p[i];
    std::fill(taken.begin(), taken.end(), 0);
    if (options.groups > 1) mask_groups_cpu(taken.data(), chosen_by.data(), e, score, options.top_groups);
    int32_t* idx = topk_index + t * k;
    double topk_sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t i = 0; i < e; ++i)
        if (!taken[i] && (best < 0 || chosen_by[i] > chosen_by[best])) best = i;
      taken[best] = 1;
      idx[j] = int32_t(best);
      topk_sum += p[best];
    }
    for (int64_t j = 0; j < k; ++j) topk_weight[t * k + j] = T((options.normalize ? p[idx[j]] / topk_sum : double(p[idx[j]])) * options.scale);
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
//   weights w_j = s p_j (s = scale): dp_j = s g_j;
//   normalized weights w_j = s p_j / S (S = sum of the top-k probs): dp_j = (s g_j - sum_m g_m w_m) / S;
//   aux loss: d/dp[t, e] = E * f_e / T = E * count_e / T^2, scaled by aux_grad / G, with count_e
//   and T from token t's row of stats (T may exceed the row's tokens: statistics summed over processes);
//   softmax: dlogits = p * (dp - sum_e p * dp).
template <typename T>
void backward_cpu(T* dlogits, const T* dtopk_weight, const T* probs, const int32_t* topk_index, const T* topk_weight,
                  const T* stats, int64_t groups, int64_t n, int64_t e, int64_t k, bool normalize, double scale, double aux_grad) {
  std::vector<double> dp(e);
  for (int64_t t = 0; t < n; ++t) {
    const T* row = stats + t / (n / groups) * (2 * e + 1);
    const double total = double(row[2 * e]);
    const double aux_scale = aux_grad * double(e) / (total * total * double(groups));
    const T *p = probs + t * e, *g = dtopk_weight + t * k, *w = topk_weight + t * k;
    const int32_t* idx = topk_index + t * k;
    for (int64_t i = 0; i < e; ++i) dp[i] = aux_scale * double(row[i]);
    if (normalize) {
      double topk_sum = 0, gw = 0;
      for (int64_t j = 0; j < k; ++j) {
        topk_sum += p[idx[j]];
        gw += double(g[j]) * w[j];
      }
      for (int64_t j = 0; j < k; ++j) dp[idx[j]] += (double(g[j]) * scale - gw) / topk_sum;
    } else {
      for (int64_t j = 0; j < k; ++j) dp[idx[j]] += double(g[j]) * scale;
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

// The mean over rows of E * sum_e f_e * P_e, in double from statistics [rows, 2E + 1] on the host.
template <typename T> double aux_loss_cpu(const char* op, const T* stats, int64_t rows, int64_t e) {
  double sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* v = stats + r * (2 * e + 1);
    const double n = double(v[2 * e]);
    MARROW_CHECK(n > 0, "{}: the statistics count no tokens, so the expert fractions are undefined", op);
    double loss = 0;
    for (int64_t i = 0; i < e; ++i) loss += double(v[i]) / n * (double(v[e + i]) / n);
    sum += double(e) * loss;
  }
  return sum / double(rows);
}

// router_step_statistics: each expert's sum runs over the rows in order, in double.
template <typename T> void step_statistics_cpu(double* totals, T* stats, int64_t rows, int64_t e, bool global_form) {
  for (int64_t i = 0; i <= e; ++i)
    for (int64_t r = 0; r < rows; ++r) totals[i] += double(stats[r * (2 * e + 1) + (i < e ? i : 2 * e)]);
  if (global_form)
    for (int64_t i = 0; i < e; ++i) stats[i] = T(totals[i] * double(stats[2 * e]) / totals[e]);
}

// expert_bias_update of one layer: the mean load summed in expert order, each step one rounded f32 add.
void bias_update_cpu(float* bias, const double* load, int64_t e, float rate) {
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += load[i];
  const double mean = sum / double(e);
  for (int64_t i = 0; i < e; ++i) bias[i] = load[i] < mean ? bias[i] + rate : load[i] > mean ? bias[i] - rate : bias[i];
}

// (rows, E) of statistics [2E + 1] (one row) or [rows, 2E + 1].
std::array<int64_t, 2> statistics_experts(const char* op, const Tensor& stats) {
  const int64_t width = stats.ndim > 0 ? stats.size(-1) : 0, rows = stats.ndim == 2 ? stats.size(0) : 1;
  MARROW_CHECK((stats.ndim == 1 || stats.ndim == 2) && rows >= 1 && width >= 3 && width % 2 == 1,
               "{}: stats must be [2 * experts + 1] or [rows, 2 * experts + 1] with at least one expert and row, got {}", op,
               stats.shape_string());
  return {rows, (width - 1) / 2};
}

// The rows of the statistics that router_backward takes for probs [T, E]: [2E + 1] (one) or
// [G, 2E + 1] with G dividing T.
int64_t backward_statistics_rows(const char* op, const Tensor& stats, int64_t n, int64_t e) {
  if (stats.ndim != 2) {
    expect_shape(op, "stats", stats, {2 * e + 1});
    return 1;
  }
  const int64_t rows = stats.size(0);
  expect_shape(op, "stats", stats, {rows, 2 * e + 1});
  MARROW_CHECK(rows >= 1 && n % rows == 0, "{}: stats has {} rows, which do not divide the {} tokens of probs", op, rows, n);
  return rows;
}

void check_options(const char* op, const RouterOptions& o, int64_t e, int64_t k) {
  MARROW_CHECK(std::isfinite(o.scale) && o.scale > 0, "{}: the routing scale must be positive and finite, got {}", op, o.scale);
  MARROW_CHECK(o.groups >= 1 && e % o.groups == 0, "{}: {} experts do not split into {} groups", op, e, o.groups);
  MARROW_CHECK(1 <= o.top_groups && o.top_groups <= o.groups, "{}: top_groups = {} must be between 1 and the {} groups", op, o.top_groups,
               o.groups);
  MARROW_CHECK(k <= o.top_groups * (e / o.groups), "{}: k = {} exceeds the {} experts of the top {} groups", op, k,
               o.top_groups * (e / o.groups), o.top_groups);
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

// The warp's best candidate, on every lane.
__device__ Candidate warp_best(Candidate c) {
  for (int m = 16; m > 0; m /= 2) {
    const Candidate o{__shfl_xor_sync(0xffffffffu, c.p, m), __shfl_xor_sync(0xffffffffu, c.i, m)};
    if (better(o, c)) c = o;
  }
  return c;
}

// Group-limited selection for one warp's token: marks taken the experts of every group outside the
// top_groups of highest score (the group's highest probability), equal scores to the lower group
// index, as mask_groups_cpu. score (the token's exponentials, no longer read) holds the groups'
// scores, a chosen group's becoming -1; lane l owns groups l, l + 32, ... as it owns experts.
__device__ float chosen_by(const float* p, const float* bias, int i) { return bias ? __fadd_rn(p[i], bias[i]) : p[i]; }

__device__ void mask_groups(char* taken, const float* p, const float* bias, double* score, int e, int groups, int top_groups, int lane) {
  const int size = e / groups;
  __syncwarp();  // every lane's probabilities
  for (int g = lane; g < groups; g += 32) {
    float best = chosen_by(p, bias, g * size);
    for (int i = 1; i < size; ++i) best = fmaxf(best, chosen_by(p, bias, g * size + i));
    score[g] = best;
  }
  for (int r = 0; r < top_groups; ++r) {
    Candidate c{0.0f, -1};
    for (int g = lane; g < groups; g += 32)
      if (score[g] >= 0 && (c.i < 0 || float(score[g]) > c.p)) c = {float(score[g]), g};
    c = warp_best(c);
    if (lane == c.i % 32) score[c.i] = -1;
  }
  __syncwarp();
  for (int i = lane; i < e; i += 32) taken[i] = score[i / size] >= 0;
  __syncwarp();
}

// One warp per token. Lane l owns experts l, l + 32, ...; shared memory holds the token's
// exp(logit - max) (double), probabilities and taken flags. The softmax runs in double and lane 0
// sums the exponentials in expert order, as the CPU reference does, so the stored f32
// probabilities -- and the top-k choice made on them -- match it. K rounds of a warp argmax pick
// the experts (among the top groups' when groups > 1) on p + bias where a selection bias is given
// (one f32 add, as the CPU's); the top-k sum of p is added in slot order, again as on the CPU.
__global__ void router_forward_kernel(float* probs, int32_t* topk_index, float* topk_weight, const float* logits, const float* bias, int64_t n,
                                      int e, int k, bool normalize, double scale, int groups, int top_groups) {
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
  if (groups > 1) mask_groups(taken, p, bias, ex, e, groups, top_groups, lane);
  __syncwarp();  // p[c.i] below is another lane's
  double topk_sum = 0;
  for (int j = 0; j < k; ++j) {
    Candidate c{0.0f, -1};
    for (int i = lane; i < e; i += 32)
      if (!taken[i] && (c.i < 0 || chosen_by(p, bias, i) > c.p)) c = {chosen_by(p, bias, i), i};
    c = warp_best(c);
    topk_sum += p[c.i];
    if (lane == c.i % 32) taken[c.i] = 1;  // only the owning lane reads this flag again
    if (lane == 0) topk_index[t * k + j] = c.i;
  }
  __syncwarp();
  for (int j = lane; j < k; j += 32) {
    const float pj = p[topk_index[t * k + j]];
    topk_weight[t * k + j] = float((normalize ? double(pj) / topk_sum : double(pj)) * scale);
  }
}

// Statistics: one block per expert and group of n tokens (blockIdx.y, its row of stats); its threads
// sum probs[:, e] over the group's tokens in double and the block reduces them in a fixed tree, and
// count the copies routed to e (integers: the order does not matter; an index outside [0, E) counts
// for no expert). Block 0 of a row also writes the token count.
__global__ void router_statistics_kernel(float* stats, const float* probs, const int32_t* topk_index, int64_t n, int64_t copies, int e) {
  begin_after_previous_grid();
  stats += blockIdx.y * int64_t(2 * e + 1);
  probs += blockIdx.y * n * e;
  topk_index += blockIdx.y * copies;
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
// aux_grad * E * count_e / (G T^2), computed from the token's row of stats (per_row tokens a row) in
// double as on the CPU; the top-k sums are reduced in a fixed tree and lane 0 adds the K slot terms
// in slot order; the softmax's dot product is one more fixed-tree reduction.
__global__ void router_backward_kernel(__nv_bfloat16* dlogits, const float* dtopk_weight, const float* probs, const int32_t* topk_index,
                                const float* topk_weight, const float* stats, int64_t n, int e, int k, bool normalize, float scale,
                                double aux_grad, int64_t per_row, int rows) {
  begin_after_previous_grid();
  extern __shared__ float dp_shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * int64_t(kWarps) + warp;
  if (t >= n) return;
  float* dp = dp_shared + warp * e;
  const float *p = probs + t * e, *g = dtopk_weight + t * k, *w = topk_weight + t * k;
  const int32_t* idx = topk_index + t * k;
  const float* row = stats + t / per_row * (2 * e + 1);
  const double aux_scale = aux_grad * double(e) / (double(row[2 * e]) * double(row[2 * e]) * double(rows));
  for (int i = lane; i < e; i += 32) dp[i] = float(aux_scale * double(row[i]));
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
      if (0 <= idx[j] && idx[j] < e) dp[idx[j]] += normalize ? (g[j] * scale - gw) / topk_sum : g[j] * scale;
  __syncwarp();
  float dot = 0;
  for (int i = lane; i < e; i += 32) dot += p[i] * dp[i];
  dot = warp_sum(dot);
  for (int i = lane; i < e; i += 32) dlogits[t * e + i] = __nv_bfloat16(p[i] * (dp[i] - dot));
}

void launch_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, const RouterOptions& o, Stream stream) {
  const int64_t n = logits.size(0), e = logits.size(1), k = topk_index.size(1);
  if (n == 0) return;
  const size_t smem = size_t(kWarps) * e * (sizeof(double) + sizeof(float) + 1);
  launch_dependent(router_forward_kernel, unsigned((n + kWarps - 1) / kWarps), 32 * kWarps, smem, stream, probs.ptr<float>(),
                   topk_index.ptr<int32_t>(), topk_weight.ptr<float>(), logits.ptr<float>(),
                   o.selection_bias.data ? o.selection_bias.ptr<float>() : nullptr, n, int(e), int(k), o.normalize, o.scale, int(o.groups),
                   int(o.top_groups));
}

// The arithmetic of aux_loss_cpu, each operation rounded on its own (no fused multiply-adds): the
// block's threads compute the experts' terms (two f64 divisions each: one thread doing all of them
// took ~40 us), then thread 0 adds them in expert order, so the device's sum is the host's to the
// bit; rows one after the other, their losses summed in row order and divided by their number. A
// count of zero tokens gives NaN (the host version refuses it).
__global__ void router_aux_loss_add_kernel(double* total, const float* stats, int rows, int e) {
  begin_after_previous_grid();
  extern __shared__ double terms[];
  double sum = 0;  // thread 0's
  for (int r = 0; r < rows; ++r) {
    const float* v = stats + int64_t(r) * (2 * e + 1);
    const double n = v[2 * e];
    for (int i = threadIdx.x; i < e; i += blockDim.x) terms[i] = __dmul_rn(__ddiv_rn(double(v[i]), n), __ddiv_rn(double(v[e + i]), n));
    __syncthreads();
    if (threadIdx.x == 0) {
      double loss = 0;
      for (int i = 0; i < e; ++i) loss = __dadd_rn(loss, terms[i]);
      sum = __dadd_rn(sum, __dmul_rn(double(e), loss));
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) total[0] = __dadd_rn(total[0], __ddiv_rn(sum, double(rows)));
}

// One block, thread i owning totals[i] (i = E the tokens), as step_statistics_cpu.
__global__ void router_step_statistics_kernel(double* totals, float* stats, int rows, int e, bool global_form) {
  begin_after_previous_grid();
  const int64_t width = 2 * e + 1;
  double tokens = totals[e];
  for (int r = 0; r < rows; ++r) tokens = __dadd_rn(tokens, double(stats[r * width + 2 * e]));
  __syncthreads();  // every thread has read totals[e]
  for (int i = threadIdx.x; i <= e; i += blockDim.x) {
    double sum = totals[i];
    for (int r = 0; r < rows; ++r) sum = __dadd_rn(sum, double(stats[r * width + (i < e ? i : 2 * e)]));
    totals[i] = sum;
    if (global_form && i < e) stats[i] = float(__ddiv_rn(__dmul_rn(sum, double(stats[2 * e])), tokens));
  }
}

// One block a layer; every thread sums the layer's loads in expert order, as bias_update_cpu.
__global__ void expert_bias_update_kernel(float* bias, const double* totals, int e, float rate) {
  begin_after_previous_grid();
  const double* load = totals + blockIdx.x * int64_t(e + 1);
  double sum = 0;
  for (int i = 0; i < e; ++i) sum = __dadd_rn(sum, load[i]);
  const double mean = __ddiv_rn(sum, double(e));
  float* b = bias + blockIdx.x * int64_t(e);
  for (int i = threadIdx.x; i < e; i += blockDim.x) b[i] = load[i] < mean ? __fadd_rn(b[i], rate) : load[i] > mean ? __fsub_rn(b[i], rate) : b[i];
}

void launch_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, const RouterOptions& o,
                     double aux_grad, Tensor stats, int64_t rows, Stream stream) {
  const int64_t n = probs.size(0), e = probs.size(1), k = topk_index.size(1);
  if (n > 0)
    launch_dependent(router_backward_kernel, unsigned((n + kWarps - 1) / kWarps), 32 * kWarps, size_t(kWarps) * e * sizeof(float), stream,
                     bf16_ptr(dlogits), dtopk_weight.ptr<float>(), probs.ptr<float>(), topk_index.ptr<int32_t>(), topk_weight.ptr<float>(),
                     stats.ptr<float>(), n, int(e), int(k), o.normalize, float(o.scale), aux_grad, n / rows, int(rows));
}
#endif

// stats [rows, 2E + 1] (any shape of that many elements) of the rows' consecutive tokens of probs.
void statistics(const char* op, Tensor stats, Tensor probs, Tensor topk_index, int64_t rows, Stream stream) {
  const int64_t n = probs.size(0), e = probs.size(1), k = topk_index.size(1), per_row = rows > 0 ? n / rows : 0;
  // Indices on the GPU are not checked: an entry outside [0, E) is left out of the counts.
  if (on_gpu(op, {{"probs", &probs, DType::f32}, {"topk_index", &topk_index, DType::i32}, {"stats", &stats, DType::f32}})) {
    if (rows == 0) return;
    MARROW_GPU_RETURN(op, stream, launch_dependent(router_statistics_kernel, dim3(unsigned(e), unsigned(rows)), 256, 0, stream, stats.ptr<float>(),
                                                   probs.ptr<float>(), topk_index.ptr<int32_t>(), per_row, per_row * k, int(e)));
  }
  expect_indices_below(op, "topk_index", topk_index, e);
  with_cpu_scalar(op, probs, [&](auto s) {
    using T = decltype(s);
    for (int64_t r = 0; r < rows; ++r)
      statistics_cpu<T>(stats.ptr<T>() + r * (2 * e + 1), probs.ptr<T>() + r * per_row * e, topk_index.ptr<int32_t>() + r * per_row * k, per_row,
                        e, k);
  });
}

}  // namespace

void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream) {
  RouterOptions options;
  options.normalize = normalize;
  router_forward(probs, topk_index, topk_weight, logits, options, stream);
}

void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, const RouterOptions& options, Stream stream) {
  const char* op = "router_forward";
  const std::array<int64_t, 3> size = router_sizes(op, "logits", logits, topk_index);
  const int64_t n = size[0], e = size[1], k = size[2];
  expect_shape(op, "probs", probs, {n, e});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  check_options(op, options, e, k);
  if (options.selection_bias.data) {
    expect_shape(op, "selection_bias", options.selection_bias, {e});
    expect_dtype(op, "selection_bias", options.selection_bias, DType::f32);
    common_device(op, {{"logits", &logits}, {"selection_bias", &options.selection_bias}});
  }
  if (on_gpu(op, {{"logits", &logits, DType::f32}, {"probs", &probs, DType::f32}, {"topk_index", &topk_index, DType::i32},
                  {"topk_weight", &topk_weight, DType::f32}})) {
    MARROW_CHECK(e <= kMaxGpuExperts, "{}: {} experts, but the GPU kernel takes at most {}", op, e, kMaxGpuExperts);
    MARROW_GPU_RETURN(op, stream, launch_forward(probs, topk_index, topk_weight, logits, options, stream));
  }
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(probs.ptr<T>(), topk_index.ptr<int32_t>(), topk_weight.ptr<T>(), logits.ptr<T>(), n, e, k, options);
  });
}

void router_statistics(Tensor stats, Tensor probs, Tensor topk_index, Stream stream) {
  const char* op = "router_statistics";
  const int64_t e = router_sizes(op, "probs", probs, topk_index)[1];
  expect_shape(op, "stats", stats, {2 * e + 1});
  statistics(op, stats, probs, topk_index, 1, stream);
}

void router_statistics_grouped(Tensor stats, Tensor probs, Tensor topk_index, int64_t tokens_per_group, Stream stream) {
  const char* op = "router_statistics_grouped";
  const std::array<int64_t, 3> size = router_sizes(op, "probs", probs, topk_index);
  const int64_t n = size[0], e = size[1];
  MARROW_CHECK(tokens_per_group > 0 && n % tokens_per_group == 0, "{}: tokens_per_group = {} must be positive and divide the {} tokens", op,
               tokens_per_group, n);
  expect_shape(op, "stats", stats, {n / tokens_per_group, 2 * e + 1});
  statistics(op, stats, probs, topk_index, n / tokens_per_group, stream);
}

double router_aux_loss(Tensor stats, Stream stream) {
  const char* op = "router_aux_loss";
  const std::array<int64_t, 2> size = statistics_experts(op, stats);
  Buffer host = to_host(stats, stream);
  double loss = 0;
  with_cpu_scalar(op, host, [&](auto s) { loss = aux_loss_cpu(op, host.ptr<decltype(s)>(), size[0], size[1]); });
  return loss;
}

void router_aux_loss_add(Tensor total, Tensor stats, Stream stream) {
  const char* op = "router_aux_loss_add";
  const std::array<int64_t, 2> size = statistics_experts(op, stats);
  const int64_t rows = size[0], e = size[1];
  expect_shape(op, "total", total, {1});
  expect_dtype(op, "total", total, DType::f64);
  if (common_device(op, {{"total", &total}, {"stats", &stats}}) == Device::cuda) {
    expect_dtype(op, "stats", stats, DType::f32);
    MARROW_CHECK(e <= 4096, "{}: {} experts exceed the GPU kernel's shared memory (4096 at most)", op, e);
    MARROW_GPU_RETURN(op, stream, launch_dependent(router_aux_loss_add_kernel, 1, unsigned(std::min<int64_t>(e, 256)), size_t(e) * sizeof(double),
                                                   stream, total.ptr<double>(), stats.ptr<float>(), int(rows), int(e)));
  }
  with_cpu_scalar(op, stats, [&](auto s) { total.ptr<double>()[0] += aux_loss_cpu(op, stats.ptr<decltype(s)>(), rows, e); });
}

void router_step_statistics(Tensor totals, Tensor stats, bool global_form, Stream stream) {
  const char* op = "router_step_statistics";
  const std::array<int64_t, 2> size = statistics_experts(op, stats);
  const int64_t rows = size[0], e = size[1];
  expect_shape(op, "totals", totals, {e + 1});
  expect_dtype(op, "totals", totals, DType::f64);
  MARROW_CHECK(!global_form || stats.ndim == 1, "{}: the global-batch form takes one row of statistics, got {}", op, stats.shape_string());
  if (common_device(op, {{"totals", &totals}, {"stats", &stats}}) == Device::cuda) {
    expect_dtype(op, "stats", stats, DType::f32);
    MARROW_GPU_RETURN(op, stream, launch_dependent(router_step_statistics_kernel, 1, 256, 0, stream, totals.ptr<double>(), stats.ptr<float>(),
                                                   int(rows), int(e), global_form));
  }
  with_cpu_scalar(op, stats, [&](auto s) { step_statistics_cpu(totals.ptr<double>(), stats.ptr<decltype(s)>(), rows, e, global_form); });
}

void expert_bias_update(Tensor bias, Tensor totals, double rate, Stream stream) {
  const char* op = "expert_bias_update";
  expect_ndim(op, "bias", bias, 2, "[layers, experts]");
  const int64_t layers = bias.size(0), e = bias.size(1);
  expect_shape(op, "totals", totals, {layers, e + 1});
  expect_dtype(op, "bias", bias, DType::f32);
  expect_dtype(op, "totals", totals, DType::f64);
  MARROW_CHECK(std::isfinite(rate) && rate > 0, "{}: the rate must be positive and finite, got {}", op, rate);
  if (common_device(op, {{"bias", &bias}, {"totals", &totals}}) == Device::cuda) {
    if (layers == 0) return;
    MARROW_GPU_RETURN(op, stream, launch_dependent(expert_bias_update_kernel, unsigned(layers), 256, 0, stream, bias.ptr<float>(),
                                                   totals.ptr<double>(), int(e), float(rate)));
  }
  for (int64_t l = 0; l < layers; ++l) bias_update_cpu(bias.ptr<float>() + l * e, totals.ptr<double>() + l * (e + 1), e, float(rate));
}

void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Tensor stats, Stream stream) {
  RouterOptions options;
  options.normalize = normalize;
  router_backward(dlogits, dtopk_weight, probs, topk_index, topk_weight, options, aux_grad, stats, stream);
}

void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, const RouterOptions& options,
                     double aux_grad, Tensor stats, Stream stream) {
  const char* op = "router_backward";
  const std::array<int64_t, 3> size = router_sizes(op, "probs", probs, topk_index);
  const int64_t n = size[0], e = size[1], k = size[2];
  expect_shape(op, "dlogits", dlogits, {n, e});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  const int64_t rows = backward_statistics_rows(op, stats, n, e);
  MARROW_CHECK(std::isfinite(options.scale) && options.scale > 0, "{}: the routing scale must be positive and finite, got {}", op, options.scale);
  // Indices on the GPU are not checked: an entry outside [0, E) is skipped.
  if (on_gpu(op, {{"probs", &probs, DType::f32}, {"dlogits", &dlogits, DType::bf16}, {"dtopk_weight", &dtopk_weight, DType::f32},
                  {"topk_index", &topk_index, DType::i32}, {"topk_weight", &topk_weight, DType::f32}, {"stats", &stats, DType::f32}})) {
    MARROW_CHECK(e <= kMaxGpuExperts, "{}: {} experts, but the GPU kernel takes at most {}", op, e, kMaxGpuExperts);
    MARROW_GPU_RETURN(op, stream, launch_backward(dlogits, dtopk_weight, probs, topk_index, topk_weight, options, aux_grad, stats, rows, stream));
  }
  expect_indices_below(op, "topk_index", topk_index, e);
  with_cpu_scalar(op, probs, [&](auto s) {
    using T = decltype(s);
    for (int64_t r = 0; r < rows; ++r) {
      const double tokens = double(stats.ptr<T>()[r * (2 * e + 1) + 2 * e]);
      MARROW_CHECK(tokens >= double(n / rows), "{}: stats{} counts {} tokens, fewer than the {} rows of probs", op,
                   stats.ndim == 2 ? " row " + std::to_string(r) : std::string(), tokens, n / rows);
    }
    backward_cpu<T>(dlogits.ptr<T>(), dtopk_weight.ptr<T>(), probs.ptr<T>(), topk_index.ptr<int32_t>(), topk_weight.ptr<T>(),
                    stats.ptr<T>(), rows, n, e, k, options.normalize, options.scale, aux_grad);
  });
}

}  // namespace marrow
