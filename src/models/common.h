// What the model families share (each family's file still reads top to bottom): config.json
// reading, the canonical parameter table, Hugging Face's initialisation, the epilog (final norm ->
// LM head -> cross-entropy), the SwiGLU experts of the families that route to them, the records of a
// layer's grouped expert gradients, and the members of the engine's stage interface every family's
// class inherits (MoeModelBase, SwigluMoeModel), their contract written once here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/host_sum.h"
#include "core/json.h"
#include "core/memory.h"
#include "core/stage_bytes.h"
#include "core/tensor_spec.h"
#include "ops/combine.h"
#include "ops/dispatch.h"
#include "ops/embedding.h"
#include "ops/fp8.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"

namespace marrow {

// The start of a family's config.json: model_type and architectures (when given) name the family,
// and the features no family implements are refused (tied embeddings, attention dropout).
void expect_family(const JsonFields& f, const std::string& source, const char* model_type, const char* architecture);

// The fields both families' config.json files name alike, read into c (sizes positive, head_dim
// hidden_size / heads when absent; one sentence naming a bad key), then the checks of their values.
template <class C> void read_shared_fields(C& c, const JsonFields& f, double default_eps) {
  c.vocab_size = f.positive("vocab_size");
  c.hidden_size = f.positive("hidden_size");
  c.num_layers = f.positive("num_hidden_layers");
  c.num_heads = f.positive("num_attention_heads");
  c.num_kv_heads = f.positive("num_key_value_heads");
  c.head_dim = f.positive("head_dim", c.hidden_size / c.num_heads);
  c.top_k = f.positive("num_experts_per_tok");
  c.rms_norm_eps = f.number("rms_norm_eps", default_eps);
  c.initializer_range = f.number("initializer_range", 0.02);
  c.router_aux_loss_coef = f.number("router_aux_loss_coef", 0.001);
}
// RoPE as transformers 5 reads a config.json (modeling_rope_utils), so Marrow computes the model
// transformers loads: the settings are rope_scaling when a non-empty object, else rope_parameters,
// else `fallback` (the family's default); rope_type, else the older `type`, else "default";
// rope_theta its own, else the top-level one, else default_theta; yarn's
// original_max_position_embeddings the top-level one, else its own, else max_position_embeddings.
// Settings per layer type, keys Marrow does not compute and other rope_types are refused.
// allow_mscale: DeepSeek's mscale and mscale_all_dim (yarn's attention_factor from their ratio).
RopeParameters read_rope(const JsonFields& f, const std::string& source, double default_theta, const Json& fallback, bool allow_yarn,
                         bool allow_mscale = false);
// The settings object read_rope reads (rope_scaling, rope_parameters or fallback).
const Json& rope_settings(const JsonFields& f, const Json& fallback);

// experts_key: the key the family's experts count is named by in messages.
template <class C> void check_shared_values(const C& c, double rope_theta, const std::string& source, const char* experts_key) {
  MARROW_CHECK(c.rms_norm_eps > 0, "{}: rms_norm_eps must be positive, got {}", source, c.rms_norm_eps);
  MARROW_CHECK(rope_theta > 0, "{}: rope_theta must be positive, got {}", source, rope_theta);
  MARROW_CHECK(c.initializer_range > 0, "{}: initializer_range must be positive, got {}", source, c.initializer_range);
  MARROW_CHECK(c.router_aux_loss_coef >= 0, "{}: router_aux_loss_coef must not be negative, got {}", source, c.router_aux_loss_coef);
  MARROW_CHECK(c.num_heads % c.num_kv_heads == 0, "{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", source,
               c.num_heads, c.num_kv_heads);
  MARROW_CHECK(c.head_dim % 2 == 0, "{}: head_dim must be even for rotary embeddings, got {}", source, c.head_dim);
  MARROW_CHECK(c.top_k <= c.num_experts, "{}: num_experts_per_tok ({}) exceeds {} ({})", source, c.top_k, experts_key, c.num_experts);
}

// What a parameter is, for its initialisation, weight decay and optimizer (TensorSpec::is_norm,
// decayed, orthogonalized): a matrix maps activations (Muon's); a table's rows stand for one token or
// expert each (the embeddings, the LM head, the router: decayed, AdamW's); a bias is any vector added
// to activations or logits (GPT-OSS's sinks too).
enum class ParamKind { matrix, table, norm, bias };

// A family's canonical parameter table, built tensor by tensor in its order; the expert weights'
// and the LM head's gradients are first_backward_writes. A unit's matrices come before its biases
// (ShardedParameters' units), so AdamW runs once decayed and once not per unit.
struct ParameterTable {
  explicit ParameterTable(int64_t num_layers) : num_layers(num_layers) {}
  int64_t num_layers;
  int64_t layer = -1;  // TensorSpec::layer of the tensors added next: -1 the prolog, num_layers the epilog
  std::vector<TensorSpec> specs;
  int64_t numel = 0;
  void add(std::string name, std::vector<int64_t> shape, ParamKind kind, bool is_expert = false);
  // Rows [first, first + count) of a fused expert tensor of canonical shape [E, ...]: one expert-parallel
  // rank's experts (TensorSpec::canonical_first); the whole tensor when they are all E.
  void add_expert_rows(std::string name, std::vector<int64_t> canonical_shape, int64_t first, int64_t count,
                       ParamKind kind = ParamKind::matrix);
};

// Views of a placement's tensors in the table's order, each in the shape the family computes with
// (count: how many table entries one view spans, e.g. a layer's per-expert tensors as one).
class TableCursor {
 public:
  TableCursor(const std::vector<TensorSpec>& specs, const Placement& placement) : specs_(specs), placement_(placement) {}
  Tensor take(std::initializer_list<int64_t> dims, int64_t count = 1);
  void expect_end() const;

