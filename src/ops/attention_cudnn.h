// The causal attention op of attention.h on cuDNN's fused SDPA graphs (cuDNN frontend): same
// tensors, layouts and meaning, including lse (natural log, f32 [B, Hq, S]), so either forward pairs
// with any backward. Head dims served: q, k and v of 64 or 128 (D = Dv), and DeepSeek-V2's D = 192
// (q, k) with Dv = 128 (v, out), which cuDNN's Hopper kernels take forward and backward and which
// nothing else in Marrow serves; the scale is 1/sqrt(D) either way.
// Deterministic: the backward runs cuDNN's deterministic algorithm, which writes dP = dO V^T to a
// bf16 workspace of B x Hq x Sq' x Skv' (lengths rounded up to 64) instead of adding dQ with float
// atomics. To keep that workspace within the cap below the backward runs in calls over a key/value
// head group and/or a chunk of query rows: chunk [q0, q1) against key rows [0, q1) with the causal
// mask aligned bottom-right gives the chunk's dQ exactly and its share of dK, dV for rows [0, q1).
// Chunks run from the last (all key rows) to the first, their shares summed in that fixed order into
// f32 accumulators and rounded to bf16 at the end (each share is rounded to bf16 once before the sum:
// the graphs write dK, dV in bf16). The plan takes the fewest calls. cuDNN's workspace also holds
// per-query-head dK, dV and the f32 row sums of dO * O; the chunked backward adds the f32 dK, dV
// accumulators. Graphs are built once per shape (~0.1-1 s the first call) and kept.
// GPT-OSS's variant: the window is cuDNN's diagonal band (a left bound of W keys, diagonal included:
// key j joins query i when j + W > i), the sinks cuDNN's sink token (f32 [1, Hq, 1, 1], a copy of the
// bf16 sinks), so the forward's lse holds them. The backward needs no sinks: with that lse,
// P = exp(s - lse) is each key's probability and dS = P (dP - rowsum(dO * O)) holds as without (the
// caller adds dsinks). A backward chunk keeps the window's meaning: with the diagonal aligned bottom
// right, its query row r is absolute row q0 + r.
// Blocks (ring attention, attention.h) run here only with Dv != D: the causal block as the causal
// mask, the full block as no mask, each in one call per key/value head group (no query chunks), no
// window. cuDNN writes the block backward's share in bf16 and overwrites, so it lands in bf16 scratch
// shaped like dq, dk, dv and is then added into their f32 sums.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

// The largest dP workspace one deterministic backward call may take (bytes): one key/value head
// group at S = 16384 (8 x 16384^2 x 2 B), or 2048 query rows of all 32 heads at 32,768; a smaller
// cap costs ~20% of the backward and lowers no peak (docs/performance.md: "cuDNN's deterministic
// backward in query chunks").
inline constexpr int64_t kCudnnAttentionWorkspaceCap = int64_t(4) << 30;

// Test and bench hooks (0 restores the default): the workspace cap, and a fixed query chunk (rows)
// for the deterministic backward, as the model's set_logits_chunk does for its logits.
void set_cudnn_backward_workspace_cap(int64_t bytes);
void set_cudnn_backward_chunk(int64_t rows);

// Whether cuDNN serves these sizes: the forward, more than one position and head dims (above);
// the backward, also a plan of calls within the workspace cap (query chunks of at least 64 rows).
// Where it has none (a batch x heads so large that 64 query rows x S keys pass the cap) the backward
// runs on the own kernels from cuDNN's forward (their lse is the same), where those serve the head dims.
bool cudnn_attention_forward_supports(int64_t seq, int64_t head_dim, int64_t v_head_dim);
bool cudnn_attention_backward_supports(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t v_head_dim, bool deterministic = true);

// The GPU scratch the backward takes from the stream-ordered pool: the largest of its calls, plus the
// f32 dK, dV accumulators when it runs in query chunks.
int64_t cudnn_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t v_head_dim, bool deterministic = true);

// out[B, S, Hq, Dv] and lse[B, Hq, S] from q[B, S, Hq, D], k[B, S, Hkv, D], v[B, S, Hkv, Dv]; bf16
// on the GPU, sinks too.
void cudnn_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant,
                             Stream stream);

// dq, dk, dv overwritten (bf16), from the forward's out and lse. deterministic = false runs
// cuDNN's default algorithm (dQ added with float atomics into an f32 accumulator, no dP workspace):
// AttentionKernels::cudnn_nondeterministic, never a default. Of the variant only the window is
// read (see above for the sinks).
void cudnn_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, const AttentionVariant& variant, Stream stream, bool deterministic = true);

// attention_block_forward and attention_block_backward (shapes and ranges checked there) on cuDNN:
// out bf16, lse f32; the backward adds the gradients `grads` names into f32 dq, dk, dv. They refuse
// a window, one query against one key (s_q = s_kv = 1), head dims not served, and a deterministic
// backward whose one call per key/value head passes the workspace cap.
void cudnn_attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block, Stream stream);
void cudnn_attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                    Tensor lse, const AttentionBlock& block, AttentionGrads grads, Stream stream,
                                    bool deterministic = true);

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
