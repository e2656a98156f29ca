// The own GPU kernels of attention.h (attention_mma.cu) behind attention.cu's entry points, which
// have checked the shapes, the block and the devices; each function here checks the GPU's dtypes and
// its kernels' limits. Without CUDA each fails in one sentence.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

// The sizes of one call: q [batch, q_seq, q_heads, head_dim], k [batch, kv_seq, kv_heads,
// head_dim], v [batch, kv_seq, kv_heads, v_dim], out [batch, q_seq, q_heads, v_dim]; element offsets
// of row i of batch row b for query head h (in q, in out), for the key/value head that serves h (in
// k, in v), and of its lse entry. The kernels here take v_dim == head_dim (attention.cu routes the
// rest to cuDNN).
struct AttentionDims {
  int64_t batch, q_seq, kv_seq, q_heads, kv_heads, head_dim, v_dim;
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * q_seq + i) * q_heads + h) * head_dim; }
  int64_t out(int64_t b, int64_t i, int64_t h) const { return ((b * q_seq + i) * q_heads + h) * v_dim; }
  int64_t kv(int64_t b, int64_t j, int64_t h) const {
    return ((b * kv_seq + j) * kv_heads + h / (q_heads / kv_heads)) * head_dim;
  }
  int64_t v(int64_t b, int64_t j, int64_t h) const { return ((b * kv_seq + j) * kv_heads + h / (q_heads / kv_heads)) * v_dim; }
  int64_t lse(int64_t b, int64_t i, int64_t h) const { return (b * q_heads + h) * q_seq + i; }
};

// The block's rows of out (bf16) and lse (f32) on the mma.sync kernels; sinks bf16 [Hq] or empty.
void mma_attention_forward(const char* op, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionDims& n,
                           const AttentionBlock& block, Tensor sinks, Stream stream);
// accumulate: the block's share added into f32 dq, dk, dv (those `grads` names); else bf16 dq, dk,
// dv overwritten (the causal op).
void mma_attention_backward(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                            Tensor out, Tensor lse, const AttentionDims& n, const AttentionBlock& block, bool accumulate,
                            AttentionGrads grads, Stream stream);
// attention_merge, attention_sinks_merge and attention_sinks_backward on the GPU (n from out).
void gpu_attention_merge(Tensor out, Tensor lse, Tensor part_out, Tensor part_lse, const AttentionDims& n, int64_t begin,
                         int64_t end, Stream stream);
void gpu_attention_sinks_merge(Tensor out, Tensor lse, Tensor sinks, const AttentionDims& n, Stream stream);
void gpu_attention_sinks_backward(Tensor dsinks, Tensor dout, Tensor out, Tensor lse, Tensor sinks, const AttentionDims& n,
                                  Stream stream);

}  // namespace marrow
