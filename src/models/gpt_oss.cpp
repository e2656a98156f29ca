#include "models/gpt_oss.h"

#include <algorithm>

#include "ops/attention.h"
#include "ops/bias.h"
#include "ops/grad_norm.h"
#include "ops/grouped_linear.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/swiglu.h"

namespace marrow {

namespace {

// transformers' GptOssConfig: yarn when a config names no RoPE settings, theta 150,000 (common.h's
// read_rope reads the rest).
const Json kDefaultRope = {{"rope_type", "yarn"},  {"factor", 32.0},     {"beta_fast", 32.0},
                           {"beta_slow", 1.0},     {"truncate", false}, {"original_max_position_embeddings", 4096}};
constexpr double kDefaultTheta = 150000.0;

// layer_types, or Hugging Face's default: sliding windows on even layers (0, 2, ...).
std::vector<bool> read_layer_types(const JsonFields& f, int64_t layers, const std::string& source) {
  std::vector<bool> sliding(static_cast<size_t>(layers), false);
  for (int64_t i = 0; i < layers; ++i) sliding[size_t(i)] = (i + 1) % 2 == 1;
  if (!f.has("layer_types")) return sliding;
  const Json& types = f.raw("layer_types");
  MARROW_CHECK(types.is_array() && int64_t(types.size()) == layers, "{}: layer_types must list {} layers, got {}", source, layers,
               types.dump());
  for (int64_t i = 0; i < layers; ++i) {
    const Json& t = types[size_t(i)];
    MARROW_CHECK(t == "sliding_attention" || t == "full_attention",
                 "{}: layer_types[{}] is {}, not \"sliding_attention\" or \"full_attention\"", source, i, t.dump());
    sliding[size_t(i)] = t == "sliding_attention";
  }
  return sliding;
}

void check_values(const GptOssConfig& c, const std::string& source) {
  check_shared_values(c, c.rope.theta, source, "num_local_experts");
  MARROW_CHECK(!c.rope.yarn || c.rope.factor >= 1, "{}: the yarn factor must be at least 1, got {}", source, c.rope.factor);
  MARROW_CHECK(c.swiglu_limit > 0, "{}: swiglu_limit must be positive, got {}", source, c.swiglu_limit);
}

void refuse_unsupported(const JsonFields& f, const std::string& source) {
  MARROW_CHECK(f.boolean("attention_bias", true), "{}: attention_bias = false is not supported", source);
  if (f.has("quantization_config")) {
    JsonFields q(f.raw("quantization_config"), source + ": quantization_config");
    MARROW_CHECK(q.string("quant_method") == "mxfp4", "{}: quantization_config.quant_method '{}' is not supported (mxfp4 is, read dequantized)",
                 source, q.string("quant_method"));
  }
}

}  // namespace

ModelSize GptOssConfig::model_size() const {
  const double H = double(hidden_size), D = double(head_dim), E = double(num_experts), I = double(expert_intermediate_size);
  const double q = double(num_heads) * D, kv = double(num_kv_heads) * D;
  const double attention = H * (2.0 * q + 2.0 * kv) + q + 2.0 * kv + H + double(num_heads);
  const double layer = attention + E * H + E + E * (3.0 * H * I + 2.0 * I + H) + 2.0 * H;
  return {double(num_layers) * layer + 2.0 * double(vocab_size) * H + H, double(num_layers) * 17.0 + 3.0};
}

GptOssConfig GptOssConfig::from_json(const Json& json, const std::string& source) {
  JsonFields f(json, source);
  GptOssConfig c;
  c.json = json;
  expect_family(f, source, "gpt_oss", "GptOssForCausalLM");
  read_shared_fields(c, f, 1e-5);
  c.head_dim = f.positive("head_dim", 64);  // transformers' GptOssConfig default, not hidden_size / heads
  c.num_experts = f.has("num_local_experts") ? f.positive("num_local_experts") : f.positive("num_experts");
  c.expert_intermediate_size = f.positive("intermediate_size");
  c.sliding_window = f.positive("sliding_window", 128);
  c.swiglu_alpha = f.number("swiglu_alpha", 1.702);
  c.swiglu_limit = f.number("swiglu_limit", 7.0);
  c.rope = read_rope(f, source, kDefaultTheta, kDefaultRope, true);
  c.sliding = read_layer_types(f, c.num_layers, source);
  check_values(c, source);
  refuse_unsupported(f, source);
  // MXFP4 experts (the Hub's checkpoints) are read dequantized (engine/hf_format.h), so what Marrow
  // holds and writes back is not quantized.
  c.json.erase("quantization_config");
  return c;
}

GptOss::GptOss(const Config& config, DType dtype, Device device, ExpertShard experts)
    : MoeModelBase(config, dtype, device, experts) {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size, E = c.num_experts;
  const int64_t first = experts_.first, El = experts_.count;
  ParameterTable t(c.num_layers);
  t.add("model.embed_tokens.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    const std::pair<const char*, int64_t> projections[] = {
        {"q_proj", c.num_heads * D}, {"k_proj", c.num_kv_heads * D}, {"v_proj", c.num_kv_heads * D}};
    for (const auto& [proj, rows] : projections) t.add(p + "self_attn." + proj + ".weight", {rows, H}, ParamKind::matrix);
    t.add(p + "self_attn.o_proj.weight", {H, c.num_heads * D}, ParamKind::matrix);
    t.add(p + "mlp.router.weight", {E, H}, ParamKind::table);
    for (const auto& [proj, rows] : projections) t.add(p + "self_attn." + proj + ".bias", {rows}, ParamKind::bias);
    t.add(p + "self_attn.o_proj.bias", {H}, ParamKind::bias);
    t.add(p + "self_attn.sinks", {c.num_heads}, ParamKind::bias);
    t.add(p + "mlp.router.bias", {E}, ParamKind::bias);
    t.add_expert_rows(p + "mlp.experts.gate_up_proj", {E, H, 2 * I}, first, El);
    t.add_expert_rows(p + "mlp.experts.down_proj", {E, I, H}, first, El);
    t.add_expert_rows(p + "mlp.experts.gate_up_proj_bias", {E, 2 * I}, first, El, ParamKind::bias);
    t.add_expert_rows(p + "mlp.experts.down_proj_bias", {E, H}, first, El, ParamKind::bias);
  }
  t.layer = c.num_layers;
  t.add("lm_head.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    t.add(p + "input_layernorm.weight", {H}, ParamKind::norm);
    t.add(p + "post_attention_layernorm.weight", {H}, ParamKind::norm);
  }
  t.layer = c.num_layers;
  t.add("model.norm.weight", {H}, ParamKind::norm);
  specs_ = std::move(t.specs);
  num_parameters_ = t.numel;
}

