// What the model families share, as free functions and plain structs (each family's file still
// reads top to bottom): config.json reading, the canonical parameter table, Hugging Face's
// initialisation, the epilog (final norm -> LM head -> cross-entropy) and the records of a layer's
// grouped expert gradients.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/host_sum.h"
#include "core/json.h"
#include "core/memory.h"
#include "core/stage_bytes.h"
#include "core/tensor_spec.h"
#include "ops/dispatch.h"
#include "ops/fp8.h"
#include "ops/rope.h"

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

// What a parameter is, for its initialisation and weight decay (TensorSpec::is_norm, decayed): a
// bias is any vector added to activations or logits (GPT-OSS's sinks too).
enum class ParamKind { matrix, norm, bias };

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
  Tensor final_norm, lm_head;
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

// Stage 5's backward with one expert-parallel rank, for a family whose experts' backward applies the
// routing weights (ops/swiglu.h's swiglu_weighted_backward): dy_perm (overwritten) = dout's copies
// unweighted; e takes the weights, the copies' rows and where their gradient goes.
template <class A, class E> void aggregate_backward_unweighted(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, const A& a, Tensor copy_row, E& e) {
  dispatch_forward(dy_perm, dout, copy_row);
  e.topk_weight = a.topk_weight;
  e.copy_row = copy_row;
  e.dtopk_weight = dtopk_weight;
}

// A layer's known-zero flags of its grouped expert gradients: one an expert, down's then gate_up's
// (L: a family's layer weights with experts_down and experts_gate_up [E, ., .]).
template <class L> int64_t grouped_known_zero_count(const L& grads) { return grads.experts_down.size(0) + grads.experts_gate_up.size(0); }
template <class L> std::vector<std::pair<Tensor, Tensor>> grouped_known_zero_parts(const L& grads, Tensor known_zero) {
  const int64_t down = grads.experts_down.size(0);
  return {{grads.experts_down, known_zero.rows(0, down)}, {grads.experts_gate_up, known_zero.rows(down, known_zero.numel())}};
}

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

}  // namespace marrow
