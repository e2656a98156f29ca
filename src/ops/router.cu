#include "ops/router.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "ops/common.h"

namespace marrow {

namespace {

std::vector<int64_t> copies_per_expert(const int32_t* idx, int64_t copies, int64_t experts) {
  std::vector<int64_t> count(experts, 0);
  for (int64_t i = 0; i < copies; ++i) ++count[idx[i]];
  return count;
}

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
T aux_loss_cpu(const T* probs, const int32_t* topk_index, int64_t n, int64_t e, int64_t k) {
  std::vector<int64_t> count = copies_per_expert(topk_index, n * k, e);
  std::vector<double> prob_sum(e, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < e; ++i) prob_sum[i] += probs[t * e + i];
  double loss = 0;
  for (int64_t i = 0; i < e; ++i) loss += double(count[i]) / double(n) * (prob_sum[i] / double(n));
  return T(double(e) * loss);
}

// Gradient with respect to the probabilities, then through the softmax:
//   normalized weights w_j = p_j / S (S = sum of the top-k probs): dp_j = (g_j - sum_m g_m w_m) / S;
//   aux loss: d/dp[t, e] = E * f_e / T = E * count_e / T^2, scaled by aux_grad;
//   softmax: dlogits = p * (dp - sum_e p * dp).
template <typename T>
void backward_cpu(T* dlogits, const T* dtopk_weight, const T* probs, const int32_t* topk_index, const T* topk_weight, int64_t n,
                  int64_t e, int64_t k, bool normalize, double aux_grad) {
  std::vector<int64_t> count = copies_per_expert(topk_index, n * k, e);
  const double aux_scale = aux_grad * double(e) / (double(n) * double(n));
  std::vector<double> dp(e);
  for (int64_t t = 0; t < n; ++t) {
    const T *p = probs + t * e, *g = dtopk_weight + t * k, *w = topk_weight + t * k;
    const int32_t* idx = topk_index + t * k;
    for (int64_t i = 0; i < e; ++i) dp[i] = aux_scale * double(count[i]);
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
  MARROW_CHECK(scores.ndim == 2, "{}: {} must be [tokens, experts], got {}", op, scores_name, scores.shape_string());
  MARROW_CHECK(topk_index.ndim == 2, "{}: topk_index must be [tokens, k], got {}", op, topk_index.shape_string());
  const int64_t n = scores.size(0), e = scores.size(1), k = topk_index.size(1);
  expect_shape(op, "topk_index", topk_index, {n, k});
  expect_dtype(op, "topk_index", topk_index, DType::i32);
  MARROW_CHECK(1 <= k && k <= e, "{}: k = {} must be between 1 and the number of experts {}", op, k, e);
  return {n, e, k};
}

}  // namespace

void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream) {
  const char* op = "router_forward";
  auto [n, e, k] = router_sizes(op, "logits", logits, topk_index);
  expect_shape(op, "probs", probs, {n, e});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_same_dtype(op, {{"logits", &logits}, {"probs", &probs}, {"topk_weight", &topk_weight}});
  if (common_device(op, {{"logits", &logits}, {"probs", &probs}, {"topk_index", &topk_index}, {"topk_weight", &topk_weight}}) ==
      Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(probs.ptr<T>(), topk_index.ptr<int32_t>(), topk_weight.ptr<T>(), logits.ptr<T>(), n, e, k, normalize);
  });
}

void router_aux_loss(Tensor loss, Tensor probs, Tensor topk_index, Stream stream) {
  const char* op = "router_aux_loss";
  auto [n, e, k] = router_sizes(op, "probs", probs, topk_index);
  MARROW_CHECK(n > 0, "{}: probs has no tokens, so the expert fractions are undefined", op);
  expect_shape(op, "loss", loss, {1});
  expect_same_dtype(op, {{"probs", &probs}, {"loss", &loss}});
  if (common_device(op, {{"probs", &probs}, {"topk_index", &topk_index}, {"loss", &loss}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  expect_indices_below(op, "topk_index", topk_index, e);
  with_cpu_scalar(op, probs, [&](auto s) {
    using T = decltype(s);
    loss.ptr<T>()[0] = aux_loss_cpu<T>(probs.ptr<T>(), topk_index.ptr<int32_t>(), n, e, k);
  });
}

void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Stream stream) {
  const char* op = "router_backward";
  auto [n, e, k] = router_sizes(op, "probs", probs, topk_index);
  expect_shape(op, "dlogits", dlogits, {n, e});
  expect_shape(op, "dtopk_weight", dtopk_weight, {n, k});
  expect_shape(op, "topk_weight", topk_weight, {n, k});
  expect_same_dtype(op,
                    {{"probs", &probs}, {"dlogits", &dlogits}, {"dtopk_weight", &dtopk_weight}, {"topk_weight", &topk_weight}});
  if (common_device(op, {{"probs", &probs},
                         {"dlogits", &dlogits},
                         {"dtopk_weight", &dtopk_weight},
                         {"topk_index", &topk_index},
                         {"topk_weight", &topk_weight}}) == Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  expect_indices_below(op, "topk_index", topk_index, e);
  with_cpu_scalar(op, probs, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dlogits.ptr<T>(), dtopk_weight.ptr<T>(), probs.ptr<T>(), topk_index.ptr<int32_t>(), topk_weight.ptr<T>(), n,
                    e, k, normalize, aux_grad);
  });
}

}  // namespace marrow
