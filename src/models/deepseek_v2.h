// DeepSeek-V2 and V2-Lite (Hugging Face DeepseekV2ForCausalLM): the whole model family in this file
// and its .cpp, cut into DESIGN.md's five stages as Qwen3-MoE is (models/qwen3_moe.h):
//   prolog       embedding
//   1 attention  norm -> multi-head latent attention -> +residual -> norm -> shared experts (or, in
//                the first first_k_dense_replace layers, the dense SwiGLU MLP) and the router
//   2 dispatch   (engine) group the normed hidden states' token copies by expert
//   3 experts    grouped gate/up -> SwiGLU -> grouped down
//   4 combine    (engine) bring expert outputs back
//   5 aggregate  weighted sum of each token's top-k outputs + the residual (shared experts included)
//   epilog       final norm -> LM head -> cross-entropy
// Multi-head latent attention (MLA): the query from q_proj, or through a low-rank q_a_proj ->
// q_a_layernorm -> q_b_proj (q_lora_rank); kv_a_proj_with_mqa gives the latent (kv_lora_rank) and one
// rope key shared by every head; the latent is normed and kv_b_proj decompresses it to each head's
// key (nope part) and value. Query and key heads are [nope | rope] (qk_nope_head_dim +
// qk_rope_head_dim), values v_head_dim; DeepSeek's RoPE rotates adjacent pairs (ops/mla.h).
// The shared experts run in stage 1 on the routed input, so they overlap the dispatch that follows;
// a dense layer has no stages 2-5: its stage 1 is the whole layer (the engine's dense_layer).
// Under context parallelism the normed latent and the rotated rope key travel the ring
// (ring_attention_*_packed: 576 values a token for V2-Lite) and each member decompresses the blocks it holds.
#pragma once
#include <string>
#include <vector>

#include "models/common.h"  // and the core/ and ops/ headers its declarations use (Json, Buffer, TensorSpec, HostSum, ...)
#include "ops/attention_runner.h"

namespace marrow {

struct DeepseekV2Config {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t q_lora_rank = 0;  // 0: q_proj (config null)
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int64_t intermediate_size = 0;  // the dense layers' MLP
  int64_t num_experts = 0, top_k = 0, expert_intermediate_size = 0, num_shared_experts = 0, first_dense_layers = 0;
  RouterOptions routing;  // topk_method's groups, routed_scaling_factor, norm_topk_prob
  bool sequence_aux = false;  // seq_aux: the load-balance loss per sequence, averaged (train.load_balance overrides it)
  double rms_norm_eps = 1e-6, initializer_range = 0.02, router_aux_loss_coef = 0.001;
  RopeParameters rope;
  double softmax_scale = 0;  // qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2
  Json json;  // the config.json as read, written back unchanged on export

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t shared_intermediate_size() const { return expert_intermediate_size * num_shared_experts; }
  int64_t moe_layers() const { return num_layers - first_dense_layers; }
  ModelSize model_size() const;  // core/stage_bytes.h
  // Reads and validates a Hugging Face config.json; every problem is one sentence naming the key.
  static DeepseekV2Config from_json(const Json& json, const std::string& source);
  static DeepseekV2Config load(const std::string& path) { return from_json(read_json_file(path), path); }
};

struct DeepseekV2LayerWeights {
  bool dense = false;  // one of the first first_k_dense_replace layers: mlp_gate_up/mlp_down, no experts
  Tensor input_norm, q_proj, q_a_proj, q_a_norm, q_b_proj;  // q_proj, or q_a_proj/q_a_norm/q_b_proj with q-LoRA
  Tensor kv_a_latent, kv_a_rope;  // kv_a_proj_with_mqa's rows: [kv_lora_rank, H], [qk_rope_head_dim, H]
  Tensor kv_a_norm, kv_b_proj, o_proj, post_norm;
  Tensor mlp_gate_up, mlp_down;  // the dense MLP, or the shared experts as one MLP: [2I, H] gate rows then up, [H, I]
  Tensor router;
  Tensor experts_gate_up;  // [E_local, 2I, H]
  Tensor experts_down;     // [E_local, H, I]
  int64_t layer = -1;
};

struct DeepseekV2Weights {
  Tensor embed, final_norm, lm_head;
  std::vector<DeepseekV2LayerWeights> layers;
};

// As Qwen3MoeBatch: B sequences of S tokens (a share of longer ones under context parallelism).
struct DeepseekV2Batch {
  int64_t batch = 0, seq = 0;
  Buffer input_ids, targets, positions;  // [T] i32
  const AttentionRunner* attention = nullptr;
  bool documents = false;  // as Qwen3MoeBatch's
  StatisticsRows sequences = {};  // as Qwen3MoeBatch's
};

struct DeepseekV2AttentionActivations {
  Buffer x;  // the residual entering the layer [T, H]; the input norm is computed again
  Buffer rstd1, q_a, rstd_qa, q, latent, rstd_kv, k_pe, kv, attn, lse;
  Buffer x_attn;  // x + attention [T, H]: the post-attention norm's input
  Buffer x_mid;   // x_attn + the shared experts' (or dense MLP's) output: stage 5's residual, a dense layer's output
  Buffer h2, rstd2, mlp_gate_up;  // the routed input and the shared/dense MLP's gate/up
  Buffer probs, topk_index, topk_weight, routing_stats;  // routing_stats [G, 2E + 1] (ops/router.h)
};

struct DeepseekV2Types {  // as Qwen3MoeTypes
  using Config = DeepseekV2Config;
  using Weights = DeepseekV2Weights;
  using LayerWeights = DeepseekV2LayerWeights;
  using Batch = DeepseekV2Batch;
  using AttentionActivations = DeepseekV2AttentionActivations;
  using ExpertActivations = SwigluExpertActivations;
  static constexpr const char* name = "DeepseekV2";
};

// As Qwen3Moe, with SwigluMoeModel's members (models/common.h); a dense layer has no expert gradients.
class DeepseekV2 : public SwigluMoeModel<DeepseekV2, DeepseekV2Types> {
 public:
  static constexpr const char* model_type = "deepseek_v2";

