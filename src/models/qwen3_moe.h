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
#include <memory>
#include <string>
#include <vector>

#include "ops/attention_runner.h"
#include "core/json.h"
#include "core/host_sum.h"
#include "core/memory.h"
#include "core/stage_bytes.h"
#include "core/tensor_spec.h"
#include "models/common.h"
#include "ops/fp8.h"

namespace marrow {

struct Qwen3MoeConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t num_experts = 0, top_k = 0, expert_intermediate_size = 0;
  double rms_norm_eps = 1e-6, rope_theta = 1e6, initializer_range = 0.02, router_aux_loss_coef = 0.001;
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

struct Qwen3MoeExpertActivations {
  Buffer x_perm, gate_up;
  Buffer act, dgate_up;  // from experts_backward_input (act computed again there) to experts_backward_weights
  // Set by aggregate_backward (dy_perm holds dout's copies unweighted): experts_backward_input
  // applies the routing weights and writes their gradient (swiglu_weighted_backward).
  Tensor topk_weight, copy_row, dtopk_weight;
};

class Qwen3Moe {
 public:
  using Config = Qwen3MoeConfig;
  using Weights = Qwen3MoeWeights;
  using LayerWeights = Qwen3MoeLayerWeights;
  using Batch = Qwen3MoeBatch;
  using AttentionActivations = Qwen3MoeAttentionActivations;
  using ExpertActivations = Qwen3MoeExpertActivations;
  using EpilogActivations = marrow::EpilogActivations;
  static constexpr const char* model_type = "qwen3_moe";

  // experts: the experts of each layer this process holds (expert parallelism).
  Qwen3Moe(const Config& config, DType dtype, Device device, ExpertShard experts = {});

  const Config& config() const { return config_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t num_layers() const { return config_.num_layers; }
  int64_t num_experts() const { return config_.num_experts; }  // the router's choices, over all processes
  int64_t num_local_experts() const { return experts_.count; }
  int64_t top_k() const { return config_.top_k; }
  int64_t hidden_size() const { return config_.hidden_size; }
  // The canonical tensors; the norms come last, all of them in one unit (ShardedParameters).
  const std::vector<TensorSpec>& specs() const { return specs_; }
  int64_t num_parameters() const { return num_parameters_; }
  // Active parameters per token (top-k experts of each layer, everything else), for FLOP counts.
  int64_t num_active_parameters() const;
  int64_t attention_width() const { return config_.num_heads * config_.head_dim; }
  // Causal attention's FLOPs per token, all layers, forward and backward: 6 x seq x width a layer
  // (PyTorch trainers' MFU convention: S / 2 keys a query, 4 products a key and head dim forward, twice backward).
  double attention_flops_per_token(int64_t seq) const { return 6.0 * double(seq) * double(attention_width()) * double(num_layers()); }

  // Views of the table's tensors wherever the placement puts them (an arena, or FSDP's buffers).
  Qwen3MoeWeights bind(const Placement& placement) const;
  // Hugging Face's initialisation (normal(0, initializer_range), ones for norms; models/common.h's
  // initialize_tensor), of a whole arena or of elements [first, first + out.numel()) of one tensor.
  void initialize(const Arena& params, uint64_t seed) const;
  void initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const;

  // Prolog: x[T, H] = embed[input_ids].
  void prolog_forward(Tensor x, const Qwen3MoeBatch& batch, const Qwen3MoeWeights& w) const;
  // known_zero (i32 [prolog_known_zero_count()]), when given: the embedding gradient's row flags
  // (ops/known_zero.h); the backward clears those of the rows it adds to.
  void prolog_backward(const Qwen3MoeWeights& grads, Tensor dx, const Qwen3MoeBatch& batch, Tensor known_zero = {}) const;
  int64_t prolog_known_zero_count() const { return config_.vocab_size; }
  // The gradients known_zero's flags describe (one a row), for the norm and AdamW to skip.
  std::vector<std::pair<Tensor, Tensor>> prolog_known_zero_parts(const Qwen3MoeWeights& grads, Tensor known_zero) const {
    return {{grads.embed, known_zero}};
  }

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
  // total[0] += this layer's load-balance loss (ops/router.h: K when routing is balanced) from
  // a.routing_stats, on the model's device (total: f64 [1]; no host read).
  void add_aux_loss(Tensor total, const Qwen3MoeAttentionActivations& a) const;

  // Stage 3: y_perm[R, H] from the dispatched rows x_perm[R, H] (kept in e.x_perm).
  void experts_forward(Tensor y_perm, Qwen3MoeExpertActivations& e, Buffer x_perm, Tensor expert_offsets,
                       const Qwen3MoeLayerWeights& w) const;
  // The backward in two halves, so the weight gradients can wait (zero bubble, pairs): the input
  // gradient (e keeps what the weights need), then with the same dy_perm the weights (releasing e).
  // overwrite_grads: write the expert weight gradients instead of adding (first_backward_writes).
  // squares (f64 [expert_squares_count]) and known_zero (i32 [expert_known_zero_count]), when
  // given: grouped_linear_backward_weight's sums of squares and all-zero flags, down then gate_up
  // (the flags kept from step to step, so an empty expert's zeros are written only once).
  void experts_backward_input(Tensor dx_perm, Tensor dy_perm, Qwen3MoeExpertActivations& e, Tensor expert_offsets,
                              const Qwen3MoeLayerWeights& w) const;
  void experts_backward_weights(const Qwen3MoeLayerWeights& grads, Tensor dy_perm, Qwen3MoeExpertActivations& e, Tensor expert_offsets,
                                bool overwrite_grads, Tensor squares = {}, Tensor known_zero = {}) const;
  int64_t expert_squares_count(const Qwen3MoeLayerWeights& grads) const;
  int64_t expert_known_zero_count(const Qwen3MoeLayerWeights& grads) const;
  // The layer's expert gradients with their part of known_zero (one flag an expert).
  std::vector<std::pair<Tensor, Tensor>> expert_known_zero_parts(const Qwen3MoeLayerWeights& grads, Tensor known_zero) const;
  // Two micro-batches' weight gradients in one pass (grouped_linear_backward_weight_pair): the same
  // bits as the earlier one's experts_backward_weights (overwrite_grads applies to it), then e's.
  void experts_backward_weights_pair(const Qwen3MoeLayerWeights& grads, Tensor earlier_dy_perm, Qwen3MoeExpertActivations& earlier,
                                     Tensor earlier_offsets, Tensor dy_perm, Qwen3MoeExpertActivations& e, Tensor expert_offsets,
                                     bool overwrite_grads, Tensor squares = {}, Tensor known_zero = {}) const;
  // With one expert-parallel rank x_perm is a gather of h2, which the engine may drop and redo.
  void experts_drop_input(Qwen3MoeExpertActivations& e) const { e.x_perm = Buffer{}; }
  void experts_restore_input(Qwen3MoeExpertActivations& e, Buffer x_perm) const { e.x_perm = std::move(x_perm); }

  // Stage 5: out = x_mid + sum_j topk_weight[t, j] * y_perm[copy_row[t, j]].
  void aggregate_forward(Tensor out, const Qwen3MoeAttentionActivations& a, Tensor y_perm, Tensor copy_row) const;
  // With one expert-parallel rank: dy_perm (overwritten) = dout's copies, unweighted; the routing
  // weights' part waits for experts_backward_input (swiglu_weighted_backward), so y_perm need not
  // be kept. The residual's gradient is dout itself. (Under expert parallelism: expert_parallel.h.)
  void aggregate_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, const Qwen3MoeAttentionActivations& a, Tensor copy_row,
                          Qwen3MoeExpertActivations& e) const;
  // aggregate_backward's dy_perm again (a deferred layer keeps dout [T, H], not dy_perm [T x K, H]).
  void aggregate_backward_rows(Tensor dy_perm, Tensor dout, Tensor copy_row) const;

