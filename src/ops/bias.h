// Additive biases of linear layers (GPT-OSS's projections and experts carry them; Qwen3's do not).
// The forward adds a bias row to every row of y in place, after the bias-free linear op wrote it;
// the backward sums dy's rows, each column in row order (deterministic whatever the thread count).
// The grouped forms serve the experts' rows, grouped by expert as in grouped_linear.h.
// CPU: f32 or f64, one dtype for all tensors; the sums run in double.
// GPU (math in f32): y, dy, bias bf16 (activations and working weights; bias_forward's y may be f32,
// the router's logits); dbias f32 (the gradient:
// written with overwrite, else added to); row_scale, dtopk_weight f32; copy_row i32 on the GPU;
// expert_offsets i32 as grouped_linear takes them, on the GPU (one process: nothing waits) or on
// the host (expert parallelism: uploaded in stream order); those on the GPU are not checked, and
// rows outside [offsets[0], offsets[E]) then belong to no expert (left alone; dot_add writes NaN
// for a copy of such a row, or of a row outside [0, R)). The sums are deterministic: each column in
// a fixed order (16 strided slices of the rows in row order, the slices added in order), no atomics.
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
