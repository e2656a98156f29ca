// The Qwen3-MoE router as Hugging Face computes it, per token t over E experts:
//   probs[t, :]       = softmax(logits[t, :])
//   topk_index[t, :]  = the K experts of highest probability, highest first; equal probabilities go
//                       to the lower expert index, so the choice is a pure function of the logits
//   topk_weight[t, j] = probs[t, topk_index[t, j]], divided by the sum over j when `normalize`
//                       (config norm_topk_prob)
// and the layer's load-balance loss, from routing statistics. 1 <= K <= E. probs is saved by the
// forward for the backward.
// On the GPU: logits, probs, topk_weight, dtopk_weight and the statistics f32, dlogits bf16, E <= 512.
#pragma once
#include "core/tensor.h"

namespace marrow {

// probs[T, E], topk_index[T, K] (i32), topk_weight[T, K] from logits[T, E].
void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream = {});

// The routing statistics of the tokens in probs, all that the load-balance loss and its gradient
// need: stats[2E + 1] = [copies routed to each expert (exact integers), sum over tokens of
// probs[t, e] (per expert, in token order), number of tokens T]. Statistics of disjoint token sets
// (processes, shards of a micro-batch) add element-wise into those of their union, so the engine may
// sum them over processes before router_aux_loss and router_backward. stats is f32 on the GPU
// (counts exact below 2^24) and probs' dtype on the CPU. T may be 0.
void router_statistics(Tensor stats, Tensor probs, Tensor topk_index, Stream stream = {});

// One layer's load-balance loss, E * sum_e f_e * P_e, with f_e = (copies routed to e) / T and
// P_e = (sum_t probs[t, e]) / T, from statistics (on any device, read on the host; computed in
// double); perfectly balanced routing gives K. Hugging Face's formula on one layer's statistics: the
// engine averages the layers' losses (and a step's micro-batches'), as Megatron-LM and PithTrain do,
// where transformers' load_balancing_loss_func pools all layers' statistics before the product (its
// value differs by ~1-5% on the tiny models, the router's gradients more).
double router_aux_loss(Tensor stats, Stream stream = {});
// total[0] += router_aux_loss(stats), on stats' device and without reading anything on the host
// (the engine reads the sum once per micro-batch, not once per layer). total: f64 [1].
void router_aux_loss_add(Tensor total, Tensor stats, Stream stream = {});

// dlogits[T, E] (overwritten) from dtopk_weight[T, K], the gradient of the routing weights, and
// aux_grad = d(total loss) / d(the aux loss of stats). The aux gradient flows through P_e only
// (f_e is a count, and the top-k choice is piecewise constant in the logits):
// d/dprobs[t, e] = aux_grad * E * count_e / T^2 with count_e and T read from stats, which may hold
// more tokens than probs (summed over processes); with probs' own statistics it is this layer's.
void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Tensor stats, Stream stream = {});

}  // namespace marrow
