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
// Besides attention, only ops that carry something along the sequence see other tokens, through the
// runner's SequenceChain (Qwen3.5's delta rule passes its state, its convolution reads the tokens
// before each piece); every other op of a model must stay per token: under context parallelism it
// sees only the local zigzag share (batch.seq = seq_len / cp, true `positions`).
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

// The local tokens of each sequence are `pieces` runs of consecutive positions (the zigzag split's
// two chunks): piece p is local tokens [p n, (p + 1) n), n = S_local / pieces. The chain passes what
// crosses a piece boundary between the members holding neighbouring pieces, so the pieces compute in
// sequence order along the members (no overlap: a linear recurrence's pieces wait for each other).
struct SequenceChain {
  int64_t pieces = 1;
  // Calls step(p, final) for the local pieces in sequence order. Before each call initial[p] (initial
  // seen as [pieces, ...]) holds the state the piece before ended with (zeros for the sequence's
  // first); step writes its piece's final state into `final` (shaped as initial[p]), which goes on.
  std::function<void(Tensor initial, const std::function<void(int64_t piece, Tensor final)>& step)> forward;
  // The reverse order: d_final[p] holds the gradient reaching piece p's final state (zeros for the
  // sequence's last piece); step writes the gradient of its initial state into d_initial.
  std::function<void(Tensor d_final, const std::function<void(int64_t piece, Tensor d_initial)>& step)> backward;
  // history [B, pieces, n, F] (overwritten): the n tokens of x [B, S_local, F] before each local piece
  // (zeros before the sequence's start); n <= S_local / pieces.
  std::function<void(Tensor history, Tensor x)> previous_tokens;
  // dx [B, S_local, F] += the gradient dhistory [B, pieces, n, F] of every piece's history, each
  // history token's share reaching the member that holds it.
  std::function<void(Tensor dx, Tensor dhistory)> previous_tokens_backward;
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
  SequenceChain chain;
};

}  // namespace marrow