 private:
  const std::vector<TensorSpec>& specs_;
  const Placement& placement_;
  size_t next_ = 0;
};

// Packed documents (data.document_mask): a batch's positions, which restart at each document, as
// attention's per-query document positions [B, S] (ops/attention.h); empty when off.
template <class Batch> Tensor batch_documents(const Batch& batch) {
  return batch.documents ? batch.positions.view().reshape({batch.batch, batch.seq}) : Tensor{};
}

// Hugging Face's initialisation of elements [first, first + out.numel()) of one tensor: ones for a
// norm, zeros where `zeros`, else normal(0, std) with element i drawing Philox(seed, name) at i, so a
// shard starts from the slice of the whole tensor's values.
void initialize_tensor(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed, double std, bool zeros = false);

// Every tensor of a model's table initialised (M::initialize of one tensor) into a parameter arena.
template <class M> void initialize_parameters(const M& model, const Arena& params, uint64_t seed) {
  MARROW_CHECK(params.all().numel() == model.num_parameters(), "parameter arena holds {} elements but the model has {}",
               params.all().numel(), model.num_parameters());
  for (const TensorSpec& s : model.specs()) model.initialize(params.slice(s.offset, {s.numel}), s, 0, seed);
}

// The epilog's activations: x, its norm h and rstd, the logits when kept whole, lse and token
// losses; dh, the final norm's output gradient, when the forward ran the LM head's backward.
struct EpilogActivations {
  Buffer x, h, rstd, logits, lse, token_loss;
  Buffer dh;
};

// The LM head as the epilog runs it: weights, the final norm's epsilon, the tokens per logits chunk
// (logits_chunk) and the dtypes of activations and of statistics (lse, losses, rstd).
struct LmHead {
  NormWeight final_norm;  // the final norm's weight and offset (Qwen3.5's zero-centred norms: 1)
  Tensor lm_head;
  double eps;
  int64_t chunk;
  DType dtype, stats_dtype;
  Device device;
};

// The logits of a micro-batch stay whole in p.logits for the backward up to kWholeLogitsBytes;
// past that they exist one chunk of tokens at a time, the fewest even chunks of at most
// kLogitsChunkBytes. Chunks are large because each one after the first reads and writes the head's
// f32 gradient once more (docs/performance.md). forced > 0 (tests) takes that many tokens a chunk.
constexpr int64_t kWholeLogitsBytes = int64_t(8) << 30;
constexpr int64_t kLogitsChunkBytes = int64_t(2) << 30;
int64_t logits_chunk(int64_t tokens, int64_t vocab, DType dtype, int64_t forced = 0);

// Epilog forward of x [T, H]; returns the sum of token losses over non-ignored targets. With
// lm_head_grad (a training forward: the gradient, loss_scale and overwrite of epilog_backward) and
// chunked logits it runs each chunk's backward at once (the head's gradient and the rows of p.dh),
// so no chunk is computed twice; otherwise the backward computes each chunk again. Either way the
// same logits, the head's gradient summed over the chunks in order.
HostSum epilog_forward(EpilogActivations& p, Buffer x, Tensor targets, const LmHead& head, Tensor lm_head_grad = {}, double loss_scale = 1,
                       bool overwrite = false);
// dx (overwritten); loss_scale = d(total loss)/d(sum of token losses); overwrite: write the LM
// head's gradient instead of adding (the step's first micro-batch). Releases p.
void epilog_backward(Tensor dx, Tensor final_norm_grad, Tensor lm_head_grad, double loss_scale, EpilogActivations& p, Tensor targets,
                     const LmHead& head, bool overwrite = false);
// Device bytes the epilog keeps from its forward to its backward, and its scratch in each (T tokens,
// hidden H, vocab V, a and s bytes per activation and statistic).
StageBytes epilog_bytes(int64_t T, int64_t H, int64_t V, int64_t chunk, int64_t a, int64_t s);

// With expert_fp8() (train.fp8): a layer's two fused expert weights quantized by 128 x 128 blocks,
// as stored and transposed (the forward multiplies by one, the backward input by the other). Made
// at a layer's first use after the weights changed (core/weights_generation.h): 2 bytes a local
// expert parameter besides the bf16 weights (marrow estimate counts them).
struct Fp8ExpertWeights {
  Fp8Buffer gate_up, gate_up_t, down, down_t;
  uint64_t generation = 0;
  const void* source = nullptr;  // the bf16 weights they were made from
};
// Layer `layer`'s entry of cache (num_layers entries once used) for its bf16 weights gate_up and
// down [E, ., .], quantized again when they changed.
const Fp8ExpertWeights& fp8_expert_weights(std::vector<Fp8ExpertWeights>& cache, int64_t layer, int64_t num_layers, Tensor gate_up,
                                           Tensor down);
// y[R, N] from x[R, K] and an expert weight quantized as [E, N, K] (grouped_linear_forward's
// product), through FP8: x quantized by rows for the call.
void fp8_grouped(Tensor y, Tensor x, const Fp8Buffer& w, Tensor expert_offsets);

// The number of sums of squares grouped_linear_backward_weight writes for dweight [E, O, I].
int64_t grouped_squares_count(Tensor dweight);
// A layer's record of its expert gradients (squares or known-zero flags) cut at `first` (empty
// halves when the record is not given; a record of another length is an error naming it).
std::pair<Tensor, Tensor> split_record(const char* name, Tensor record, int64_t first, int64_t expected);

// Stage 3 of the families whose experts are SwiGLU MLPs (Qwen3-MoE, DeepSeek-V2): gate_up [E, 2I, H]
// then down [E, H, I] as grouped GEMMs over the dispatched rows (SwigluMoeModel below states the
// contract). The SwiGLU output is not kept: the backward computes it again from gate_up (a cheap
// elementwise pass), R x I activations less per layer until then.
struct SwigluExpertActivations {
  Buffer x_perm, gate_up;
  Buffer act, dgate_up;  // from experts_backward_input (act computed again there) to the weights' half
  // Set by aggregate_backward (dy_perm holds dout's copies unweighted): the input half applies the
  // routing weights and writes their gradient (swiglu_weighted_backward).
  Tensor topk_weight, copy_row, dtopk_weight;
};
struct SwigluExperts {
  Tensor gate_up, down;                  // this process's experts' bf16 (or fp32) weights
  const Fp8ExpertWeights* fp8;           // with expert_fp8(): their quantized copies, else null
  DType dtype;                           // of the activations
  Device device;
};
void swiglu_experts_forward(Tensor y_perm, SwigluExpertActivations& e, Buffer x_perm, Tensor expert_offsets, const SwigluExperts& w);
void swiglu_experts_backward_input(Tensor dx_perm, Tensor dy_perm, SwigluExpertActivations& e, Tensor expert_offsets, const SwigluExperts& w);
// ddown, dgate_up: the layer's expert gradients; squares and known_zero as the family's contract
// (down's part first). Releases e.
void swiglu_experts_backward_weights(Tensor ddown, Tensor dgate_up, Tensor dy_perm, SwigluExpertActivations& e, Tensor expert_offsets,
                                     bool overwrite_grads, Tensor squares, Tensor known_zero);
// Two micro-batches' in one pass: the earlier one's bits as alone (overwrite_grads applies to it), then e's.
void swiglu_experts_backward_weights_pair(Tensor ddown, Tensor dgate_up, Tensor earlier_dy_perm, SwigluExpertActivations& earlier,
                                          Tensor earlier_offsets, Tensor dy_perm, SwigluExpertActivations& e, Tensor expert_offsets,
                                          bool overwrite_grads, Tensor squares, Tensor known_zero);

// Whether a layer has routed experts: all but DeepSeek-V2's first dense ones (LayerWeights::dense).
template <class L> bool has_experts(const L& w) {
  if constexpr (requires { w.dense; }) return !w.dense;
  else return true;
}

// The members every family's model shares, as the engine calls them (engine/model.h's MoeModel),
// written once: the accessors, the prolog, stage 1's input norm and load-balance loss, stage 5, the
// expert gradients' known-zero flags, the epilog and the data they read. A family's class derives
// from it (or from SwigluMoeModel) with itself as Model and Types naming its structs (Config,
// Weights, LayerWeights, Batch, AttentionActivations, ExpertActivations) and `name`, its class in
// messages; it adds stages 1 and 3, bind and activation_bytes, and fills specs_ and num_parameters_
// from its ParameterTable.
template <class Model, class Types> class MoeModelBase {
 public:
  using Config = typename Types::Config;
  using Weights = typename Types::Weights;
  using LayerWeights = typename Types::LayerWeights;
  using Batch = typename Types::Batch;
  using AttentionActivations = typename Types::AttentionActivations;
  using ExpertActivations = typename Types::ExpertActivations;
  using EpilogActivations = marrow::EpilogActivations;

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

  // Hugging Face's initialisation (normal(0, initializer_range), ones for norms: initialize_tensor),
  // of a whole arena through Model's initialize of one tensor, or of elements [first, first +
  // out.numel()) of one tensor (a family initialising some tensors otherwise declares its own).
  void initialize(const Arena& params, uint64_t seed) const { initialize_parameters(static_cast<const Model&>(*this), params, seed); }
  void initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const {
    initialize_tensor(out, spec, first, seed, config_.initializer_range);
  }

  // Prolog: x[T, H] = embed[input_ids].
  void prolog_forward(Tensor x, const Batch& batch, const Weights& w) const { embedding_forward(x, batch.input_ids, w.embed); }
  // known_zero (i32 [prolog_known_zero_count()]), when given: the embedding gradient's row flags
  // (ops/known_zero.h); the backward clears those of the rows it adds to.
  void prolog_backward(const Weights& grads, Tensor dx, const Batch& batch, Tensor known_zero = {}) const {
    embedding_backward(grads.embed, dx, batch.input_ids, known_zero);
  }
  int64_t prolog_known_zero_count() const { return config_.vocab_size; }
  // The gradients known_zero's flags describe (one a row), for the norm and AdamW to skip.
  std::vector<std::pair<Tensor, Tensor>> prolog_known_zero_parts(const Weights& grads, Tensor known_zero) const {
    return {{grads.embed, known_zero}};
  }

  // total[0] += this layer's load-balance loss (ops/router.h: K when routing is balanced) from
  // a.routing_stats, on the model's device (total: f64 [1]; no host read).
  void add_aux_loss(Tensor total, const AttentionActivations& a) const { router_aux_loss_add(total, a.routing_stats); }
  // train.expert_bias_update: f32 [layers, E] added to the probabilities for the choice (ops/router.h), its owner's to keep.
  void set_expert_bias(Tensor bias) { expert_bias_ = bias; }

  // Stage 3's known-zero flags of a layer's grouped expert gradients (experts_backward_weights'
  // known_zero): one an expert, down's then gate_up's, each part with its gradient; none without experts.
  int64_t expert_known_zero_count(const LayerWeights& grads) const {
    return has_experts(grads) ? grads.experts_down.size(0) + grads.experts_gate_up.size(0) : 0;
  }
  std::vector<std::pair<Tensor, Tensor>> expert_known_zero_parts(const LayerWeights& grads, Tensor known_zero) const {
    if (!has_experts(grads)) return {};
    const int64_t down = grads.experts_down.size(0);
    return {{grads.experts_down, known_zero.rows(0, down)}, {grads.experts_gate_up, known_zero.rows(down, known_zero.numel())}};
  }
  // With one expert-parallel rank x_perm is a gather of h2, which the engine may drop and redo.
  void experts_drop_input(ExpertActivations& e) const { e.x_perm = Buffer{}; }
  void experts_restore_input(ExpertActivations& e, Buffer x_perm) const { e.x_perm = std::move(x_perm); }
  // With expert_fp8(): the layer's quantized experts (which copy each pass multiplies by is the family's).
  const Fp8ExpertWeights& fp8_expert_weights(const LayerWeights& w) const {
    return marrow::fp8_expert_weights(*fp8_weights_, w.layer, config_.num_layers, w.experts_gate_up, w.experts_down);
  }

  // Stage 5: out = x_mid + sum_j topk_weight[t, j] * y_perm[copy_row[t, j]].
  void aggregate_forward(Tensor out, const AttentionActivations& a, Tensor y_perm, Tensor copy_row) const {
    combine_forward(out, a.x_mid, y_perm, a.topk_weight, copy_row);
  }
  // With one expert-parallel rank: dy_perm (overwritten) = dout's copies, unweighted; e takes the
  // routing weights, the copies' rows and where their gradient goes, for experts_backward_input to
  // apply them (ops/swiglu.h's weighted backwards), so y_perm need not be kept. The residual's
  // gradient is dout itself. (Under expert parallelism: expert_parallel.h.)
  void aggregate_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, const AttentionActivations& a, Tensor copy_row,
                          ExpertActivations& e) const {
    aggregate_backward_rows(dy_perm, dout, copy_row);
    e.topk_weight = a.topk_weight;
    e.copy_row = copy_row;
    e.dtopk_weight = dtopk_weight;
  }
  // aggregate_backward's dy_perm again (a deferred layer keeps dout [T, H], not dy_perm [T x K, H]).
  void aggregate_backward_rows(Tensor dy_perm, Tensor dout, Tensor copy_row) const { dispatch_forward(dy_perm, dout, copy_row); }

