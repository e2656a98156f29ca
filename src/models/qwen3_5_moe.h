// Qwen3.5-MoE's text model (Hugging Face Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text; a full
// Qwen3_5MoeForConditionalGeneration config reads as its text_config): the whole family in this
// file and its .cpp, cut into DESIGN.md's five stages as Qwen3-MoE is (models/qwen3_moe.h). Three of
// every four layers (layer_types, or full_attention_interval) mix tokens with Gated DeltaNet, the
// rest with gated softmax attention:
//   prolog       embedding
//   1 mixer      norm -> Gated DeltaNet or gated attention -> +residual -> norm -> shared expert and router
//   2-4          (engine) dispatch, the SwiGLU experts, combine
//   5 aggregate  weighted sum of each token's top-k outputs + the residual (shared expert included)
//   epilog       final norm -> LM head -> cross-entropy
// Gated DeltaNet: in_proj_qkv -> causal conv (kernel 4) + SiLU -> the gated delta rule (ops/gated_delta.h:
// L2-normed q, k; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) from in_proj_b/_a) -> the
// gated RMSNorm with SiLU(in_proj_z) -> out_proj. Gated attention: q_proj gives each head its query
// and a gate [q | gate]; QK-norm, RoPE on the first rotary_dim of each head (partial_rotary_factor),
// causal GQA, out * sigmoid(gate), o_proj. Every RMSNorm but the DeltaNet's output norm is
// zero-centred (x * (1 + w), weights start at 0). The shared expert's output is scaled by
// sigmoid(shared_expert_gate . h) and joins the residual in stage 1, as DeepSeek-V2's shared experts do.
// Under context parallelism the DeltaNet layers run their zigzag pieces along the runner's chain
// (ops/attention_runner.h's SequenceChain: the delta rule's state and the conv's earlier tokens cross
// from chunk to chunk), the attention layers ring attention. Packed documents are refused for now.
#pragma once
#include <string>
#include <vector>

#include "models/common.h"  // and the core/ and ops/ headers its declarations use
#include "ops/attention_runner.h"

namespace marrow {

struct Qwen3_5MoeConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  int64_t num_experts = 0, top_k = 0, expert_intermediate_size = 0, shared_intermediate_size = 0;
  int64_t conv_kernel = 4, linear_key_heads = 0, linear_key_dim = 0, linear_value_heads = 0, linear_value_dim = 0;
  std::vector<bool> full_attention;  // by layer: gated attention, else Gated DeltaNet
  double rms_norm_eps = 1e-6, rope_theta = 1e7, initializer_range = 0.02, router_aux_loss_coef = 0.001;
  bool sequence_aux = false;  // train.load_balance = "sequence"
  Json json;                  // the (text) config.json as read, written back on export

  int64_t key_width() const { return linear_key_heads * linear_key_dim; }
  int64_t value_width() const { return linear_value_heads * linear_value_dim; }
  int64_t conv_channels() const { return 2 * key_width() + value_width(); }  // q, k, v features a token
  int64_t full_layers() const;
  ModelSize model_size() const;
  static Qwen3_5MoeConfig from_json(const Json& json, const std::string& source);
  static Qwen3_5MoeConfig load(const std::string& path) { return from_json(read_json_file(path), path); }
};

struct Qwen3_5MoeLayerWeights {
  bool full = false;  // gated attention (q_proj..k_norm), else Gated DeltaNet (in_proj_qkv..delta_norm)
  Tensor input_norm, post_norm;
  Tensor q_proj, k_proj, v_proj, o_proj, q_norm, k_norm;  // q_proj [Hq * 2D, H]: per head query rows, then gate rows
  Tensor in_proj_qkv, in_proj_z, in_proj_ba, conv, out_proj, A_log, dt_bias, delta_norm;  // in_proj_ba: b's rows then a's; conv [C, K]
  Tensor shared_gate_up, shared_down, shared_gate;  // [2Is, H] gate rows then up, [H, Is], [1, H]
  Tensor router;
  Tensor experts_gate_up;  // [E_local, 2I, H]
  Tensor experts_down;     // [E_local, H, I]
  int64_t layer = -1;
};

struct Qwen3_5MoeWeights {
  Tensor embed, final_norm, lm_head;
  std::vector<Qwen3_5MoeLayerWeights> layers;
};

