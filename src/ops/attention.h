// Causal grouped-query attention (GQA), softmax scale 1/sqrt(D):
//   s[i, j] = q_i . k_j / sqrt(D) for j <= i,   out_i = sum_j softmax_j(s[i, :]) v_j,
// per batch row and query head. Query head h reads key/value head h / (Hq / Hkv), so consecutive
// query heads share a key/value head, as in Hugging Face's repeat_kv; Hq must be a multiple of Hkv.
// q and k share the head dim D, which sets the scale; v, out and their gradients have the value head
// dim Dv, which may differ (DeepSeek-V2's D = 192, Dv = 128).
// The forward saves lse_i = log sum_j exp(s[i, j]) (natural log) so the backward can rebuild the
// probabilities one row at a time (FlashAttention-2) instead of keeping the [S, S] matrix.
// GPU: q, k, v, out, dout and the causal op's dq, dk, dv bf16, lse f32; deterministic backwards
// (but cudnn_nondeterministic's), scratch from the stream-ordered pool (attention_backward_scratch).
//
// Blocks (ring attention, parallel/ring_attention.h): query rows [q_begin, q_end) of q against key
// rows [k_begin, k_end) of k and v (q and k may hold different token counts), masked one of two ways:
//   causal: the ranges are the same tokens (equal lengths): query q_begin + i sees keys
//           k_begin .. k_begin + i;
//   full:   every query of the range sees every key of the range (keys that all come earlier).
// With a sliding window, query row q_begin + i sits `distance` positions after key row k_begin + i
// (0 for a causal block) and sees key k_begin + j only when j > distance + i - window; documents bound
// it the same way by the query's position in its document (j >= distance + i - documents). Rows that see
// no key get lse -inf and out 0, which the merge skips. The causal op is the causal block over all
// rows. The block forward writes the block's own softmax (out, lse); attention_merge folds it into a
// running (out, lse) by log-sum-exp. The block backward takes the FINAL out and lse (after every
// merge), so P = exp(s - lse_final) and its dq, dk, dv are exactly the block's share of the whole
// gradient, added (+=) into dq, dk, dv. GPU: the block's out bf16; the running out and the
// accumulated dq, dk, dv f32.
#pragma once
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace marrow {

// Which GPU kernels run the causal op (one setting per process; the CPU ignores it), each falling
// back to the next that serves the sizes (hopper -> cuDNN -> own):
//   own: Marrow's mma.sync kernels (ops/attention_mma.h), head_dim 64 or 128 (Dv = D), every variant;
//   cudnn: cuDNN's fused SDPA (ops/attention_cudnn.h: D = Dv = 64 or 128, or D = 192 with Dv = 128)
//     with its deterministic backward;
//   cudnn_nondeterministic: cuDNN's default backward (dQ added with float atomics: faster, two runs
//     differ in their last bits), the one exception to DESIGN.md's determinism, never a default;
//   hopper: Marrow's wgmma forward and backward (ops/attention_hopper.h: head_dim 128, lengths a
//     multiple of 128, no variant), else as cudnn;
//   hopper_backward: cuDNN's forward with the wgmma backward, the run config's default.
// Only cuDNN serves Dv != D: such sizes run on it under every setting, causal op and blocks, and
// where it does not serve them either they are an error. Other blocks run the wgmma kernels where
// those serve them unless the setting is own, else the mma.sync kernels (ring attention runs a
// member's own block as the causal op, which follows the setting).
enum class AttentionKernels : uint8_t { own, cudnn, cudnn_nondeterministic, hopper, hopper_backward };
inline constexpr AttentionKernels kAttentionKernels[] = {AttentionKernels::own, AttentionKernels::cudnn,
                                                         AttentionKernels::cudnn_nondeterministic, AttentionKernels::hopper,
                                                         AttentionKernels::hopper_backward};
void set_attention_kernels(AttentionKernels kernels);
AttentionKernels attention_kernels();
// "own", "cudnn", "cudnn_nondeterministic", "hopper" or "hopper_backward" (run configs, bench labels).
AttentionKernels parse_attention_kernels(const std::string& name);
const char* attention_kernels_name(AttentionKernels kernels);

// GPT-OSS's additions to the causal op (Hugging Face GptOssAttention): sinks [Hq], q's dtype and
// device, a learned logit per query head that joins every row's softmax denominator and carries no
// value: p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sinks[h])), and lse includes it; a sliding
// window of W keys as transformers' create_sliding_window_causal_mask (kv_idx > q_idx - W on top of
// kv_idx <= q_idx). No sinks and window 0 is the plain op, with its bits. GPU: cuDNN's kernels or,
// under own, the mma.sync kernels' instantiations for it; sinks bf16 and dsinks f32.
// Packed documents (data.document_mask): documents [B, S] i32 on q's device, each query's position
// in its document (RoPE's restarted positions): query i sees only keys j >= i - documents[b, i], its
// own document's, as if each document ran alone; with a window, the nearer bound of the two.
// GPU: the mma.sync kernels only (train.attention_kernels = own, D = Dv).
struct AttentionVariant {
  Tensor sinks{};      // [Hq]; empty (data == nullptr): none
  int64_t window = 0;  // > 0: query i sees keys j with i - window < j <= i; 0: every earlier key
  Tensor documents{};  // [B, S] i32; empty: one document a row
};

// out[B, S, Hq, Dv] and lse[B, Hq, S] from q[B, S, Hq, D], k[B, S, Hkv, D], v[B, S, Hkv, Dv].
// out may not alias q, k or v.
void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant = {},
                       Stream stream = {});
