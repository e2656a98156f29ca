// The gated delta rule of Gated DeltaNet (Qwen3.5's linear attention), as transformers'
// torch_chunk_gated_delta_rule computes it with use_qk_l2norm_in_kernel. Per sequence b and value
// head h (served by key head h / (Hv / Hk): each query/key head serves Hv / Hk consecutive value
// heads), with a state S [Dk, Dv] that starts at initial_state (zeros when not given):
//   q_t = l2norm(q_t) * Dk^-0.5,  k_t = l2norm(k_t),   l2norm(x) = x / sqrt(sum x^2 + 1e-6)
//   S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t
// g_t <= 0 is the log decay, beta_t in (0, 1) the write strength. The op computes it in chunks of
// C = 64 tokens (the flash-linear-attention algorithm: within a chunk the WY/UT representation of
// the rank-one updates, one triangular solve, then one pass over the chunks carrying S) and in f32
// throughout, whatever the tensors' dtype; the backward computes again what it needs from the inputs
// (the chunk states), so the forward saves nothing.
// qkv is the causal convolution's output as the model holds it: per token the Hk * Dk query
// features, the Hk * Dk key features, then the Hv * Dv value features.
// GPU: qkv, o bf16; g, beta, states f32; Dk, Dv <= 128; the chunk products on tensor cores (bf16
// operands, f32 sums), the states carried from chunk to chunk and the triangular solves in f32;
// deterministic. CPU: all f32 or all f64 (the reference, chunked as above; gated_delta_recurrent is
// the step-by-step recurrence the tests compare it with).
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

// The shapes of one gated delta call: B sequences of S tokens, Hk query/key heads of Dk, Hv value heads of Dv.
struct GatedDeltaShape {
  int64_t batch, seq, key_heads, key_dim, value_heads, value_dim;
};

// o[B, S, Hv, Dv] from qkv[B, S, 2 Hk Dk + Hv Dv], g[B, S, Hv], beta[B, S, Hv] (key_heads, key_dim
// name the split of qkv; the rest comes from o). initial_state [B, Hv, Dk, Dv] when given; when
// final_state [B, Hv, Dk, Dv] is given it receives S after the last token. chunk: tokens a chunk
// (the GPU takes 64 only; the CPU any positive size, the tests vary it).
void gated_delta_forward(Tensor o, Tensor final_state, Tensor qkv, Tensor g, Tensor beta, int64_t key_heads, int64_t key_dim,
                         Tensor initial_state = {}, int64_t chunk = 64, Stream stream = {});

// dqkv[B, S, 2 Hk Dk + Hv Dv], dg[B, S, Hv], dbeta[B, S, Hv] (all overwritten) from do[B, S, Hv, Dv]
// and the forward's inputs; d_final_state, when given, is the gradient reaching the final state;
// d_initial_state, when given, receives the initial state's gradient (overwritten).
void gated_delta_backward(Tensor dqkv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor d_out, Tensor qkv, Tensor g, Tensor beta,
                          int64_t key_heads, int64_t key_dim, Tensor initial_state = {}, Tensor d_final_state = {}, int64_t chunk = 64,
                          Stream stream = {});

// The step-by-step recurrence above (CPU only, f32 or f64): the reference the chunked op is tested
// against, forward and backward (the backward walks the tokens in reverse, recomputing the states).
void gated_delta_recurrent_forward(Tensor o, Tensor final_state, Tensor qkv, Tensor g, Tensor beta, int64_t key_heads, int64_t key_dim,
                                   Tensor initial_state = {});
void gated_delta_recurrent_backward(Tensor dqkv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor d_out, Tensor qkv, Tensor g,
                                    Tensor beta, int64_t key_heads, int64_t key_dim, Tensor initial_state = {}, Tensor d_final_state = {});

// Device bytes the GPU backward allocates for a call of this shape (marrow estimate, activation_bytes).
int64_t gated_delta_backward_scratch(const GatedDeltaShape& shape);

}  // namespace marrow
