// A bias-free linear layer with the weight in Hugging Face layout [out, in], so checkpoints load
// without transposes:  y = x W^T,  y[n, o] = sum_i x[n, i] * W[o, i].
// Every projection of the models is one of these (QKV, attention output, LM head); the backward is
// split in two so the schedule can defer the weight gradient to fill pipeline bubbles.
// GPU (cuBLASLt, fp32 compute): x, weight, dy, dx bf16; y bf16, or f32 for the router's logits;
// dweight f32, accumulated by the GEMM itself (beta = 1), or written (beta = 0).
// Every tensor may instead carry a leading batch dimension B (all of them the same B): B independent
// products of contiguous matrices, one strided-batched GEMM on the GPU (Muon's Newton-Schulz over a
// layer's experts).
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[N, O] from x[N, I] and weight[O, I]. y may not alias x or weight.
void linear_forward(Tensor y, Tensor x, Tensor weight, Stream stream = {});

// dx[N, I] = dy[N, O] W, overwritten; accumulate = true adds it to dx (on the GPU the GEMM's beta = 1:
// dx's old bf16 values join the f32 sum, rounded once). dx may not alias dy or weight.
void linear_backward_input(Tensor dx, Tensor dy, Tensor weight, bool accumulate = false, Stream stream = {});

// dweight[O, I] += dy[N, O]^T x[N, I], accumulated as every weight gradient in Marrow is;
// overwrite = true writes it instead (dweight's old values unread: the GEMM's beta = 0), the bits of
// accumulating into zeros.
void linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, bool overwrite = false, Stream stream = {});

}  // namespace marrow
