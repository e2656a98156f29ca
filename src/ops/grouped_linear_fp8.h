// The expert linear layer from FP8 operands (ops/fp8.h): for the rows [expert_offsets[e],
// expert_offsets[e + 1]) of expert e,
//   y[r, n] = sum over K blocks b of  xs[b, r] ws[e, n / 128, b]  sum_{k in b} xq[r, k] wq[e, n, k]
// i.e. grouped_linear_forward of the dequantized operands. x is quantize_rows of [R, K], weight is
// quantize_blocks of [E, N, K]: the forward passes the layer's input and W [E, O, I] (N = O, K = I),
// the backward input passes dy and W's transposed quantization [E, I, O] (N = I, K = O), since
// dx = dy W. The weight gradient stays in bf16 (grouped_linear_backward_weight): it is bound by its
// f32 read-modify-write, not by its multiplies (docs/performance.md).
// GPU: y bf16; an own Hopper kernel (ops/wgmma_fp8.cuh: TMA + wgmma e4m3, 128 x 256 tiles, each K
// block promoted into f32 with its scales) when K is a multiple of 16 and N of 8 and the tensors are
// 16-byte aligned (TMA's rule), else a plain one-thread-per-output kernel; deterministic either way.
// CPU: y f32, the dequantized operands through grouped_linear_forward's reference.
// expert_offsets as for grouped_linear_forward (host, or GPU memory when the data is there).
#pragma once
#include "core/tensor.h"
#include "ops/fp8.h"

namespace marrow {

// Whether the models run their expert layers' forward and backward input through this op
// (train.fp8; off by default). For the whole process, as ops/attention.h's kernel choice.
void set_expert_fp8(bool on);
bool expert_fp8();

// y[R, N] from x (values [R, K]) and weight (values [E, N, K]).
void grouped_linear_fp8(Tensor y, Fp8Tensor x, Fp8Tensor weight, Tensor expert_offsets, Stream stream = {});

}  // namespace marrow
