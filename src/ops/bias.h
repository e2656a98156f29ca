// Additive biases of linear layers (GPT-OSS's projections and experts carry them; Qwen3's do not).
// The forward adds a bias row to every row of y in place, after the bias-free linear op wrote it;
// the backward sums dy's rows, each column in row order (deterministic whatever the thread count).
// The grouped forms serve the experts' rows, grouped by expert as in grouped_linear.h.
// CPU only so far (f32 or f64, one dtype for all tensors); the sums run in double.
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[n, :] += bias for every row n of y [N, O].
void bias_forward(Tensor y, Tensor bias, Stream stream = {});
// dbias [O] += sum over rows of dy [N, O] (overwrite: = instead of +=), each column summed in row order.
void bias_backward(Tensor dbias, Tensor dy, bool overwrite = false, Stream stream = {});
// Per expert: rows [offsets[e], offsets[e + 1]) of y [R, O] get bias[e, :] (bias [E, O], offsets i32 [E + 1] as grouped_linear's expert_offsets).
void grouped_bias_forward(Tensor y, Tensor bias, Tensor expert_offsets, Stream stream = {});
// dbias[e, :] (+)= the sum of dy's rows of expert e, each row times row_scale[r] when given ([R]:
// GPT-OSS's routing weights, whose copies reach the experts unweighted); an expert with no rows gets
// zeros when overwriting. Accumulating, an expert with no rows keeps its slice untouched.
void grouped_bias_backward(Tensor dbias, Tensor dy, Tensor expert_offsets, bool overwrite = false, Tensor row_scale = {},
                           Stream stream = {});
// dtopk_weight[t, j] += dot(dy[r], bias[e]) for r = copy_row[t, j] (not -1) and e the expert of
// row r: the part of a routing weight's gradient that a bias added after the down projection brings
// (y[r] = act[r] W_e + bias[e] is what the weight multiplies).
void grouped_bias_dot_add(Tensor dtopk_weight, Tensor dy, Tensor bias, Tensor expert_offsets, Tensor copy_row, Stream stream = {});

}  // namespace marrow