int64_t GptOss::num_active_parameters() const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size;
  const int64_t attention = H * D * (2 * c.num_heads + 2 * c.num_kv_heads);
  const int64_t experts = c.top_k * 3 * H * I;
  return c.num_layers * (attention + c.num_experts * H + experts) + c.vocab_size * H;
}

double GptOss::attention_flops_per_token(int64_t seq) const {
  double keys = 0;  // keys a query sees on average, summed over layers
  for (int64_t layer = 0; layer < config_.num_layers; ++layer) {
    const double s = double(seq), w = config_.sliding[size_t(layer)] ? double(std::min(config_.sliding_window, seq)) : s;
    keys += w - w * w / (2 * s);
  }
  return 12.0 * keys * double(attention_width());
}

GptOssWeights GptOss::bind(const Placement& placement) const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size, E = c.num_experts, El = experts_.count;
  TableCursor cursor(specs_, placement);
  auto take = [&](std::initializer_list<int64_t> dims) { return cursor.take(dims); };
  GptOssWeights w;
  w.embed = take({c.vocab_size, H});
  w.layers.resize(size_t(c.num_layers));
  for (auto& L : w.layers) {
    L.layer = &L - w.layers.data();
    L.q_proj = take({c.num_heads * D, H});
    L.k_proj = take({c.num_kv_heads * D, H});
    L.v_proj = take({c.num_kv_heads * D, H});
    L.o_proj = take({H, c.num_heads * D});
    L.router = take({E, H});
    L.q_bias = take({c.num_heads * D});
    L.k_bias = take({c.num_kv_heads * D});
    L.v_bias = take({c.num_kv_heads * D});
    L.o_bias = take({H});
    L.sinks = take({c.num_heads});
    L.router_bias = take({E});
    L.experts_gate_up = take({El, H, 2 * I});
    L.experts_down = take({El, I, H});
    L.experts_gate_up_bias = take({El, 2 * I});
    L.experts_down_bias = take({El, H});
  }
  w.lm_head = take({c.vocab_size, H});
  for (auto& L : w.layers) {
    L.input_norm = take({H});
    L.post_norm = take({H});
  }
  w.final_norm = take({H});
  cursor.expect_end();
  return w;
}

