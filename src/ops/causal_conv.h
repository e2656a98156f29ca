// Gated DeltaNet's short convolution (transformers' causal_conv1d_fn with activation "silu"): each
// channel c of a sequence convolved with its own K taps over the current and K - 1 earlier tokens,
// zeros before the sequence's start, then SiLU:
//   y[b, s, c] = silu(sum_{j < K} weight[c, j] * x[b, s - K + 1 + j, c])
// weight is Hugging Face's conv1d.weight [C, 1, K] viewed as [C, K]. GPU: bf16 tensors (dweight f32),
// the sum in f32 rounded to bf16 before the SiLU (as torch's bf16 conv then silu); K <= 8. The
// backward is the exact f32 derivative at the bf16 inputs (the pre-activation unrounded), one
// rounding a result. CPU: f32 or f64.
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[B, S, C] from x[B, S, C] and weight[C, K]. y may not alias x.
void causal_conv_forward(Tensor y, Tensor x, Tensor weight, Stream stream = {});

// dx[B, S, C] overwritten, dweight[C, K] accumulated (+=, as every weight gradient), from dy[B, S, C]:
// the SiLU's gradient at the recomputed pre-activation, then the convolution's transpose. dx may
// alias neither dy nor x (a token's dx reads the K - 1 tokens after it).
void causal_conv_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Stream stream = {});

}  // namespace marrow
