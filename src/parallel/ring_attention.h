// Context parallelism: causal attention over a sequence split across the members of the cp group,
// with the zigzag split and ring attention.
//
// Zigzag split: the S tokens are cut into 2·CP chunks; member r holds chunks r and 2·CP − 1 − r,
// so one early and one late chunk give every member the same causal work.
//
// Ring attention: each member keeps its queries while the keys and values travel around the ring
// (r sends to r + 1), the next hop posted before the current block computes so the transfer runs
// under it. With c = S / (2·CP), local tokens [0, c) = chunk r and [c, 2c) = chunk 2·CP − 1 − r,
// the block of member s's keys is (ops/attention.h's modes on sub-ranges):
//   s = r: causal over all 2c local rows;
//   s < r: queries [0, 2c) against keys [0, c) in full (chunk s precedes both local chunks);
//   s > r: queries [c, 2c) against keys [0, 2c) in full (both of s's chunks lie between r's two).
// Each block's partial (out, lse) merges into the running one by its log-sum-exp. The backward
// runs the K/V ring again beside a ring of dK/dV sums that travel with their block, each member
// adding its share, until a last hop brings them home. A block's backward computes dK/dV first so
// they travel while dq's kernel runs (one fused kernel on the GPU where it computes all three).
// Packed K/V (ops/attention_runner.h's KvExpansion): the packed blocks travel instead, each
// expanded by the member that holds it; a block's dK/dV is packed (expand_backward) before its sum
// travels on, so both rings move `width` values a token.
// GPT-OSS's variant: with a sliding window every block is cut into one per pair of chunks (the two
// local chunks are not adjacent) and pairs wholly beyond the window are skipped; sinks join once,
// after every block is merged, and each member adds its rows' share of dsinks. Packed documents
// (the variant's per-query positions in their documents) cut blocks the same way: a pair's
// distance and a query's position bound the keys it sees, so key positions need not travel.
// Numbers: on the GPU the tensors are bf16 (lse f32), the running out and the dq, dk, dv
// accumulators f32, rounded once at the end. Additions run in ring order, so results are
// deterministic for a given CP and equal the one-process op up to that order.
#pragma once
#include <cstdint>

#include "ops/attention_runner.h"
#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

class Comm;

// Where a member's tokens sit in the sequence.
struct ZigzagSplit {
  int64_t chunk = 0;              // tokens per chunk: S / (2·CP)
  int64_t first = 0, second = 0;  // the sequence positions of the member's two chunks' first tokens
  // The sequence position of the member's local token i (0 <= i < 2·chunk).
  int64_t position(int64_t i) const { return i < chunk ? first + i : second + (i - chunk); }
};

// The zigzag split of `seq` tokens for member `rank` of `ranks`; seq must be a multiple of 2·ranks.
ZigzagSplit zigzag_split(int64_t seq, int rank, int ranks);

// This member's tokens of whole[N, S, ...] (dimension 1 is the sequence: tokens [B, S], activations
// [B, S, H, D], or lse [B, H, S] seen as [B·H, S]) copied into local[N, 2·chunk, ...], on any device.
void zigzag_slice(Tensor local, Tensor whole, const ZigzagSplit& split);

// The block of member `rank`'s local_seq queries against the K/V block of member `source` (above).
AttentionBlock zigzag_block(int64_t local_seq, int rank, int source);

// out[B, Sl, Hq, Dv] and lse[B, Hq, Sl] of this member's queries q[B, Sl, Hq, D] against the keys
// k[B, Sl, Hkv, D] and values v[B, Sl, Hkv, Dv] of every member (causal over the true positions);
// Sl = S / CP. Dv may differ from D (ops/attention.h; on the GPU cuDNN runs such blocks).
void ring_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Comm& cp, const AttentionVariant& variant = {});

// dq, dk, dv (overwritten, shaped like q, k, v) of this member's tensors, from dout and the
// forward's out and lse; with sinks, dsinks [Hq] is added to with this member's rows' share.
void ring_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                             Tensor lse, const Comm& cp, const AttentionVariant& variant = {}, Tensor dsinks = {});

// The same with the keys and values given packed (KvExpansion): dpacked [B, Sl, width]
// overwritten; expand_backward adds each block's share to the expansion's weight gradients;
// documents as AttentionVariant's (empty: none).
void ring_attention_forward_packed(Tensor out, Tensor lse, Tensor q, Tensor packed, const KvExpansion& kv, const Comm& cp,
                                   Tensor documents = {});
void ring_attention_backward_packed(Tensor dq, Tensor dpacked, Tensor dout, Tensor q, Tensor packed, Tensor out, Tensor lse,
                                    const KvExpansion& kv, const Comm& cp, Tensor documents = {});

// The model's attention hook (ops/attention_runner.h) for micro-batches cut by the zigzag split
// over cp: ring_attention_forward/backward (and the packed pair) over the group, which must outlive
// the runner, and parallel/sequence_chain.h's chain.
AttentionRunner ring_attention_runner(const Comm& cp);

// Device bytes ring attention allocates beyond its inputs and outputs for `tokens` local tokens:
// the ring's two K/V blocks, partial and running results (forward), the dK/dV sums and dq (backward).
// v_head_dim 0: v's head dim is head_dim.
struct RingAttentionBytes {
  int64_t forward = 0, backward = 0;
};
RingAttentionBytes ring_attention_bytes(int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, Device device,
                                        int64_t v_head_dim = 0);

}  // namespace marrow
