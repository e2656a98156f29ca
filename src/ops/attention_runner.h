// The hook through which a model's causal attention runs, so that a model computes attention
// without knowing of processes. A micro-batch (its Batch) carries a runner or none:
// - none: the tokens are whole sequences and the model calls the one-process op (ops/attention.h);
// - a runner: the tokens are this process's share of sequences cut over a group (context
//   parallelism), and the runner computes their attention with the others' keys and values
//   (parallel/ring_attention.h's ring_attention_runner).
// Both take and give the shapes and dtypes of ops/attention.h's attention_forward/backward over the
// local tokens, with a variant (sinks, sliding window, documents): q, out, dq, dout [B, S_local, Hq, D], k, v,
// dk, dv [B, S_local, Hkv, D], lse [B, Hq, S_local]; dq, dk, dv are overwritten, dsinks [Hq] (given
// exactly when the variant has sinks) is added to with this process's share.
// A runner may also take the keys and values packed (KvExpansion: DeepSeek's MLA rotates its
// normed latent and rotated rope key, 576 values a token for V2-Lite, not 16 heads x (192 + 128)),
// expanding each block where it is used: packed [B, S_local, width], dpacked overwritten with the
// gradient of packed; documents as AttentionVariant's (empty: none).
// Only attention sees other tokens of the sequence: every other op of a model must stay per token.
// An op that mixes tokens along the sequence (a convolution, a sequence-wide norm) would see only the
// local zigzag share under context parallelism (batch.seq = seq_len / cp, true `positions`).
#pragma once
#include <functional>

#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

// expand writes k [B, S, Hkv, D] and v [B, S, Hkv, Dv] from packed [B, S, width]; expand_backward
// overwrites dpacked [B, S, width] (packed's dtype) with the gradient of packed from dk and dv (of
// packed's dtype) and adds to the expansion's weight gradients (the runner calls it once a block it
// expanded, so every member adds its queries' share).
struct KvExpansion {
  int64_t width = 0, kv_heads = 0, head_dim = 0, v_head_dim = 0;
  std::function<void(Tensor k, Tensor v, Tensor packed)> expand;
  std::function<void(Tensor dpacked, Tensor dk, Tensor dv, Tensor packed)> expand_backward;
};

struct AttentionRunner {
  std::function<void(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant)> forward;
  std::function<void(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                     const AttentionVariant& variant)>
      backward;
  std::function<void(Tensor out, Tensor lse, Tensor q, Tensor packed, const KvExpansion& kv, Tensor documents)> forward_packed;
  std::function<void(Tensor dq, Tensor dpacked, Tensor dout, Tensor q, Tensor packed, Tensor out, Tensor lse, const KvExpansion& kv,
                     Tensor documents)>
      backward_packed;
};

}  // namespace marrow
