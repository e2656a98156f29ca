// The sigmoid gates of Qwen3.5-MoE, elementwise:
// - Gated DeltaNet's decay and write strength from in_proj_b and in_proj_a's outputs (one GEMM: b in
//   columns [0, Hv), a in [Hv, 2 Hv)):  beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
//   (softplus as torch's: x above 20 passes through). On the GPU beta is rounded to bf16 (torch's
//   b.sigmoid() in bf16) and g is not (transformers computes it in f32); both are stored f32.
// - The gated attention's query/gate split: q_proj's output per head is [query (D) | gate (D)].
// - y = x * sigmoid(gate): the attention output's gate (gate of x's shape) and the shared expert's
//   (gate [N, 1], one per row). On the GPU the sigmoid is rounded to bf16 before the product (torch's
//   bf16 sigmoid, then the bf16 product).
// GPU: bf16 activations, f32 math; the backwards are the exact f32 derivatives at the bf16 inputs
// (nothing rounded between), one rounding a result; dg, dbeta, dA_log, ddt_bias f32. CPU: f32 or f64.
#pragma once
#include "core/tensor.h"

namespace marrow {

// g[T, Hv], beta[T, Hv] from ba[T, 2 Hv], A_log[Hv], dt_bias[Hv].
void delta_gates_forward(Tensor g, Tensor beta, Tensor ba, Tensor A_log, Tensor dt_bias, Stream stream = {});
// dba[T, 2 Hv] overwritten; dA_log[Hv], ddt_bias[Hv] accumulated (+=); from dg, dbeta [T, Hv].
void delta_gates_backward(Tensor dba, Tensor dA_log, Tensor ddt_bias, Tensor dg, Tensor dbeta, Tensor ba, Tensor A_log, Tensor dt_bias,
                          Stream stream = {});

// q[T, H, D] and gate[T, H, D] from qg[T, H, 2D]; the backward interleaves them again (dqg overwritten).
void split_query_gate_forward(Tensor q, Tensor gate, Tensor qg, Stream stream = {});
void split_query_gate_backward(Tensor dqg, Tensor dq, Tensor dgate, Stream stream = {});

// y[N, D] = x[N, D] * sigmoid(gate), gate [N, D] or [N, 1]. y may alias x.
void sigmoid_gate_forward(Tensor y, Tensor x, Tensor gate, Stream stream = {});
// dx[N, D] and dgate (gate's shape; summed over the row when [N, 1]) overwritten from dy[N, D]. dx may alias dy.
void sigmoid_gate_backward(Tensor dx, Tensor dgate, Tensor dy, Tensor x, Tensor gate, Stream stream = {});

}  // namespace marrow
