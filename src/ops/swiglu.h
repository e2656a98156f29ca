// SwiGLU, the expert MLP's activation, on the fused gate/up projection:
//   gate_up[R, 2I] holds gate in columns [0, I) and up in [I, 2I);  out = silu(gate) * up,
//   silu(g) = g * sigmoid(g).
// The backward recomputes the activation from gate_up, so the forward saves nothing.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out[R, I] from gate_up[R, 2I].
void swiglu_forward(Tensor out, Tensor gate_up, Stream stream = {});

// dgate_up[R, 2I] (overwritten) from dout[R, I]:
//   dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dout * silu(g).
void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, Stream stream = {});

// The experts' backward with one expert-parallel rank, where the routing weights are applied here
// rather than in combine. Combine adds w[t, j] * y[r] with y[r] = act[r] W_down^T (r = copy_row[t, j]);
// by linearity d loss / d w[t, j] = dot(dout[t], y[r]) = dot(dact[r], act[r]), where dact[r] =
// dout[t] W_down is the down projection's input gradient of the unweighted copy. So the backward
// needs the SwiGLU output (computed again here anyway), not y_perm (R x H, the largest activation a
// layer would keep: 512 MiB at 16,384 tokens). In one pass over each named row r:
//   dtopk_weight[t, j] = dot(dact[r], silu(gate) * up)     (an entry of -1 gets 0)
//   act[r] = w[t, j] * silu(gate) * up                       (the down projection's weight gradient reads it)
//   dgate_up[r] = swiglu_backward of w[t, j] * dact[r]
// copy_row[T, K] (i32) names each row of gate_up[R, 2I] at most once (dispatch's plan); rows no
// entry names are not written. On the GPU each intermediate is rounded to bf16 where the three
// separate steps (swiglu_forward, the weighting, swiglu_backward) would round it, so the results
// are theirs. GPU: act, dact, gate_up, dgate_up bf16; topk_weight, dtopk_weight f32.
void swiglu_weighted_backward(Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up, Tensor topk_weight,
                              Tensor copy_row, Stream stream = {});

// GPT-OSS's clamped SwiGLU (transformers' GptOssExperts._apply_gate) on Hugging Face's interleaved
// gate_up[R, 2I]: gate in the even columns 2i, up in the odd ones 2i + 1 (its gate_up_proj's layout,
// which Marrow keeps, so that its tensors are the checkpoint's):
//   g = min(gate, limit),  u = clamp(up, -limit, limit),  out = (u + 1) * g * sigmoid(alpha * g).
// The backward passes the gradient through each clamp where torch's clamp backward does, inside
// the bounds with the bounds included (gate <= limit, -limit <= up <= limit), and zero outside:
//   dgate = dout * (u + 1) * s * (1 + alpha * g * (1 - s)) * [gate <= limit],  s = sigmoid(alpha * g)
//   dup   = dout * g * s * [-limit <= up <= limit]
// limit must be positive. On the GPU all tensors are bf16 and the math is f32, clamping at the
// largest float <= limit (a bf16 value passes a clamp exactly where it does on the CPU).
void clamped_swiglu_forward(Tensor out, Tensor gate_up, double alpha, double limit, Stream stream = {});
// dgate_up[R, 2I] (overwritten) from dout[R, I].
void clamped_swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, double alpha, double limit, Stream stream = {});
// swiglu_weighted_backward for the clamped SwiGLU: dtopk_weight[t, j] = dot(dact[r], act_r) (the
// down projection's bias term is grouped_bias_dot_add's), act[r] = w act_r, row_weight[r] = w (for
// the down bias's gradient), dgate_up[r] = clamped_swiglu_backward of w dact[r]. On the GPU rounded
// as swiglu_weighted_backward; act, dact, gate_up, dgate_up bf16; topk_weight, dtopk_weight,
// row_weight[R] f32.
void clamped_swiglu_weighted_backward(Tensor dgate_up, Tensor act, Tensor row_weight, Tensor dtopk_weight, Tensor dact, Tensor gate_up,
                                      Tensor topk_weight, Tensor copy_row, double alpha, double limit, Stream stream = {});

}  // namespace marrow