// dq, dk, dv, all overwritten, with the shapes of q, k, v; out and lse are the forward's. The
// gradients may not alias any input.
void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                        Tensor lse, Stream stream = {});
// dsinks [Hq] is ADDED to (+=), as weight gradients accumulate: -sum over batch rows and queries i
// of exp(sinks[h] - lse_i) (dout_i . out_i). It is given exactly when variant.sinks is (empty otherwise).
void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v,
                        Tensor out, Tensor lse, const AttentionVariant& variant, Stream stream = {});

// The GPU scratch attention_backward takes from the stream-ordered pool (bytes) under the current
// attention_kernels setting, for memory estimates: the own kernels' delta and per-query-head dK, dV
// partials, cuDNN's workspace, or the wgmma kernels' f32 accumulators. v_head_dim 0: Dv = head_dim.
int64_t attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                   bool variant = false, int64_t v_head_dim = 0);

enum class AttentionMask : uint8_t { causal, full };

struct AttentionBlock {
  AttentionMask mask = AttentionMask::causal;
  int64_t q_begin = 0, q_end = 0;  // query rows (dimension 1 of q)
  int64_t k_begin = 0, k_end = 0;  // key rows (dimension 1 of k and v)
  int64_t window = 0;              // > 0: the sliding window; 0: none
  int64_t distance = 0;            // with a window or documents: the position of query row q_begin minus that of key row k_begin
  Tensor documents{};              // [B, Sq] i32, as AttentionVariant's per query row of q (its keys' positions by distance); empty: none
};

// Rows [q_begin, q_end) of out[B, Sq, Hq, Dv] and lse[B, Hq, Sq] (the others are left as they are)
// from q[B, Sq, Hq, D], k[B, Sk, Hkv, D], v[B, Sk, Hkv, Dv] under the block's mask. GPU blocks with
// Dv != D run on cuDNN (ops/attention_cudnn.h: no window, not one query against one key).
void attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block,
                             Stream stream = {});

// Which gradients a block backward adds: all three, or dk and dv alone, or dq alone. Ring attention
// runs the two halves apart so a block's dK/dV travel on while dq's kernel runs; the halves give the
// bits of the whole (each gradient sums its terms in the same order either way).
enum class AttentionGrads : uint8_t { all, kv, q };

// The block's share of the gradients, added into rows [q_begin, q_end) of dq and [k_begin, k_end)
// of dk and dv (those that `grads` names; the others are left as they are); out, lse are the final
// (merged) ones, dout the gradient of out.
void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, const AttentionBlock& block, AttentionGrads grads = AttentionGrads::all,
                              Stream stream = {});

// Whether attention_block_backward runs this block as one kernel for all three gradients (the wgmma
// kernels, cuDNN's), so that ring attention asks for them at once instead of in halves; v empty: as
// k's head dim. Test hook: set_cpu_blocks_fused(true) makes CPU blocks answer yes, so that order
// runs under mpirun too.
bool attention_block_backward_fused(const Tensor& q, const Tensor& k, const AttentionBlock& block, const Tensor& v = {});
void set_cpu_blocks_fused(bool fused);

// Rows [begin, end) of out[B, S, Hq, Dv], lse[B, Hq, S] become the merge with a partial result of
// the same shapes: out = (e^lse out + e^part_lse part_out) / (e^lse + e^part_lse), lse = log(e^lse +
// e^part_lse). A running result starts as out = 0, lse = -inf (a row with both lse -inf is left as is).
void attention_merge(Tensor out, Tensor lse, Tensor part_out, Tensor part_lse, int64_t begin, int64_t end,
                     Stream stream = {});

// The sinks of a result merged from blocks (ring attention): out[B, S, Hq, Dv] and lse [B, Hq, S]
// become the merge with each row's sink, a partial result of value 0 and lse sinks[h], so that they
// equal attention_forward's with the variant's sinks (up to the order of the sums). GPU: out and lse
// f32 (the running result), sinks bf16.
void attention_sinks_merge(Tensor out, Tensor lse, Tensor sinks, Stream stream = {});
// dsinks[h] += -sum over batch rows and queries i of exp(sinks[h] - lse_i) (dout_i . out_i), with the
// final out and lse: attention_backward's sinks term over these rows, in its order on the CPU. GPU:
// dout, out, sinks bf16; lse, dsinks f32 (one block per head, a fixed order: deterministic).
void attention_sinks_backward(Tensor dsinks, Tensor dout, Tensor out, Tensor lse, Tensor sinks, Stream stream = {});

}  // namespace marrow
