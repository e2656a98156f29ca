// RMSNorm as Qwen3 applies it to hidden states and, per head, to queries and keys (QK-norm):
//   y[i, :] = x[i, :] * rstd[i] * weight,   rstd[i] = 1 / sqrt(mean_j x[i, j]^2 + eps)
// Rows are independent, so per-head norm is the same op on x viewed as [tokens * heads, head_dim].
// rstd is saved by the forward for the backward.
//
// Zero-centred weights (Qwen3.5's Qwen3_5MoeRMSNorm: norm(x) * (1 + weight)): the plain ops take a
// NormWeight, whose offset joins the weight in f32 (in T on the CPU) before it scales: y = x * rstd *
// (offset + weight). dweight keeps its form (d(offset + w)/dw = 1); dx uses the scale. A Tensor
// converts to one of offset 0, which keeps the plain norm's bits. rmsnorm_rope_* keep a plain weight.
//
// Two fusions save the memory passes of the op next to the norm (issue #14 item 4):
// - rmsnorm_add_forward adds the residual stream first (sum = x + residual, y = norm(sum)); the
//   backward's optional dresidual adds the residual stream's gradient to dx.
// - rmsnorm_rope_forward rotates each normalised head by RoPE (ops/rope.h): y = rope(norm(x));
//   rmsnorm_rope_backward un-rotates dy as it reads it.
// Their CPU references are the unfused ops in sequence. On the GPU they round to bf16 wherever the
// unfused sequence did (the sum before the norm reads it, the norm's output before the rotation,
// the un-rotated dy, dx before dresidual joins it) and sum in the same order with the same fmas
// (written out in the kernels), so they give the unfused sequence's bits while reading and writing
// less: no rounding changed. The backward reads the bf16 sum the forward kept.
#pragma once
#include "core/memory.h"
#include "core/tensor.h"

namespace marrow {

// The norm's weight [D] and the offset added to it (1 for Qwen3.5, 0 for the others).
struct NormWeight {
  NormWeight(Tensor w, float o = 0) : weight(w), offset(o) {}
  NormWeight(const Buffer& w, float o = 0) : weight(w), offset(o) {}
  Tensor weight;
  float offset;
};

// y[N, D], rstd[N] from x[N, D] and weight[D]. y may not alias x.
void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, NormWeight weight, double eps, Stream stream = {});

// sum[N, D] = x + residual (both [N, D]), then y[N, D], rstd[N] = rmsnorm_forward of sum: the
// residual connection and the norm after it in one pass. The norm reads sum as it is stored (bf16
// on the GPU), the very tensor the backward gets as x. sum may alias x or residual; y aliases none.
void rmsnorm_add_forward(Tensor y, Tensor sum, Tensor rstd, Tensor x, Tensor residual, NormWeight weight, double eps,
                         Stream stream = {});

// y[T, H, D] = rope_forward(rmsnorm_forward(x[T, H, D]) per head row, positions[T], theta): QK-norm
// and the rotary embedding in one pass; rstd is [T * H], weight [D]. y may not alias x. cos_sin,
// when given, is rope_cos_sin_table(positions, D, theta) (ops/rope.h): the GPU kernels then read the
// angles' cosines and sines from it rather than computing them (the same bits); the CPU path
// computes its own.
void rmsnorm_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, Tensor positions, double eps, double theta,
                          Tensor cos_sin = {}, Stream stream = {});

// dx[N, D] is overwritten; dweight[D] is accumulated (+=), as every weight gradient in Marrow is.
// dresidual[N, D], when given (not Tensor{}), is added to dx: the gradient that reaches x around the
// norm (the residual stream), as add(dx, dx, dresidual) after the plain backward would. dx may
// alias dresidual, not dy.
void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, NormWeight weight, Tensor rstd, Tensor dresidual = {},
                      Stream stream = {});

// The backward of rmsnorm_rope_forward from dy[T, H, D], the gradient of its rotated output:
// rmsnorm_backward of rope_backward(dy). dx[T, H, D] is overwritten, dweight[D] accumulated; dx may
// not alias dy. cos_sin as for rmsnorm_rope_forward.
void rmsnorm_rope_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor positions,
                           double theta, Tensor cos_sin = {}, Stream stream = {});

}  // namespace marrow
