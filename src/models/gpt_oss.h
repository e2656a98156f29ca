// GPT-OSS (Hugging Face GptOssForCausalLM): the whole model family in this file and its .cpp.
//
// The decoder layer in DESIGN.md's five stages, as for Qwen3-MoE (models/qwen3_moe.h), with GPT-OSS's
// differences:
//   1 attention  norm -> QKV (+bias) -> RoPE (YaRN) -> causal GQA with a sink logit per head, every
//                other layer in a sliding window -> out-proj (+bias) -> +residual -> norm -> router
//                (+bias; top-k of the logits, softmax over those k)
//   3 experts    grouped gate/up (+bias) -> clamped SwiGLU (gate and up interleaved) -> grouped down (+bias)
// Parameters are Hugging Face's tensors as they are, so export and import are copies: a layer's
// experts are the fused mlp.experts.gate_up_proj [E, H, 2I] (gate and up in alternate columns),
// gate_up_proj_bias [E, 2I], down_proj [E, I, H] and down_proj_bias [E, H]. Being [E, in, out]
// where the grouped GEMMs take [E, out, in], the forward runs grouped_linear_backward_input and the
// input gradient grouped_linear_forward. Under expert parallelism a process holds its experts' rows
// of the fused tensors (TensorSpec::canonical_first). Attention with sinks and sliding windows runs
// on cuDNN or the own kernels, and around the ring under context parallelism.
#pragma once
#include <string>
#include <vector>

#include "models/common.h"  // and the core/ and ops/ headers its declarations use (Json, Buffer, TensorSpec, HostSum, ...)
#include "ops/attention_runner.h"

namespace marrow {

struct GptOssConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t num_experts = 0, top_k = 0, expert_intermediate_size = 0, sliding_window = 0;
  double rms_norm_eps = 1e-5, initializer_range = 0.02, router_aux_loss_coef = 0.001;
  bool sequence_aux = false;  // as Qwen3MoeConfig's
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  RopeParameters rope;
  std::vector<bool> sliding;  // per layer: a "sliding_attention" layer (else "full_attention")
  Json json;                  // the config.json as read, written back unchanged on export

  ModelSize model_size() const;  // core/stage_bytes.h
  // Reads and validates a Hugging Face config.json; every problem is one sentence naming the key.
  static GptOssConfig from_json(const Json& json, const std::string& source);
  static GptOssConfig load(const std::string& path) { return from_json(read_json_file(path), path); }
};

struct GptOssLayerWeights {
  Tensor input_norm, q_proj, q_bias, k_proj, k_bias, v_proj, v_bias, o_proj, o_bias, sinks, post_norm, router, router_bias;
  Tensor experts_gate_up, experts_gate_up_bias;  // [E, H, 2I], [E, 2I]
  Tensor experts_down, experts_down_bias;        // [E, I, H], [E, H]
  int64_t layer = -1;
};

struct GptOssWeights {
  Tensor embed, final_norm, lm_head;
  std::vector<GptOssLayerWeights> layers;
};

// One micro-batch of B sequences of S tokens (T = B * S); see Qwen3MoeBatch.
struct GptOssBatch {
  int64_t batch = 0, seq = 0;
  Buffer input_ids;  // [T] i32
  Buffer targets;    // [T] i32, kIgnoreIndex where no loss
  Buffer positions;  // [T] i32
  const AttentionRunner* attention = nullptr;  // none: the sequences are whole (ops/attention_runner.h)
  bool documents = false;  // data.document_mask: positions restart at each document, which attends only to itself
  StatisticsRows sequences = {};  // as Qwen3MoeBatch's
};

struct GptOssAttentionActivations {
  Buffer x;  // residual stream entering the layer [T, H]; the input norm's output is computed again
  Buffer rstd1, q_rope, k_rope, v, attn, lse;
  Buffer x_mid, h2, rstd2, probs, topk_index, topk_weight;
  Buffer routing_stats;  // [2E + 1]: router_statistics
};

struct GptOssExpertActivations {
  Buffer x_perm, gate_up;
  Buffer act, dgate_up, row_weight;  // from experts_backward_input to experts_backward_weights
  // Set by aggregate_backward (dy_perm holds dout's copies unweighted), as for Qwen3-MoE.
  Tensor topk_weight, copy_row, dtopk_weight;
};

struct GptOssTypes {  // as Qwen3MoeTypes
  using Config = GptOssConfig;
  using Weights = GptOssWeights;
  using LayerWeights = GptOssLayerWeights;
  using Batch = GptOssBatch;
  using AttentionActivations = GptOssAttentionActivations;
  using ExpertActivations = GptOssExpertActivations;
  static constexpr const char* name = "GptOss";
};

// The accessors, prolog, stage 5 and the epilog are MoeModelBase's (models/common.h); stage 3 is its own.
class GptOss : public MoeModelBase<GptOss, GptOssTypes> {
 public:
  static constexpr const char* model_type = "gpt_oss";

  GptOss(const Config& config, DType dtype, Device device, ExpertShard experts = {});

  int64_t num_active_parameters() const;
  int64_t attention_width() const { return config_.num_heads * config_.head_dim; }
  // Attention's FLOPs per token, forward and backward, by Qwen3Moe's convention (S / 2 keys a query
  // in a full layer); a sliding layer's query sees W - W^2 / (2 S) keys on average, the same at W = S.
  double attention_flops_per_token(int64_t seq) const;

  GptOssWeights bind(const Placement& placement) const;
  // Hugging Face's initialisation: normal(0, initializer_range) for matrices, embeddings, sinks and
  // the router's bias, zeros for the other biases, ones for norms (a whole arena: MoeModelBase's).
  using MoeModelBase::initialize;
  void initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const;

  // Stage 1 and its backward: see Qwen3Moe. The sinks' gradient is added in the backward.
  void attention_forward(GptOssAttentionActivations& a, Buffer x, const GptOssBatch& batch, const GptOssLayerWeights& w) const;
  void attention_backward(Tensor dx, const GptOssLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight, double aux_grad,
                          GptOssAttentionActivations& a, const GptOssBatch& batch, const GptOssLayerWeights& w) const;

  // Stage 3 and its backward: SwigluMoeModel's contract (models/common.h); the biases' gradients are
  // written or added with the weights'. The quantized experts (fp8_expert_weights): the forward
  // multiplies by the transposed copies, the backward input by those as stored.
  void experts_forward(Tensor y_perm, GptOssExpertActivations& e, Buffer x_perm, Tensor expert_offsets, const GptOssLayerWeights& w) const;
  int64_t expert_squares_count(const GptOssLayerWeights& grads) const;
  void experts_backward_input(Tensor dx_perm, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                              const GptOssLayerWeights& w) const;
  void experts_backward_weights(const GptOssLayerWeights& grads, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                bool overwrite_grads, Tensor squares = {}, Tensor known_zero = {}) const;
  // Two micro-batches' weight gradients: the earlier one's, then e's (the same bits as two calls).
  void experts_backward_weights_pair(const GptOssLayerWeights& grads, Tensor earlier_dy_perm, GptOssExpertActivations& earlier,
                                     Tensor earlier_offsets, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                     bool overwrite_grads, Tensor squares = {}, Tensor known_zero = {}) const;

  ModelActivationBytes activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const;

 private:
  int64_t window(const GptOssLayerWeights& w) const;
};

}  // namespace marrow