  // Epilog: models/common.h's. Tokens per logits chunk for a micro-batch of `tokens`;
  // set_logits_chunk(n > 0) forces n (tests), 0 restores the rule.
  int64_t logits_chunk(int64_t tokens) const { return marrow::logits_chunk(tokens, config_.vocab_size, dtype_, forced_logits_chunk_); }
  void set_logits_chunk(int64_t tokens) { forced_logits_chunk_ = tokens; }

  // With expert_fp8(): the layer's quantized experts (forward: as stored, backward input: transposed).
  const Fp8ExpertWeights& fp8_expert_weights(const Qwen3MoeLayerWeights& w) const;
  HostSum epilog_forward(EpilogActivations& p, Buffer x, const Qwen3MoeBatch& batch, const Qwen3MoeWeights& w,
                         const Qwen3MoeWeights* grads = nullptr, double loss_scale = 1, bool overwrite_grads = false) const;
  void epilog_backward(Tensor dx, const Qwen3MoeWeights& grads, double loss_scale, EpilogActivations& p, const Qwen3MoeBatch& batch,
                       const Qwen3MoeWeights& w, bool overwrite_grads = false) const;

  // Device bytes of each stage for one micro-batch of batch x seq tokens, expert_rows token copies
  // a layer through this process's experts (core/stage_bytes.h).
  ModelActivationBytes activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const;

  // Activations in the model's dtype; statistics (norm scales, lse, routing, losses) f32 on the GPU.
  Buffer buffer(std::initializer_list<int64_t> dims) const { return Buffer(dtype_, device_, dims); }
  Buffer stats(std::initializer_list<int64_t> dims) const { return Buffer(device_ == Device::cuda ? DType::f32 : dtype_, device_, dims); }

 private:
  Buffer input_norm(Qwen3MoeAttentionActivations& a, const Qwen3MoeLayerWeights& w) const;
  LmHead lm_head(const Qwen3MoeWeights& w, int64_t tokens) const;
  Tensor rope_cos_sin(const Qwen3MoeBatch& batch) const;
  std::pair<Buffer, Buffer> attention_inputs(Qwen3MoeAttentionActivations& a, const Qwen3MoeBatch& batch,
                                             const Qwen3MoeLayerWeights& w) const;

  Config config_;
  DType dtype_;
  Device device_;
  int64_t forced_logits_chunk_ = 0;
  ExpertShard experts_;
  std::vector<TensorSpec> specs_;
  int64_t num_parameters_ = 0;
  // By layer; shared by copies of the model (they see the same weights).
  std::shared_ptr<std::vector<Fp8ExpertWeights>> fp8_weights_ = std::make_shared<std::vector<Fp8ExpertWeights>>();
};

}  // namespace marrow
