// The causal attention op of attention.h on cuDNN's fused SDPA graphs (cuDNN frontend), the GPU
// alternative to attention.cu's own kernels: same tensors, layouts and meaning, including lse
// (natural log of the sum of exp of the scaled scores, f32 [B, Hq, S]), so either forward pairs
// with either backward. cuDNN's Hopper kernels use wgmma and TMA, which the own kernels (mma.sync)
// do not.
// Deterministic: the backward runs cuDNN's deterministic algorithm, which writes dP = dO V^T to a
// bf16 workspace of B x Hq x S' x S' (S' = S rounded up to 64; 1 GiB at S = 4096 with 32 heads)
// instead of adding dQ with float atomics. When that workspace would pass the cap below, the
// backward runs one key/value head group at a time (the workspace shrinks by the group count);
// past the cap even for one group the own kernels run the backward.
// Graphs are built once per shape (the first call of a shape takes ~0.1-1 s) and kept.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

// The largest dP workspace the backward may take (bytes): one key/value head group at S = 16384
// (8 x 16384^2 x 2 B = 4 GiB).
inline constexpr int64_t kCudnnAttentionWorkspaceCap = int64_t(4) << 30;

// Whether cuDNN serves these sizes: the forward, more than one position and head_dim 64 or 128;
// the backward, also its workspace within the cap for some split of the key/value heads. Past it
// the backward runs on the own kernels from cuDNN's forward (their lse is the same).
bool cudnn_attention_forward_supports(int64_t seq, int64_t head_dim);
bool cudnn_attention_backward_supports(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       bool deterministic = true);

// The GPU scratch the backward takes from the stream-ordered pool (the largest of its calls).
int64_t cudnn_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         bool deterministic = true);

// out[B, S, Hq, D] and lse[B, Hq, S] from q[B, S, Hq, D], k, v[B, S, Hkv, D]; bf16 on the GPU.
void cudnn_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, Stream stream);

// dq, dk, dv overwritten (bf16), from the forward's out and lse. deterministic = false runs
// cuDNN's default algorithm (dQ added with float atomics into an f32 accumulator, no dP workspace):
// AttentionKernels::cudnn_nondeterministic, never a default.
void cudnn_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, Stream stream, bool deterministic = true);

}  // namespace marrow
