// The Qwen3-MoE router as Hugging Face computes it, per token t over E experts:
//   probs[t, :]       = softmax(logits[t, :])
//   topk_index[t, :]  = the K experts of highest probability, highest first; equal probabilities go
//                       to the lower expert index, so the choice is a pure function of the logits
//   topk_weight[t, j] = probs[t, topk_index[t, j]], divided by the sum over j when `normalize`
//                       (config norm_topk_prob)
// and the layer's load-balance loss. 1 <= K <= E. probs is saved by the forward for the backward.
// On the GPU: logits, probs, topk_weight, dtopk_weight and the loss f32, dlogits bf16, E <= 512.
#pragma once
#include "core/tensor.h"

namespace marrow {

// probs[T, E], topk_index[T, K] (i32), topk_weight[T, K] from logits[T, E].
void router_forward(Tensor probs, Tensor topk_index, Tensor topk_weight, Tensor logits, bool normalize, Stream stream = {});

// One layer's load-balance loss in Hugging Face's form, E * sum_e f_e * P_e, with
// f_e = (copies routed to e) / T and P_e = mean_t probs[t, e]; perfectly balanced routing gives K.
// loss is a 1-element tensor of probs' dtype.
void router_aux_loss(Tensor loss, Tensor probs, Tensor topk_index, Stream stream = {});

// dlogits[T, E] (overwritten) from dtopk_weight[T, K], the gradient of the routing weights, and
// aux_grad = d(total loss) / d(this layer's aux loss). The aux gradient flows through P_e only:
// f_e is a count, and the top-k choice is piecewise constant in the logits.
void router_backward(Tensor dlogits, Tensor dtopk_weight, Tensor probs, Tensor topk_index, Tensor topk_weight, bool normalize,
                     double aux_grad, Stream stream = {});

}  // namespace marrow