  // Epilog: epilog_forward and epilog_backward above with the model's LM head. Tokens per logits
  // chunk for a micro-batch of `tokens`; set_logits_chunk(n > 0) forces n (tests), 0 restores the rule.
  int64_t logits_chunk(int64_t tokens) const { return marrow::logits_chunk(tokens, config_.vocab_size, dtype_, forced_logits_chunk_); }
  void set_logits_chunk(int64_t tokens) { forced_logits_chunk_ = tokens; }
  HostSum epilog_forward(EpilogActivations& p, Buffer x, const Batch& batch, const Weights& w, const Weights* grads = nullptr,
                         double loss_scale = 1, bool overwrite_grads = false) const {
    const int64_t T = batch.batch * batch.seq;
    expect_shape(kEpilogForward.c_str(), "x", x, {T, config_.hidden_size});
    return marrow::epilog_forward(p, std::move(x), batch.targets, lm_head(w, T), grads ? grads->lm_head : Tensor{}, loss_scale, overwrite_grads);
  }
  void epilog_backward(Tensor dx, const Weights& grads, double loss_scale, EpilogActivations& p, const Batch& batch, const Weights& w,
                       bool overwrite_grads = false) const {
    marrow::epilog_backward(dx, grads.final_norm, grads.lm_head, loss_scale, p, batch.targets, lm_head(w, batch.batch * batch.seq),
                            overwrite_grads);
  }