void GptOss::initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const {
  const bool zero_bias = spec.name.ends_with("bias") && !spec.name.ends_with("router.bias");
  initialize_tensor(out, spec, first, seed, config_.initializer_range, zero_bias);
}

int64_t GptOss::window(const GptOssLayerWeights& w) const { return config_.sliding[size_t(w.layer)] ? config_.sliding_window : 0; }

void GptOss::attention_forward(GptOssAttentionActivations& a, Buffer x, const GptOssBatch& batch, const GptOssLayerWeights& w) const {
  const Config& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, E = c.num_experts;
  expect_shape("GptOss::attention_forward", "x", x, {T, H});
  a.x = std::move(x);
  a.rstd1 = stats({T});
  Buffer q = buffer({T, Hq, D}), k = buffer({T, Hkv, D});
  a.v = buffer({T, Hkv * D});
  {
    const Buffer h1 = input_norm(a, w);
    linear_forward(q.view().reshape({T, Hq * D}), h1, w.q_proj);
    bias_forward(q.view().reshape({T, Hq * D}), w.q_bias);
    linear_forward(k.view().reshape({T, Hkv * D}), h1, w.k_proj);
    bias_forward(k.view().reshape({T, Hkv * D}), w.k_bias);
    linear_forward(a.v, h1, w.v_proj);
    bias_forward(a.v, w.v_bias);
  }
  a.q_rope = buffer({T, Hq, D});
  a.k_rope = buffer({T, Hkv, D});
  rope_forward(a.q_rope, q, batch.positions, c.rope);
  rope_forward(a.k_rope, k, batch.positions, c.rope);
  a.attn = buffer({B, S, Hq, D});
  a.lse = stats({B, Hq, S});
  const Tensor q4 = a.q_rope.view().reshape({B, S, Hq, D}), k4 = a.k_rope.view().reshape({B, S, Hkv, D});
  const Tensor v4 = a.v.view().reshape({B, S, Hkv, D});
  const AttentionVariant variant{w.sinks, window(w), batch_documents(batch)};
  if (batch.attention) batch.attention->forward(a.attn, a.lse, q4, k4, v4, variant);
  else marrow::attention_forward(a.attn, a.lse, q4, k4, v4, variant);
  a.x_mid = buffer({T, H});
  linear_forward(a.x_mid, a.attn.view().reshape({T, Hq * D}), w.o_proj);
  bias_forward(a.x_mid, w.o_bias);
  a.h2 = buffer({T, H});
  a.rstd2 = stats({T});
  rmsnorm_add_forward(a.h2, a.x_mid, a.rstd2, a.x_mid, a.x, w.post_norm, c.rms_norm_eps);
  // Hugging Face takes the top k of the logits and a softmax over those k: the top k of the
  // softmax over all experts, renormalised over the k (router_forward's normalize), which the
  // load-balance statistics also need.
  Buffer logits = stats({T, E});
  linear_forward(logits, a.h2, w.router);
  bias_forward(logits, w.router_bias);
  route_tokens(a, logits, batch, {.normalize = true}, w.layer);
}

