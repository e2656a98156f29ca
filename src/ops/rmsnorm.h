// RMSNorm as Qwen3 applies it to hidden states and, per head, to queries and keys (QK-norm):
//   y[i, :] = x[i, :] * rstd[i] * weight,   rstd[i] = 1 / sqrt(mean_j x[i, j]^2 + eps)
// Rows are independent, so per-head norm is the same op on x viewed as [tokens * heads, head_dim].
// rstd is saved by the forward for the backward.
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[N, D], rstd[N] from x[N, D] and weight[D]. y may not alias x.
void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, double eps, Stream stream = {});

// dx[N, D] is overwritten; dweight[D] is accumulated (+=), as every weight gradient in Marrow is.
void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Tensor rstd, Stream stream = {});

}  // namespace marrow