  // Activations in the model's dtype; statistics (norm scales, lse, routing, losses) f32 on the GPU.
  Buffer buffer(std::initializer_list<int64_t> dims) const { return Buffer(dtype_, device_, dims); }
  Buffer stats(std::initializer_list<int64_t> dims) const { return Buffer(stats_dtype(), device_, dims); }

 protected:
  // experts: the experts of each layer this process holds (expert parallelism); all of them by default.
  MoeModelBase(const Config& config, DType dtype, Device device, ExpertShard experts)
      : config_(config), dtype_(dtype), device_(device), experts_(experts) {
    if (experts_.count < 0) experts_ = {0, config_.num_experts};
    MARROW_CHECK(experts_.first >= 0 && experts_.count >= 1 && experts_.first + experts_.count <= config_.num_experts,
                 "experts [{}, {}) are not a range of the model's {} experts", experts_.first, experts_.first + experts_.count,
                 config_.num_experts);
  }
  // Stage 1's h1 = the input norm of a.x, writing a.rstd1 (again, with the same bits, in the backward).
  Buffer input_norm(AttentionActivations& a, const LayerWeights& w) const {
    Buffer h1 = buffer({a.x.view().size(0), config_.hidden_size});
    rmsnorm_forward(h1, a.rstd1, a.x, {w.input_norm, kNormOffset}, config_.rms_norm_eps);
    return h1;
  }
  DType stats_dtype() const { return device_ == Device::cuda ? DType::f32 : dtype_; }
  // Stage 1's routing of logits [T, E] into a.probs, a.topk_index, a.topk_weight, a.routing_stats: one
  // row of statistics, or with sequence_aux (train.load_balance = "sequence") one a sequence of the
  // data group, the other processes' rows zeros here (engine/model.h): the engine's sum over
  // processes leaves each row its sequence's statistics, the context-parallel shares added up.
  void route_tokens(AttentionActivations& a, Tensor logits, const Batch& batch, RouterOptions options, int64_t layer) const {
    const int64_t T = logits.size(0), E = config_.num_experts;
    a.probs = stats({T, E});
    a.topk_index = Buffer(DType::i32, device_, {T, config_.top_k});
    a.topk_weight = stats({T, config_.top_k});
    if (expert_bias_.data) options.selection_bias = expert_bias_.rows(layer, layer + 1).reshape({E});
    router_forward(a.probs, a.topk_index, a.topk_weight, logits, options);
    const StatisticsRows r = statistics_rows(batch);
    if (r.total == 0) {
      a.routing_stats = stats({2 * E + 1});
      return router_statistics(a.routing_stats, a.probs, a.topk_index);
    }
    a.routing_stats = stats({r.total, 2 * E + 1});
    if (r.total > batch.batch) fill_zero(a.routing_stats);
    router_statistics_grouped(a.routing_stats.view().rows(r.first, r.first + batch.batch), a.probs, a.topk_index, batch.seq);
  }
  // route_tokens's backward: the loss is the mean over every row, router_backward's over this micro-batch's.
  void route_tokens_backward(Tensor dlogits, Tensor dtopk_weight, const AttentionActivations& a, const Batch& batch, const RouterOptions& options,
                      double aux_grad) const {
    const StatisticsRows r = statistics_rows(batch);
    if (r.total == 0) return router_backward(dlogits, dtopk_weight, a.probs, a.topk_index, a.topk_weight, options, aux_grad, a.routing_stats);
    router_backward(dlogits, dtopk_weight, a.probs, a.topk_index, a.topk_weight, options, aux_grad * double(batch.batch) / double(r.total),
                    a.routing_stats.view().rows(r.first, r.first + batch.batch));
  }
  // No rows (total 0): one row of every token; else the batch's rows, its own B without the engine's.
  StatisticsRows statistics_rows(const Batch& batch) const {
    if (!config_.sequence_aux) return {};
    return batch.sequences.total > 0 ? batch.sequences : StatisticsRows{0, batch.batch};
  }
  LmHead lm_head(const Weights& w, int64_t tokens) const {
    return {{w.final_norm, kNormOffset}, w.lm_head, config_.rms_norm_eps, logits_chunk(tokens), dtype_, stats_dtype(), device_};
  }