// As Qwen3MoeBatch: B sequences of S tokens.
struct Qwen3_5MoeBatch {
  int64_t batch = 0, seq = 0;
  Buffer input_ids, targets, positions;  // [T] i32
  const AttentionRunner* attention = nullptr;  // context parallelism: ring attention, and the DeltaNet layers' chain
  bool documents = false;                      // data.document_mask: refused
  StatisticsRows sequences = {};
};

struct Qwen3_5MoeAttentionActivations {
  Buffer x, rstd1;  // the residual entering the layer; the input norm is computed again
  Buffer qg, k, v, rstd_q, rstd_k, attn, lse;  // gated attention (q, k normed and rotated again in the backward)
  Buffer qkv, z, ba, g, beta, core, rstd_core;  // Gated DeltaNet: qkv before the conv (computed again), the delta rule's output
  Buffer conv_history, delta_states;  // under context parallelism: each piece's K - 1 earlier tokens of qkv and initial state
  Buffer x_attn;  // x + the mixer's output: the post norm's input
  Buffer h2, rstd2, shared_gate_up, shared_out, shared_logit;
  Buffer x_mid;   // x_attn + sigmoid(shared_logit) * shared_out: stage 5's residual
  Buffer probs, topk_index, topk_weight, routing_stats;
};

struct Qwen3_5MoeTypes {  // as Qwen3MoeTypes
  using Config = Qwen3_5MoeConfig;
  using Weights = Qwen3_5MoeWeights;
  using LayerWeights = Qwen3_5MoeLayerWeights;
  using Batch = Qwen3_5MoeBatch;
  using AttentionActivations = Qwen3_5MoeAttentionActivations;
  using ExpertActivations = SwigluExpertActivations;
  static constexpr const char* name = "Qwen3_5Moe";
  static constexpr float norm_offset = 1;  // the zero-centred norms' x * (1 + w), the final norm's too
};

class Qwen3_5Moe : public SwigluMoeModel<Qwen3_5Moe, Qwen3_5MoeTypes> {
 public:
  static constexpr const char* model_type = "qwen3_5_moe_text";

  Qwen3_5Moe(const Config& config, DType dtype, Device device, ExpertShard experts = {});

  int64_t num_active_parameters() const;
  int64_t attention_width() const { return config_.num_heads * config_.head_dim; }
  // The gated attention layers' 6 x seq x width (Qwen3Moe's convention) and, per DeltaNet layer and
  // value head, 3 x (4 Dk Dv + 128 (Dk + Dv)): the state's read and update and a 64-token chunk's
  // two triangular products, forward and twice backward.
  double attention_flops_per_token(int64_t seq) const;

  // Hugging Face's initialisation: zeros for the zero-centred norms, ones for the DeltaNet's norm
  // and dt_bias, A_log = log(uniform(0.01, 16)), normal(0, initializer_range) for the rest.
  using MoeModelBase::initialize;
  void initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const;

  Qwen3_5MoeWeights bind(const Placement& placement) const;

  // Stage 1 (Qwen3Moe's contract).
  void attention_forward(Qwen3_5MoeAttentionActivations& a, Buffer x, const Qwen3_5MoeBatch& batch, const Qwen3_5MoeLayerWeights& w) const;
  void attention_backward(Tensor dx, const Qwen3_5MoeLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight, double aux_grad,
                          Qwen3_5MoeAttentionActivations& a, const Qwen3_5MoeBatch& batch, const Qwen3_5MoeLayerWeights& w) const;

  ModelActivationBytes activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const;

 private:
  struct Mixer;  // the token mixers' steps, in the .cpp
  void moe_forward(Qwen3_5MoeAttentionActivations& a, const Qwen3_5MoeBatch& batch, const Qwen3_5MoeLayerWeights& w) const;
  void moe_backward(Tensor dres, Tensor dh2, const Qwen3_5MoeLayerWeights& grads, Tensor dx_mid, Tensor dtopk_weight, double aux_grad,
                    Qwen3_5MoeAttentionActivations& a, const Qwen3_5MoeBatch& batch, const Qwen3_5MoeLayerWeights& w) const;
};

}  // namespace marrow
