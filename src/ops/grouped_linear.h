// The expert linear layer (grouped GEMM): rows [expert_offsets[e], expert_offsets[e + 1]) of x
// belong to expert e and use its weight in Hugging Face's layout [O, I]:
//   y[r, :] = weight[e] @ x[r, :]   (y = x W_e^T per group)
// The groups are consecutive, cover all R rows, and may be empty (an expert no token chose).
// expert_offsets[E + 1] is i32 and always on the host, even when the data is on the GPU: the
// grouped GEMM needs the group sizes on the host to launch.
// GPU: x, weight, y, dy, dx bf16; dweight f32. Forward and backward_input are one
// cublasGemmGroupedBatchedEx call (fp32 compute) when O and I are multiples of 8; backward_weight is
// an own tensor-core kernel that adds into the fp32 gradient deterministically (one block per tile).
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[R, O] from x[R, I] and weight[E, O, I].
void grouped_linear_forward(Tensor y, Tensor x, Tensor weight, Tensor expert_offsets, Stream stream = {});

// dx[R, I] = dy W_e per group, overwritten.
void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor weight, Tensor expert_offsets, Stream stream = {});

// dweight[e] += dy_e^T x_e, accumulated (+=) as every weight gradient in Marrow is; an expert with
// no rows leaves its slice untouched. overwrite = true writes dweight[e] = dy_e^T x_e instead (zero
// for an expert without rows): the first micro-batch of a step, which saves zeroing the expert
// gradients and reading those zeros back.
void grouped_linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, bool overwrite = false,
                                    Stream stream = {});

}  // namespace marrow
