// Causal grouped-query attention (GQA), softmax scale 1/sqrt(D):
//   s[i, j] = q_i . k_j / sqrt(D) for j <= i,   out_i = sum_j softmax_j(s[i, :]) v_j,
// per batch row and query head. Query head h reads key/value head h / (Hq / Hkv), so consecutive
// query heads share a key/value head, as in Hugging Face's repeat_kv; Hq must be a multiple of Hkv.
// The forward saves lse_i = log sum_j exp(s[i, j]) so the backward can rebuild the probabilities
// one row at a time (FlashAttention-2) instead of keeping the [S, S] matrix.
// GPU: q, k, v, out, dout, dq, dk, dv bf16 and lse f32 (natural log, as on the CPU); head_dim 64 or
// 128. The backward is deterministic (no atomics) and takes scratch from the stream-ordered pool:
// delta [B, Hq, S] f32 and, when Hq > Hkv, per-query-head dk, dv partials [B, S, Hq, D] f32 each.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out[B, S, Hq, D] and lse[B, Hq, S] from q[B, S, Hq, D], k[B, S, Hkv, D], v[B, S, Hkv, D].
// out may not alias q, k or v.
void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, Stream stream = {});

// dq, dk, dv, all overwritten, with the shapes of q, k, v; out and lse are the forward's. The
// gradients may not alias any input.
void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                        Tensor lse, Stream stream = {});

}  // namespace marrow
