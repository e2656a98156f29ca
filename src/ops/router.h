// The Qwen3-MoE and DeepSeek-V2 routers as Hugging Face computes them, per token t over E experts:
//   probs[t, :]       = softmax(logits[t, :])
//   topk_index[t, :]  = the K experts of highest probability, highest first; equal probabilities go
//                       to the lower expert index, so the choice is a pure function of the logits
//   topk_weight[t, j] = probs[t, topk_index[t, j]], divided by the sum over j when `normalize`
//                       (config norm_topk_prob), then times `scale`
// and the layer's load-balance loss, from routing statistics. 1 <= K <= E. probs is saved by the
// forward for the backward.
// DeepSeek's "group_limited_greedy" (RouterOptions::groups > 1): the experts form `groups`
// consecutive groups of E / groups, a group's score is its highest probability, and the K experts
// are chosen among the `top_groups` groups of highest score only (equal scores go to the lower group
// index). The choice is piecewise constant in the logits, so the gradient flows through the chosen
// weights' probabilities, as with one group. transformers 5 ignores norm_topk_prob for DeepSeek-V2
// (always unnormalised, times routed_scaling_factor); DeepSeek's own code and vLLM normalise when it
// is set, which `normalize` does.
// On the GPU: logits, probs, topk_weight, dtopk_weight and the statistics f32, dlogits bf16, E <= 512.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

// The bool overloads below are these with only `normalize` set, bit for bit.
struct RouterOptions {
  bool normalize = false;
  double scale = 1.0;                  // routed_scaling_factor, positive
  int64_t groups = 1, top_groups = 1;  // n_group (dividing E), topk_group; K <= top_groups * E / groups
  // DeepSeek-V3's auxiliary-loss-free balancing: f32 [E] added to the probabilities for the choice
  // of the experts (groups included) only; the weights stay the unbiased probabilities. Empty: none.
  Tensor selection_bias = {};
};

// probs[T, E], topk_index[T, K] (i32), topk_weight[T, K] from logits[T, E].
void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream = {});
void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, const RouterOptions& options, Stream stream = {});

// The routing statistics of the tokens in probs, all that the load-balance loss and its gradient
// need: stats[2E + 1] = [copies routed to each expert (exact integers), sum over tokens of
// probs[t, e] (per expert, in token order), number of tokens T]. Statistics of disjoint token sets
// (processes, shards of a micro-batch) add element-wise into those of their union, so the engine may
// sum them over processes before router_aux_loss and router_backward. stats is f32 on the GPU
// (counts exact below 2^24) and probs' dtype on the CPU. T may be 0.
void router_statistics(Tensor stats, Tensor probs, Tensor topk_index, Stream stream = {});
// Per-sequence statistics (DeepSeek's seq_aux): stats[G, 2E + 1], row g router_statistics of tokens
// [g * tokens_per_group, (g + 1) * tokens_per_group), G = T / tokens_per_group (T divisible). Rows
// add element-wise across processes too: under context parallelism each rank holds a share of every
// sequence, and the ranks' rows summed are the sequences' statistics.
void router_statistics_grouped(Tensor stats, Tensor probs, Tensor topk_index, int64_t tokens_per_group, Stream stream = {});
// Where a process's B sequences sit among those of the processes whose per-sequence statistics are
// summed: rows [first, first + B) of `total`, the other processes' rows zeros on this one, so that the
// sum is each sequence's statistics (total 0: the B rows are all there are).
struct StatisticsRows {
  int64_t first = 0, total = 0;
};

// One layer's load-balance loss, E * sum_e f_e * P_e, with f_e = (copies routed to e) / T and
// P_e = (sum_t probs[t, e]) / T, from statistics (on any device, read on the host; computed in
// double); perfectly balanced routing gives K. Hugging Face's formula on one layer's statistics: the
// engine averages the layers' losses (and a step's micro-batches'), as Megatron-LM and PithTrain do,
// where transformers' load_balancing_loss_func pools all layers' statistics before the product (its
// value differs by ~1-5% on the tiny models, the router's gradients more). Statistics [G, 2E + 1]
// give the mean over rows of each row's loss (the rows summed in order, then divided by G); [2E + 1]
// is one row.
double router_aux_loss(Tensor stats, Stream stream = {});
// The step's routing so far, for the global-batch form and the expert bias: totals (f64 [E + 1],
// zeros at the step's start) += the copies routed to each expert and the tokens, summed over the rows
// of stats ([2E + 1] or [G, 2E + 1]). With `global_form` (one row) the counts of stats become
// totals_e * T / totals_E, so that router_aux_loss and router_backward on them compute
// E * sum_e (totals_e / totals_E) * P_e and its gradient: the expert fractions of every token
// counted so far, the probabilities of this row's.
void router_step_statistics(Tensor totals, Tensor stats, bool global_form, Stream stream = {});
// DeepSeek-V3's bias update: bias[l, e] (f32 [L, E]) += rate * sign(mean_e load[l] - load[l, e]),
// load = totals[l, 0..E) (f64 [L, E + 1], router_step_statistics'); a layer without load keeps its bias.
void expert_bias_update(Tensor bias, Tensor totals, double rate, Stream stream = {});
// total[0] += router_aux_loss(stats), on stats' device and without reading anything on the host
// (the engine reads the sum once per micro-batch, not once per layer). total: f64 [1].
void router_aux_loss_add(Tensor total, Tensor stats, Stream stream = {});

// dlogits[T, E] (overwritten) from dtopk_weight[T, K], the gradient of the routing weights, and
// aux_grad = d(total loss) / d(the aux loss of stats). The aux gradient flows through P_e only
// (f_e is a count, and the top-k choice is piecewise constant in the logits):
// d/dprobs[t, e] = aux_grad * E * count_e / T^2 with count_e and T read from stats, which may hold
// more tokens than probs (summed over processes); with probs' own statistics it is this layer's.
// Statistics [G, 2E + 1]: token t of probs belongs to row t / (T / G) (T divisible by G), and its
// term is aux_grad * E * count_{g,e} / (G * T_g^2), the gradient of the mean over rows. Options:
// the routing weights' gradient goes through `scale` and the normalisation when set; the groups
// do not enter it.
void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Tensor stats, Stream stream = {});
void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, const RouterOptions& options,
                     double aux_grad, Tensor stats, Stream stream = {});

}  // namespace marrow