  // Added to every RMSNorm weight of the family where it scales (Types::norm_offset; 0 when not given).
  static constexpr float kNormOffset = [] {
    if constexpr (requires { Types::norm_offset; }) return Types::norm_offset;
    else return 0.f;
  }();

  Config config_;
  DType dtype_;
  Device device_;
  ExpertShard experts_;  // rows [first, first + count) of each layer's experts
  int64_t forced_logits_chunk_ = 0;
  Tensor expert_bias_;  // set_expert_bias; empty: none
  std::vector<TensorSpec> specs_;
  int64_t num_parameters_ = 0;
  // By layer; shared by copies of the model (they see the same weights), so a layer is quantized once per weights change.
  std::shared_ptr<std::vector<Fp8ExpertWeights>> fp8_weights_ = std::make_shared<std::vector<Fp8ExpertWeights>>();

 private:
  static inline const std::string kEpilogForward = std::string(Types::name) + "::epilog_forward";  // expect_shape's op
};

// Stage 3 of the families whose experts are SwiGLU MLPs (Qwen3-MoE, DeepSeek-V2): the swiglu_experts_*
// above on the layer's experts_gate_up and experts_down.
template <class Model, class Types> class SwigluMoeModel : public MoeModelBase<Model, Types> {
  using Base = MoeModelBase<Model, Types>;

 public:
  using typename Base::ExpertActivations;
  using typename Base::LayerWeights;

  // Stage 3: y_perm[R, H] from the dispatched rows x_perm[R, H] (kept in e.x_perm).
  void experts_forward(Tensor y_perm, ExpertActivations& e, Buffer x_perm, Tensor expert_offsets, const LayerWeights& w) const {
    swiglu_experts_forward(y_perm, e, std::move(x_perm), expert_offsets, swiglu_experts(w));
  }
  // The backward in two halves, so the weight gradients can wait (zero bubble, pairs): the input
  // gradient (e keeps what the weights need), then with the same dy_perm the weights (releasing e).
  // overwrite_grads: write the expert weight gradients instead of adding (first_backward_writes).
  // squares (f64 [expert_squares_count]) and known_zero (i32 [expert_known_zero_count]), when
  // given: grouped_linear_backward_weight's sums of squares and all-zero flags, down then gate_up
  // (the flags kept from step to step, so an empty expert's zeros are written only once).
  void experts_backward_input(Tensor dx_perm, Tensor dy_perm, ExpertActivations& e, Tensor expert_offsets, const LayerWeights& w) const {
    swiglu_experts_backward_input(dx_perm, dy_perm, e, expert_offsets, swiglu_experts(w));
  }
  void experts_backward_weights(const LayerWeights& grads, Tensor dy_perm, ExpertActivations& e, Tensor expert_offsets, bool overwrite_grads,
                                Tensor squares = {}, Tensor known_zero = {}) const {
    swiglu_experts_backward_weights(grads.experts_down, grads.experts_gate_up, dy_perm, e, expert_offsets, overwrite_grads, squares,
                                    known_zero);
  }
  // Two micro-batches' weight gradients in one pass (grouped_linear_backward_weight_pair): the same
  // bits as the earlier one's experts_backward_weights (overwrite_grads applies to it), then e's.
  void experts_backward_weights_pair(const LayerWeights& grads, Tensor earlier_dy_perm, ExpertActivations& earlier, Tensor earlier_offsets,
                                     Tensor dy_perm, ExpertActivations& e, Tensor expert_offsets, bool overwrite_grads, Tensor squares = {},
                                     Tensor known_zero = {}) const {
    swiglu_experts_backward_weights_pair(grads.experts_down, grads.experts_gate_up, earlier_dy_perm, earlier, earlier_offsets, dy_perm, e,
                                         expert_offsets, overwrite_grads, squares, known_zero);
  }
  int64_t expert_squares_count(const LayerWeights& grads) const {
    return has_experts(grads) ? grouped_squares_count(grads.experts_down) + grouped_squares_count(grads.experts_gate_up) : 0;
  }

 protected:
  using Base::Base;

 private:
  // The forward multiplies by the quantized experts as stored, the backward input by their transposes.
  SwigluExperts swiglu_experts(const LayerWeights& w) const {
    return {w.experts_gate_up, w.experts_down, expert_fp8() ? &this->fp8_expert_weights(w) : nullptr, this->dtype_, this->device_};
  }
};

}  // namespace marrow
