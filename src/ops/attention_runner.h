// The hook through which a model's causal attention runs, so that a model computes attention
// without knowing of processes. A micro-batch (its Batch) carries a runner or none:
// - none: the tokens are whole sequences and the model calls the one-process op (ops/attention.h);
// - a runner: the tokens are this process's share of sequences cut over a group (context
//   parallelism), and the runner computes their attention with the others' keys and values
//   (parallel/ring_attention.h's ring_attention_runner).
// Both take and give the shapes and dtypes of ops/attention.h's attention_forward/backward over the
// local tokens, with a variant (sinks, sliding window): q, out, dq, dout [B, S_local, Hq, D], k, v,
// dk, dv [B, S_local, Hkv, D], lse [B, Hq, S_local]; dq, dk, dv are overwritten, dsinks [Hq] (given
// exactly when the variant has sinks) is added to with this process's share.
// Only attention sees other tokens of the sequence: every other op of a model must stay per token.
// An op that mixes tokens along the sequence (a convolution, a sequence-wide norm) would see only the
// local zigzag share under context parallelism (batch.seq = seq_len / cp, true `positions`).
#pragma once
#include <functional>

#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

struct AttentionRunner {
  std::function<void(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant)> forward;
  std::function<void(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                     const AttentionVariant& variant)>
      backward;
};

}  // namespace marrow
