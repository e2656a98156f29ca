// attention.h's causal op and blocks on Marrow's own Hopper kernels (wgmma, TMA; sm_90a):
// attention_hopper.cu (forward), attention_hopper_backward.cu (backward). Same tensors, layouts and
// lse as the other paths, so each pairs with any other forward or backward. Head_dim 128, lengths a
// multiple of 128, no variant. The backward is deterministic without a dP workspace (fixed orders of
// f32 sums behind semaphores); its scratch: f32 dQ, dK, dV accumulators, B x S x (Hq + 2 Hkv) x 128
// x 4 bytes (80 MiB at the bench shape), and the row sums of dO * O.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/attention.h"

namespace marrow {

// Test hook (0 restores the default, 8): the query heads of a chunk of work items.
void set_hopper_backward_chunk_heads(int heads);
// Bench hook (false restores the default): dQ shares added in whichever order they arrive, without
// the semaphores, which is not deterministic; measures what the fixed order costs. Never in training.
void set_hopper_backward_unordered(bool unordered);
// Bench hook (0 restores the default), wrong results on purpose: what the memory traffic costs the
// walk. Bit 1: Q, dO, lse and D loaded from query block m % 8 (a few rows per head, L2-resident);
// bit 2: no dQ writes at all. Never in training.
void set_hopper_backward_probe(int probe);

// Whether the kernels serve these sizes (false without CUDA).
bool hopper_attention_supports(int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim);

// Blocks of ops/attention.h (the causal op: the causal block over all rows) on these kernels: the
// block's query and key lengths multiples of 128, head_dim 128, its first query row and q's row count
// multiples of 4 (lse is read 16 bytes at a time); row offsets otherwise free. Whether the kernels
// serve the block (false without CUDA):
bool hopper_attention_serves_block(const Tensor& q, const Tensor& k, const AttentionBlock& block);
// The block's out (bf16) and lse (f32) rows from q, k, v (bf16); the caller (ops/attention.cu) has
// checked shapes, block and devices.
void hopper_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block, Stream stream = {});
// The block's gradients from dout, q, k, v, out (bf16) and the final lse (f32): accumulate adds them
// into f32 dq, dk, dv (those `grads` names); else all three are overwritten in bf16 (the causal op).
// One kernel computes all three, so a kv or q half costs the whole (attention_block_backward_fused).
// Takes hopper_attention_backward_scratch bytes from the stream-ordered pool.
int64_t hopper_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim);
void hopper_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                               const AttentionBlock& block, bool accumulate, AttentionGrads grads, Stream stream = {});

// Bench hook: one call of the backward with each work item's timeline (globaltimer ns; the item's
// dQ semaphore waits summed, its dK/dV wait), in the order items were taken.
struct HopperItemTimes {
  int head, key_block, sm;
  int64_t start, walk_end, kv_wait, end, dq_wait, dq_end;
};
std::vector<HopperItemTimes> hopper_backward_timeline(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor lse);

}  // namespace marrow
