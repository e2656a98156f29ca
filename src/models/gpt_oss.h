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
#include <memory>
#include <string>
#include <vector>

#include "ops/attention_runner.h"
#include "core/host_sum.h"
#include "core/json.h"
#include "core/memory.h"
#include "core/stage_bytes.h"
#include "core/tensor_spec.h"
#include "models/common.h"
#include "ops/rope.h"

namespace marrow {

struct GptOssConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t num_experts = 0, top_k = 0, expert_intermediate_size = 0, sliding_window = 0;
  double rms_norm_eps = 1e-5, initializer_range = 0.02, router_aux_loss_coef = 0.001;
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

class GptOss {
 public:
  using Config = GptOssConfig;
  using Weights = GptOssWeights;
  using LayerWeights = GptOssLayerWeights;
  using Batch = GptOssBatch;
  using AttentionActivations = GptOssAttentionActivations;
  using ExpertActivations = GptOssExpertActivations;
  using EpilogActivations = marrow::EpilogActivations;
  static constexpr const char* model_type = "gpt_oss";

  GptOss(const Config& config, DType dtype, Device device, ExpertShard experts = {});

  const Config& config() const { return config_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t num_layers() const { return config_.num_layers; }
  int64_t num_experts() const { return config_.num_experts; }
  int64_t num_local_experts() const { return experts_.count; }
  int64_t top_k() const { return config_.top_k; }
  int64_t hidden_size() const { return config_.hidden_size; }
  const std::vector<TensorSpec>& specs() const { return specs_; }
  int64_t num_parameters() const { return num_parameters_; }
  int64_t num_active_parameters() const;
  int64_t attention_width() const { return config_.num_heads * config_.head_dim; }
  // Attention's FLOPs per token, forward and backward, by Qwen3Moe's convention (S / 2 keys a query
  // in a full layer); a sliding layer's query sees W - W^2 / (2 S) keys on average, the same at W = S.
  double attention_flops_per_token(int64_t seq) const;

  GptOssWeights bind(const Placement& placement) const;
  // Hugging Face's initialisation: normal(0, initializer_range) for matrices, embeddings, sinks and
  // the router's bias, zeros for the other biases, ones for norms.
  void initialize(const Arena& params, uint64_t seed) const;
  void initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const;

  void prolog_forward(Tensor x, const GptOssBatch& batch, const GptOssWeights& w) const;
  void prolog_backward(const GptOssWeights& grads, Tensor dx, const GptOssBatch& batch, Tensor known_zero = {}) const;
  int64_t prolog_known_zero_count() const { return config_.vocab_size; }
  std::vector<std::pair<Tensor, Tensor>> prolog_known_zero_parts(const GptOssWeights& grads, Tensor known_zero) const {
    return {{grads.embed, known_zero}};
  }

  // Stage 1 and its backward: see Qwen3Moe. The sinks' gradient is added in the backward.
  void attention_forward(GptOssAttentionActivations& a, Buffer x, const GptOssBatch& batch, const GptOssLayerWeights& w) const;
  void attention_backward(Tensor dx, const GptOssLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight, double aux_grad,
                          GptOssAttentionActivations& a, const GptOssBatch& batch, const GptOssLayerWeights& w) const;
  void add_aux_loss(Tensor total, const GptOssAttentionActivations& a) const;

  // Stage 3 and its backward: see Qwen3Moe; the biases' gradients are written or added with the weights'.
  void experts_forward(Tensor y_perm, GptOssExpertActivations& e, Buffer x_perm, Tensor expert_offsets, const GptOssLayerWeights& w) const;
  int64_t expert_squares_count(const GptOssLayerWeights& grads) const;
  int64_t expert_known_zero_count(const GptOssLayerWeights& grads) const;
  std::vector<std::pair<Tensor, Tensor>> expert_known_zero_parts(const GptOssLayerWeights& grads, Tensor known_zero) const;
  void experts_backward_input(Tensor dx_perm, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                              const GptOssLayerWeights& w) const;
  void experts_backward_weights(const GptOssLayerWeights& grads, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                bool overwrite_grads, Tensor squares = {}, Tensor known_zero = {}) const;
  // Two micro-batches' weight gradients: the earlier one's, then e's (the same bits as two calls).
  void experts_backward_weights_pair(const GptOssLayerWeights& grads, Tensor earlier_dy_perm, GptOssExpertActivations& earlier,
                                     Tensor earlier_offsets, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                     bool overwrite_grads, Tensor squares = {}, Tensor known_zero = {}) const;
  void experts_drop_input(GptOssExpertActivations& e) const { e.x_perm = Buffer{}; }
  void experts_restore_input(GptOssExpertActivations& e, Buffer x_perm) const { e.x_perm = std::move(x_perm); }

  // Stage 5: see Qwen3Moe.
  void aggregate_forward(Tensor out, const GptOssAttentionActivations& a, Tensor y_perm, Tensor copy_row) const;
  void aggregate_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, const GptOssAttentionActivations& a, Tensor copy_row,
                          GptOssExpertActivations& e) const;
  void aggregate_backward_rows(Tensor dy_perm, Tensor dout, Tensor copy_row) const;

  // Epilog: models/common.h's, as for Qwen3-MoE.
  HostSum epilog_forward(EpilogActivations& p, Buffer x, const GptOssBatch& batch, const GptOssWeights& w,
                         const GptOssWeights* grads = nullptr, double loss_scale = 1, bool overwrite_grads = false) const;
  void epilog_backward(Tensor dx, const GptOssWeights& grads, double loss_scale, EpilogActivations& p, const GptOssBatch& batch,
                       const GptOssWeights& w, bool overwrite_grads = false) const;

  ModelActivationBytes activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const;

  Buffer buffer(std::initializer_list<int64_t> dims) const { return Buffer(dtype_, device_, dims); }
  // Statistics (norm scales, lse, router probabilities and weights): f32 on the GPU, as Qwen3-MoE's.
  Buffer stats(std::initializer_list<int64_t> dims) const { return Buffer(device_ == Device::cuda ? DType::f32 : dtype_, device_, dims); }

 private:
  Buffer input_norm(GptOssAttentionActivations& a, const GptOssLayerWeights& w) const;
  int64_t window(const GptOssLayerWeights& w) const;
  LmHead lm_head(const GptOssWeights& w, int64_t tokens) const;
  // With expert_fp8(): the layer's quantized experts (forward: transposed, backward input: as stored).
  const Fp8ExpertWeights& fp8_expert_weights(const GptOssLayerWeights& w) const;

  Config config_;
  DType dtype_;
  Device device_;
  std::vector<TensorSpec> specs_;
  int64_t num_parameters_ = 0;
  ExpertShard experts_;  // the experts this process holds: rows [first, first + count) of the fused tensors
  // Shared by the copies of the model (as Qwen3Moe's), so a layer is quantized once per weights change.
  std::shared_ptr<std::vector<Fp8ExpertWeights>> fp8_weights_ = std::make_shared<std::vector<Fp8ExpertWeights>>();
};

}  // namespace marrow