void GptOss::attention_backward(Tensor dx, const GptOssLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight, double aux_grad,
                                GptOssAttentionActivations& a, const GptOssBatch& batch, const GptOssLayerWeights& w) const {
  const Config& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, E = c.num_experts;
  expect_shape("GptOss::attention_backward", "dx", dx, {T, H});
  expect_shape("GptOss::attention_backward", "dx_mid", dx_mid, {T, H});
  expect_shape("GptOss::attention_backward", "dh2", dh2, {T, H});

  Buffer dlogits = buffer({T, E});
  route_tokens_backward(dlogits, dtopk_weight, a, batch, {.normalize = true}, aux_grad);
  linear_backward_weight(grads.router, dlogits, a.h2);
  bias_backward(grads.router_bias, dlogits);
  linear_backward_input(dh2, dlogits, w.router, true);

  Buffer dres = buffer({T, H});
  rmsnorm_backward(dres, grads.post_norm, dh2, a.x_mid, w.post_norm, a.rstd2, dx_mid);
  linear_backward_weight(grads.o_proj, dres, a.attn.view().reshape({T, Hq * D}));
  bias_backward(grads.o_bias, dres);
  Buffer dattn = buffer({T, Hq * D});
  linear_backward_input(dattn, dres, w.o_proj);

  Buffer dq_rope = buffer({T, Hq, D}), dk_rope = buffer({T, Hkv, D}), dv = buffer({T, Hkv * D});
  {
    const Tensor dq4 = dq_rope.view().reshape({B, S, Hq, D}), dk4 = dk_rope.view().reshape({B, S, Hkv, D});
    const Tensor dv4 = dv.view().reshape({B, S, Hkv, D}), dattn4 = dattn.view().reshape({B, S, Hq, D});
    const Tensor q4 = a.q_rope.view().reshape({B, S, Hq, D}), k4 = a.k_rope.view().reshape({B, S, Hkv, D});
    const Tensor v4 = a.v.view().reshape({B, S, Hkv, D});
    const AttentionVariant variant{w.sinks, window(w), batch_documents(batch)};
    if (batch.attention) batch.attention->backward(dq4, dk4, dv4, grads.sinks, dattn4, q4, k4, v4, a.attn, a.lse, variant);
    else marrow::attention_backward(dq4, dk4, dv4, grads.sinks, dattn4, q4, k4, v4, a.attn, a.lse, variant);
  }
  Buffer dq = buffer({T, Hq, D}), dk = buffer({T, Hkv, D});
  rope_backward(dq, dq_rope, batch.positions, c.rope);
  rope_backward(dk, dk_rope, batch.positions, c.rope);
  const Tensor dq_2d = dq.view().reshape({T, Hq * D}), dk_2d = dk.view().reshape({T, Hkv * D});
  {
    const Buffer h1 = input_norm(a, w);
    linear_backward_weight(grads.q_proj, dq_2d, h1);
    linear_backward_weight(grads.k_proj, dk_2d, h1);
    linear_backward_weight(grads.v_proj, dv, h1);
  }
  bias_backward(grads.q_bias, dq_2d);
  bias_backward(grads.k_bias, dk_2d);
  bias_backward(grads.v_bias, dv);
  Buffer dh1 = buffer({T, H});
  linear_backward_input(dh1, dq_2d, w.q_proj);
  linear_backward_input(dh1, dk_2d, w.k_proj, true);
  linear_backward_input(dh1, dv, w.v_proj, true);
  rmsnorm_backward(dx, grads.input_norm, dh1, a.x, w.input_norm, a.rstd1, dres);
  a = GptOssAttentionActivations{};
}

