// Qwen3-MoE (Hugging Face Qwen3MoeForCausalLM): the whole model family in this file and its .cpp.
//
// A decoder layer is cut into DESIGN.md's five stages. The model owns stages 1, 3 and 5 and the
// prolog/epilog; the engine owns 2 (dispatch) and 4 (combine) because those are where expert
// parallelism communicates:
//   prolog     embedding
//   1 attention  norm -> QKV -> QK-norm -> RoPE -> causal GQA -> out-proj -> +residual -> norm -> router
//   2 dispatch   (engine) group the normed hidden states' token copies by expert
//   3 experts    grouped gate/up -> SwiGLU -> grouped down
//   4 combine    (engine) bring expert outputs back (identity with one expert-parallel rank)
//   5 aggregate  weighted sum of each token's top-k outputs + residual
//   epilog     final norm -> LM head -> cross-entropy
// Each stage's forward fills an activation struct with what its backward consumes; weight
// gradients accumulate into the gradient arena.
// Parameters are a table of canonical tensors named as in Hugging Face checkpoints (one entry per
// expert), so export is a copy and initial weights are a function of (seed, name, element). A
// layer's per-expert tensors are contiguous: the fused [E, 2I, H] gate/up and [E, H, I] down of the
// grouped GEMMs. Under expert parallelism the table holds this process's experts (ExpertShard),
// under their global names.
#pragma once
#include <string>
#include <vector>

#include "models/common.h"  // and the core/ and ops/ headers its declarations use (Json, Buffer, TensorSpec, HostSum, ...)
#include "ops/attention_runner.h"

namespace marrow {

struct Qwen3MoeConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t num_experts = 0, top_k = 0, expert_intermediate_size = 0;
  double rms_norm_eps = 1e-6, rope_theta = 1e6, initializer_range = 0.02, router_aux_loss_coef = 0.001;
  bool sequence_aux = false;  // the load-balance loss per sequence: train.load_balance = "sequence" (never in config.json)
  bool norm_topk_prob = false;
  Json json;  // the config.json as read, written back unchanged on export

  ModelSize model_size() const;  // core/stage_bytes.h
  // Reads and validates a Hugging Face config.json; every problem is one sentence naming the key.
  static Qwen3MoeConfig from_json(const Json& json, const std::string& source);
  static Qwen3MoeConfig load(const std::string& path) { return from_json(read_json_file(path), path); }
};

struct Qwen3MoeLayerWeights {
  Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm, router;
  Tensor experts_gate_up;  // [E_local, 2I, H]: per local expert, gate_proj rows then up_proj rows
  Tensor experts_down;     // [E_local, H, I]
  int64_t layer = -1;      // its place in Qwen3MoeWeights::layers (bind sets it): the FP8 copies' key
};

// Views of one arena (parameters or gradients) in the model's shapes.
struct Qwen3MoeWeights {
  Tensor embed, final_norm, lm_head;
  std::vector<Qwen3MoeLayerWeights> layers;
};

// One micro-batch of B sequences of S tokens (T = B * S), with what the backward needs. With
// context parallelism the S tokens are this process's share of longer sequences: positions are
// their places in the sequence (RoPE) and `attention` runs their attention with the other shares'.
struct Qwen3MoeBatch {
  int64_t batch = 0, seq = 0;
  Buffer input_ids;  // [T] i32
  Buffer targets;    // [T] i32, kIgnoreIndex where no loss
  Buffer positions;  // [T] i32
  const AttentionRunner* attention = nullptr;  // none: the sequences are whole (ops/attention_runner.h)
  bool documents = false;  // data.document_mask: positions restart at each document, which attends only to itself
  // train.load_balance = "sequence": the rows of these sequences among the data-parallel group's (engine/model.h).
  StatisticsRows sequences = {};
  // rope_cos_sin_table of the positions on the GPU, built by the first layer that needs it (a
  // cache, hence mutable: positions must not change once a forward ran on the batch).
  mutable Buffer rope_cos_sin = Buffer();
};

struct Qwen3MoeAttentionActivations {
  Buffer x;  // residual stream entering the layer [T, H]; h1, q_rope, k_rope are computed again (elementwise)
  Buffer rstd1, q, k, v, rstd_q, rstd_k, attn, lse;
  Buffer x_mid;  // residual after attention [T, H]
  Buffer h2, rstd2, probs, topk_index, topk_weight;
  Buffer routing_stats;  // [2E + 1]: see router_statistics; the engine may sum it over processes before aux_loss and the backward
};

// The structs Qwen3Moe computes with (MoeModelBase's Types).
struct Qwen3MoeTypes {
  using Config = Qwen3MoeConfig;
  using Weights = Qwen3MoeWeights;
  using LayerWeights = Qwen3MoeLayerWeights;
  using Batch = Qwen3MoeBatch;
  using AttentionActivations = Qwen3MoeAttentionActivations;
  using ExpertActivations = SwigluExpertActivations;
  static constexpr const char* name = "Qwen3Moe";
};

// The accessors, prolog, stages 3 and 5 and the epilog are SwigluMoeModel's (models/common.h).
class Qwen3Moe : public SwigluMoeModel<Qwen3Moe, Qwen3MoeTypes> {
 public:
  static constexpr const char* model_type = "qwen3_moe";

  Qwen3Moe(const Config& config, DType dtype, Device device, ExpertShard experts = {});

  // Active parameters per token (top-k experts of each layer, everything else), for FLOP counts.
  int64_t num_active_parameters() const;
  int64_t attention_width() const { return config_.num_heads * config_.head_dim; }
  // Causal attention's FLOPs per token, all layers, forward and backward: 6 x seq x width a layer
  // (PyTorch trainers' MFU convention: S / 2 keys a query, 4 products a key and head dim forward, twice backward).
  double attention_flops_per_token(int64_t seq) const { return 6.0 * double(seq) * double(attention_width()) * double(num_layers()); }

  // Views of the table's tensors wherever the placement puts them (an arena, or FSDP's buffers).
  Qwen3MoeWeights bind(const Placement& placement) const;

  // Stage 1: from the residual stream x, the residual after attention (a.x_mid), the routed input
  // (a.h2) and the routing (a.topk_index, a.topk_weight). a.x keeps x for the backward.
  void attention_forward(Qwen3MoeAttentionActivations& a, Buffer x, const Qwen3MoeBatch& batch,
                         const Qwen3MoeLayerWeights& w) const;
  // dx (overwritten) from dx_mid (gradient reaching the post-attention residual from stage 5),
  // dh2 (from dispatch's backward; used as scratch) and dtopk_weight (from stage 5); aux_grad is
  // d(total loss)/d(this layer's load-balance loss).
  void attention_backward(Tensor dx, const Qwen3MoeLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight,
                          double aux_grad, Qwen3MoeAttentionActivations& a, const Qwen3MoeBatch& batch,
                          const Qwen3MoeLayerWeights& w) const;

  // Device bytes of each stage for one micro-batch of batch x seq tokens, expert_rows token copies
  // a layer through this process's experts (core/stage_bytes.h).
  ModelActivationBytes activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const;

 private:
  Tensor rope_cos_sin(const Qwen3MoeBatch& batch) const;
  std::pair<Buffer, Buffer> attention_inputs(Qwen3MoeAttentionActivations& a, const Qwen3MoeBatch& batch,
                                             const Qwen3MoeLayerWeights& w) const;
};

}  // namespace marrow
