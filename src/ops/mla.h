// DeepSeek-V2's multi-head latent attention (MLA), the steps between its projections and the
// attention op, as transformers' DeepseekV2Attention computes them. Each head's query and key are
// [nope (Dn) | rope (Dr)]; the rope parts are rotated by DeepSeek's interleaved RoPE
// (apply_rotary_emb: view_as_complex), which pairs ADJACENT elements, unlike rotate_half (ops/rope.h):
//   y[2j]     = x[2j] * cos - x[2j + 1] * sin
//   y[2j + 1] = x[2j] * sin + x[2j + 1] * cos,   angle = position * inv_freq_j, j < Dr / 2,
// with inv_freq = rope_inverse_frequencies(Dr, rope) (transformers sets head_dim = qk_rope_head_dim)
// and cos, sin each float32 cos(angle) * float(rope_attention_scaling(rope)), the values and
// roundings of ops/rope.h. The keys' rope part is one tensor k_pe [T, Dr] shared by all heads.
// The rotation is orthogonal (up to its scale), so each backward is the transpose: the rotation by
// -angle, scaled the same. Every output is overwritten. GPU: bf16 tensors, f32 math, Dr <= 512;
// CPU: f32 or f64. Dn may be 0; Dr is even and positive.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/rope.h"

namespace marrow {

// q_out[T, H, Dn + Dr] = scale * [q_nope, rotate(q_pe)] per head of q[T, H, Dn + Dr], Dr = rope_dim,
// positions[T] (i32). The model folds DeepSeek's YaRN mscale^2 (yarn_apply_mscale) into `scale`, so
// the attention op keeps its 1 / sqrt(Dn + Dr) softmax scale. The rotation rounds nothing before
// the scale (f32 throughout, one rounding to the output). q_out may alias q.
void mla_query_forward(Tensor q_out, Tensor q, Tensor positions, int64_t rope_dim, const RopeParameters& rope, double scale,
                       Stream stream = {});
// dq[T, H, Dn + Dr] = scale * [dq_out_nope, rotate^T(dq_out_pe)]: the transpose. dq may alias dq_out.
void mla_query_backward(Tensor dq, Tensor dq_out, Tensor positions, int64_t rope_dim, const RopeParameters& rope, double scale,
                        Stream stream = {});

// From kv[T, H, Dn + Dv] (kv_b_proj's output: per head k_nope, then v) and k_pe[T, Dr]:
//   k[t, h, :Dn] = kv[t, h, :Dn],   k[t, h, Dn:] = rotate(k_pe[t]) for every h,   v[t, h, :] = kv[t, h, Dn:].
// k [T, H, Dn + Dr] and v [T, H, Dv] alias neither kv nor k_pe.
void mla_key_value_forward(Tensor k, Tensor v, Tensor kv, Tensor k_pe, Tensor positions, const RopeParameters& rope, Stream stream = {});
// dkv[T, H, Dn + Dv] = [dk[t, h, :Dn], dv[t, h, :]] and dk_pe[T, Dr] = rotate^T(sum over h of
// dk[t, h, Dn:]): the heads summed in f32 (f64 on the CPU's f64 path) in head order, deterministic,
// then rotated once (the rotation is linear, so that is the sum of the rotated heads).
void mla_key_value_backward(Tensor dkv, Tensor dk_pe, Tensor dk, Tensor dv, Tensor positions, const RopeParameters& rope,
                            Stream stream = {});

}  // namespace marrow
