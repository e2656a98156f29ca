// Context parallelism: causal attention over a sequence split across the members of the cp group,
// with the zigzag split and ring attention.
//
// Zigzag split: the sequence of S tokens is cut into 2·CP chunks of S / (2·CP); member r holds
// chunks r and 2·CP − 1 − r, in that order. Causal attention work grows with the position, so one
// early and one late chunk give every member the same work.
//
// Ring attention: each member keeps its queries; the keys and values travel around the ring, one
// hop per step (member r sends to r + 1), so after CP − 1 hops every member has seen every K/V
// block. The next hop's exchange is posted before the current block is computed, so on the GPU the
// transfer runs under the attention kernels. With c = S / (2·CP) and the member's local tokens
// [0, c) = chunk r and [c, 2c) = chunk 2·CP − 1 − r, the block of the keys that came from member s is
// (ops/attention.h's modes on sub-ranges):
//   s = r: causal over all 2c local rows (chunk r sees itself causally, chunk 2·CP−1−r sees chunk r in
//          full and itself causally; chunk r never sees the later chunk 2·CP−1−r);
//   s < r: queries [0, 2c) against keys [0, c) in full (chunk s precedes both local chunks, chunk
//          2·CP−1−s follows both);
//   s > r: queries [c, 2c) against keys [0, 2c) in full (both of s's chunks lie between r's two).
// Each block's partial (out, lse) is merged into the running one by its log-sum-exp. The backward
// runs the K/V ring again beside a ring of dK/dV sums: the sum for a K/V block starts at the member
// after its owner and travels with it, each member adding its share, until one last hop brings it
// home, where the owner adds it to its own block's share. The own block runs in three parts: two
// under the first K/V hop, the third under that last dK/dV hop. A block's backward runs as two
// halves, dK/dV first so that they travel while dq's kernel runs, except where one kernel computes
// all three (ops/attention.h: attention_block_backward_fused, the wgmma kernels on the GPU).
//
// GPT-OSS's variant (ops/attention.h's AttentionVariant): a sliding window masks by
// the true positions, and a member's two chunks are not adjacent, so with a window every block is cut
// into one block per pair of chunks (ops/attention.h's windowed blocks: the distance between the
// chunks' positions), and pairs whose keys all lie beyond the window are skipped. Sinks join once,
// after every block is merged (attention_sinks_merge); the blocks' backward then takes the final lse,
// which includes them, and each member adds its rows' share of dsinks.
//
// Numbers: the CPU runs in the tensors' dtype (f32, f64); on the GPU q, k, v, out, dout, dq, dk, dv
// are bf16 and lse f32, while the running out and the dq, dk, dv accumulators are f32 (each rounded
// to bf16 once, at the end). Runs on the compute stream (the default stream, as Comm expects); the
// exchanges run on the group's stream. The order of additions is fixed (blocks in ring order), so
// results are deterministic for a given CP, and equal the one-process op up to that order.
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

// out[B, Sl, Hq, D] and lse[B, Hq, Sl] of this member's queries q[B, Sl, Hq, D] against the keys and
// values k, v[B, Sl, Hkv, D] of every member (causal over the true positions); Sl = S / CP.
void ring_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Comm& cp, const AttentionVariant& variant = {});

// dq, dk, dv (overwritten, shaped like q, k, v) of this member's tensors, from dout and the
// forward's out and lse; with sinks, dsinks [Hq] is added to with this member's rows' share.
void ring_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                             Tensor lse, const Comm& cp, const AttentionVariant& variant = {}, Tensor dsinks = {});

// The model's attention hook (ops/attention_runner.h) for micro-batches cut by the zigzag split
// over cp: ring_attention_forward/backward over the group, which must outlive the runner.
AttentionRunner ring_attention_runner(const Comm& cp);

// Device bytes ring attention over several members allocates beyond its inputs and outputs, for
// `tokens` local tokens (batch x local sequence) of q_heads and kv_heads heads of head_dim: the two
// K/V blocks of the ring, the partial and running results (forward), the dK/dV sums (three that
// travel, the member's own) and the dq sum (backward).
// Activations of `bytes` bytes (2 on the GPU), the running results f32 on the GPU.
struct RingAttentionBytes {
  int64_t forward = 0, backward = 0;
};
RingAttentionBytes ring_attention_bytes(int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, Device device);

}  // namespace marrow