// The fused expert weights are [E, in, out]: x [R, in] times W_e is grouped_linear_backward_input's
// product (dy [R, O] W_e with W [E, O, I]), and dy times W_e^T grouped_linear_forward's.
void GptOss::experts_forward(Tensor y_perm, GptOssExpertActivations& e, Buffer x_perm, Tensor expert_offsets,
                             const GptOssLayerWeights& w) const {
  const int64_t R = x_perm.view().size(0), I = config_.expert_intermediate_size;
  e.x_perm = std::move(x_perm);
  e.gate_up = buffer({R, 2 * I});
  const Fp8ExpertWeights* fp8 = expert_fp8() ? &fp8_expert_weights(w) : nullptr;
  if (fp8) fp8_grouped(e.gate_up, e.x_perm, fp8->gate_up_t, expert_offsets);
  else grouped_linear_backward_input(e.gate_up, e.x_perm, w.experts_gate_up, expert_offsets);
  grouped_bias_forward(e.gate_up, w.experts_gate_up_bias, expert_offsets);
  const Buffer act = buffer({R, I});
  clamped_swiglu_forward(act, e.gate_up, config_.swiglu_alpha, config_.swiglu_limit);
  if (fp8) fp8_grouped(y_perm, act, fp8->down_t, expert_offsets);
  else grouped_linear_backward_input(y_perm, act, w.experts_down, expert_offsets);
  grouped_bias_forward(y_perm, w.experts_down_bias, expert_offsets);
}

// The weights' bands (grouped_linear_backward_weight's), then the two biases' sums of squares in
// kSumParts parts each: the record covers every expert gradient of the layer, as the optimizer's
// norm takes it in place of reading them (ShardedParameters::gradient_norm).
int64_t GptOss::expert_squares_count(const GptOssLayerWeights& grads) const {
  return grouped_squares_count(grads.experts_down) + grouped_squares_count(grads.experts_gate_up) + 2 * kSumParts;
}

// With one expert-parallel rank dy_perm holds each copy's output gradient unweighted
// (aggregate_backward): the routing weights are applied here, and the weights' gradient written, as
// for Qwen3-MoE (ops/swiglu.h's swiglu_weighted_backward), plus the down projection's bias term
// dot(dy[r], down_bias[e]). With several, the combine's backward on the tokens' ranks weighted dy_perm
// and took the weights' gradient from the outputs it kept, bias included.
void GptOss::experts_backward_input(Tensor dx_perm, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                    const GptOssLayerWeights& w) const {
  const int64_t R = e.gate_up.view().size(0), I = config_.expert_intermediate_size;
  Buffer dact = buffer({R, I});
  const Fp8ExpertWeights* fp8 = expert_fp8() ? &fp8_expert_weights(w) : nullptr;
  if (fp8) fp8_grouped(dact, dy_perm, fp8->down, expert_offsets);
  else grouped_linear_forward(dact, dy_perm, w.experts_down, expert_offsets);
  e.act = buffer({R, I});
  e.dgate_up = buffer({R, 2 * I});
  if (e.copy_row.data != nullptr) {
    e.row_weight = stats({R});
    clamped_swiglu_weighted_backward(e.dgate_up, e.act, e.row_weight, e.dtopk_weight, dact, e.gate_up, e.topk_weight, e.copy_row,
                                     config_.swiglu_alpha, config_.swiglu_limit);
    grouped_bias_dot_add(e.dtopk_weight, dy_perm, w.experts_down_bias, expert_offsets, e.copy_row);
    e.topk_weight = e.copy_row = e.dtopk_weight = Tensor{};
  } else {
    clamped_swiglu_forward(e.act, e.gate_up, config_.swiglu_alpha, config_.swiglu_limit);
    clamped_swiglu_backward(e.dgate_up, dact, e.gate_up, config_.swiglu_alpha, config_.swiglu_limit);
  }
  e.gate_up = Buffer{};
  if (fp8) fp8_grouped(dx_perm, e.dgate_up, fp8->gate_up, expert_offsets);
  else grouped_linear_forward(dx_perm, e.dgate_up, w.experts_gate_up, expert_offsets);
}

