// The causal attention op of attention.h on cuDNN's fused SDPA graphs (cuDNN frontend), the GPU
// alternative to attention.cu's own kernels: same tensors, layouts and meaning, including lse
// (natural log of the sum of exp of the scaled scores, f32 [B, Hq, S]), so either forward pairs
// with either backward. cuDNN's Hopper kernels use wgmma and TMA, which the own kernels (mma.sync)
// do not.
// Deterministic: the backward runs cuDNN's deterministic algorithm, which writes dP = dO V^T to a
// bf16 workspace of B x Hq x Sq' x Skv' (lengths rounded up to 64; 1 GiB at S = 4096 with 32 heads)
// instead of adding dQ with float atomics. To keep that workspace within the cap below the backward
// runs in calls over a key/value head group and/or a chunk of query rows: chunk [q0, q1) against
// key rows [0, q1) with the causal mask aligned bottom-right gives the chunk's dQ exactly and its
// share of dK, dV for rows [0, q1). Chunks run from the last (all key rows) to the first, and their
// shares are summed in that fixed order into f32 accumulators, rounded to bf16 at the end. The
// graphs write dK, dV in bf16 (an f32 output was not tried), so each share is rounded once before
// the f32 sum (a few 2^-9 roundings of parts of dK, dV, within the check's bounds; cuDNN itself
// sums bf16 per-query-head dK, dV into the key/value heads). The plan takes the fewest calls: at the
// bench's heads, S = 16384 in 4 head groups (12.1 ms on an H200), S = 32768 in 16 chunks of 2048
// query rows over all heads (52.9 ms against 104 ms on the own kernels). Besides dP, cuDNN's
// workspace holds those per-query-head dK, dV and the f32 row sums of dO * O (4.5 GiB in all for
// the 32,768 chunks); the chunked backward adds the f32 dK, dV accumulators (128 MiB at 32,768).
// Graphs are built once per shape (the first call of a shape takes ~0.1-1 s) and kept.
// GPT-OSS's variant (attention.h's AttentionVariant): the window is cuDNN's diagonal band (a left
// bound of W keys, diagonal included: key j joins query i when j + W > i, transformers' mask), and
// the sinks join the forward's softmax as cuDNN's sink token (f32 [1, Hq, 1, 1], a copy of the
// bf16 sinks), so its lse holds them. The backward needs no sinks: P = exp(s - lse) with that lse
// is each key's probability, and dS = P (dP - rowsum(dO * O)) holds with the sink as without (the
// caller adds dsinks, attention_sinks_backward). Chunks of the backward keep the window's meaning:
// with the diagonal aligned bottom right, a chunk's query row r is absolute row q0 + r.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

// The largest dP workspace one deterministic backward call may take (bytes): one key/value head
// group at S = 16384 (8 x 16384^2 x 2 B = 4 GiB), or 2048 query rows of all 32 heads at 32,768.
// Measured on an H200: a 1 GiB cap costs ~20% of the backward (marrow bench --kernels, 16,384:
// 12.1 -> 14.4 ms; 32,768: 52.9 -> 62.8 ms) and 5.6% of a 16,384-token step (46.3K -> 43.6K
// tokens/s) without lowering its peak (111.37 GiB either way: the epilog's backward sets it).
inline constexpr int64_t kCudnnAttentionWorkspaceCap = int64_t(4) << 30;

// Test and bench hooks (0 restores the default): the workspace cap, and a fixed query chunk (rows)
// for the deterministic backward, as the model's set_logits_chunk does for its logits.
void set_cudnn_backward_workspace_cap(int64_t bytes);
void set_cudnn_backward_chunk(int64_t rows);

// Whether cuDNN serves these sizes: the forward, more than one position and head_dim 64 or 128;
// the backward, also a plan of calls within the workspace cap (query chunks of at least 64 rows).
// Where it has none (a batch x heads so large that 64 query rows x S keys pass the cap) the backward
// runs on the own kernels from cuDNN's forward (their lse is the same).
bool cudnn_attention_forward_supports(int64_t seq, int64_t head_dim);
bool cudnn_attention_backward_supports(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       bool deterministic = true);

// The GPU scratch the backward takes from the stream-ordered pool: the largest of its calls, plus the
// f32 dK, dV accumulators when it runs in query chunks.
int64_t cudnn_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         bool deterministic = true);

// out[B, S, Hq, D] and lse[B, Hq, S] from q[B, S, Hq, D], k, v[B, S, Hkv, D]; bf16 on the GPU,
// sinks too.
void cudnn_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant,
                             Stream stream);

// dq, dk, dv overwritten (bf16), from the forward's out and lse. deterministic = false runs
// cuDNN's default algorithm (dQ added with float atomics into an f32 accumulator, no dP workspace):
// AttentionKernels::cudnn_nondeterministic, never a default. Of the variant only the window is
// read (see above for the sinks).
void cudnn_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, const AttentionVariant& variant, Stream stream, bool deterministic = true);

// Every execution plan cuDNN's heuristics (modes A, B and the fallback) offer for one graph of the
// op: the causal forward, or the deterministic backward in one call (batch x heads small enough that
// its plan needs no head groups or query chunks), on the given tensors (shapes as the op's). For
// `marrow bench --attention-plans`, which times them and compares their outputs with the op's own
// plan (the first that heuristic A builds). run is empty where cuDNN could not build the plan.
struct CudnnAttentionPlan {
  std::string name;  // cuDNN's engine and knob settings
  int64_t workspace_bytes = 0;
  std::function<void()> run;  // writes out, lse (forward) or dq, dk, dv (backward)
};
std::vector<CudnnAttentionPlan> cudnn_attention_plans(bool backward, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                                                      Tensor k, Tensor v, Tensor out, Tensor lse);

}  // namespace marrow