  DeepseekV2(const Config& config, DType dtype, Device device, ExpertShard experts = {});

  bool dense_layer(int64_t layer) const { return layer < config_.first_dense_layers; }
  int64_t num_active_parameters() const;
  // Query heads x qk head dim: the score products; the value products (v_head_dim) are counted in
  // attention_flops_per_token.
  int64_t attention_width() const { return config_.num_heads * config_.qk_head_dim(); }
  // 2 x seq x heads x (qk + v head dims) a layer, times 3 for forward and backward (Qwen3Moe's
  // convention: S / 2 keys a query).
  double attention_flops_per_token(int64_t seq) const {
    return 3.0 * double(seq) * double(config_.num_heads * (config_.qk_head_dim() + config_.v_head_dim)) * double(num_layers());
  }

  DeepseekV2Weights bind(const Placement& placement) const;

  // Stage 1 (Qwen3Moe's contract). A dense layer's a.x_mid is the layer's output and its backward
  // takes no dh2 or dtopk_weight (empty).
  void attention_forward(DeepseekV2AttentionActivations& a, Buffer x, const DeepseekV2Batch& batch, const DeepseekV2LayerWeights& w) const;
  void attention_backward(Tensor dx, const DeepseekV2LayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight, double aux_grad,
                          DeepseekV2AttentionActivations& a, const DeepseekV2Batch& batch, const DeepseekV2LayerWeights& w) const;

  ModelActivationBytes activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const;

 private:
  struct Attention;  // the MLA steps of stage 1, in the .cpp
  void mlp_forward(DeepseekV2AttentionActivations& a, const DeepseekV2LayerWeights& w) const;
  void mlp_backward(Tensor dh2, const DeepseekV2LayerWeights& grads, Tensor dx_mid, DeepseekV2AttentionActivations& a,
                    const DeepseekV2LayerWeights& w, bool add) const;
  void route(DeepseekV2AttentionActivations& a, const DeepseekV2Batch& batch, const DeepseekV2LayerWeights& w) const;
};

}  // namespace marrow