void GptOss::experts_backward_weights(const GptOssLayerWeights& grads, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                      bool overwrite_grads, Tensor squares, Tensor known_zero) const {
  const int64_t weights = grouped_squares_count(grads.experts_down) + grouped_squares_count(grads.experts_gate_up);
  const auto [weight_squares, bias_squares] = split_record("squares", squares, weights, expert_squares_count(grads));
  const auto [down_squares, gate_up_squares] = split_record("squares", weight_squares, grouped_squares_count(grads.experts_down), weights);
  const auto [down_zero, gate_up_zero] = split_record("known_zero", known_zero, grads.experts_down.size(0), expert_known_zero_count(grads));
  // dW_down [E, I, H] = act_w^T dy and dW_gate_up [E, H, 2I] = x^T dgate_up: grouped dW of [O, I] = dy^T x with the roles swapped.
  grouped_linear_backward_weight(grads.experts_down, e.act, dy_perm, expert_offsets, overwrite_grads, down_squares, down_zero);
  grouped_bias_backward(grads.experts_down_bias, dy_perm, expert_offsets, overwrite_grads, e.row_weight);
  grouped_linear_backward_weight(grads.experts_gate_up, e.x_perm, e.dgate_up, expert_offsets, overwrite_grads, gate_up_squares, gate_up_zero);
  grouped_bias_backward(grads.experts_gate_up_bias, e.dgate_up, expert_offsets, overwrite_grads);
  if (bias_squares.data != nullptr) {
    sum_squares_parts(bias_squares.rows(0, kSumParts), grads.experts_down_bias);
    sum_squares_parts(bias_squares.rows(kSumParts, 2 * kSumParts), grads.experts_gate_up_bias);
  }
  e = GptOssExpertActivations{};
}

void GptOss::experts_backward_weights_pair(const GptOssLayerWeights& grads, Tensor earlier_dy_perm, GptOssExpertActivations& earlier,
                                           Tensor earlier_offsets, Tensor dy_perm, GptOssExpertActivations& e, Tensor expert_offsets,
                                           bool overwrite_grads, Tensor squares, Tensor known_zero) const {
  // Both calls update the squares and the known-zero flags in place, so the second sees the first's.
  experts_backward_weights(grads, earlier_dy_perm, earlier, earlier_offsets, overwrite_grads, squares, known_zero);
  experts_backward_weights(grads, dy_perm, e, expert_offsets, false, squares, known_zero);
}

// Mirrors the stage functions above buffer by buffer, in buffer() and stats() dtypes, with the GPU
// attention backward's scratch (ops/attention.h) while dq, dk, h1 and dh1 are not yet alive.
ModelActivationBytes GptOss::activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const {
  const Config& c = config_;
  const int64_t T = batch * seq, R = expert_rows, H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size;
  const int64_t q = c.num_heads * D, kv = c.num_kv_heads * D, E = c.num_experts, K = c.top_k, V = c.vocab_size;
  const int64_t a = int64_t(dtype_size(dtype_)), s = device_ == Device::cuda ? 4 : a, i32 = 4;
  ModelActivationBytes m;
  m.attention_heads = {c.num_heads, c.num_kv_heads, D};
  // x, q_rope, k_rope, v, attn, x_mid, h2; rstd1, lse, rstd2, probs, topk weights, statistics; top-k.
  m.attention.kept = T * (3 * H + 2 * q + 2 * kv) * a + (T * (2 + c.num_heads + E + K) + 2 * E + 1) * s + T * K * i32;
  // h1 with q and k before RoPE, then the router logits.
  m.attention.forward_scratch = std::max(T * (H + q + kv) * a, T * E * s);
  // dlogits, dres, dattn, dq_rope, dk_rope, dv; then the op's scratch, or dq, dk, h1 and dh1.
  const int64_t op = device_ == Device::cuda ? attention_backward_scratch(batch, seq, c.num_heads, c.num_kv_heads, D, true) : 0;
  m.attention.backward_scratch = T * (E + H + 2 * q + 2 * kv) * a + std::max(op, T * (q + kv + 2 * H) * a);
  m.experts.kept = R * 2 * I * a;
  m.experts.forward_scratch = R * I * a;
  m.experts.backward_scratch = R * 4 * I * a + R * s;
  m.experts.held_for_weights = R * 3 * I * a + R * s;
  m.epilog = epilog_bytes(T, H, V, logits_chunk(T), a, s);
  return m;
}

}  // namespace marrow
