// The norms' outputs (input norm, q_a_layernorm, kv_a_layernorm) and the assembled query, key and
// value heads are not kept: attention_backward computes them again with the same bits (the ops are
// deterministic), as Qwen3Moe does; activation_bytes mirrors what is kept.
#include "models/deepseek_v2.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "ops/attention.h"
#include "ops/add.h"
#include "ops/linear.h"
#include "ops/mla.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace marrow {

namespace {

void refuse_unsupported(const JsonFields& f, const std::string& source) {
  MARROW_CHECK(!f.boolean("attention_bias", false), "{}: attention_bias = true is not supported", source);
  MARROW_CHECK(!f.boolean("mlp_bias", false), "{}: mlp_bias = true is not supported", source);
  MARROW_CHECK(f.string("hidden_act", "silu") == "silu", "{}: hidden_act '{}' is not supported (only silu)", source,
               f.string("hidden_act"));
  MARROW_CHECK(f.integer("moe_layer_freq", 1) == 1, "{}: moe_layer_freq must be 1 (every layer after the dense ones is MoE)", source);
}

// YaRN's attention temperature, transformers' yarn_get_mscale.
double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

RouterOptions read_routing(const JsonFields& f, const std::string& source, int64_t experts, int64_t top_k) {
  RouterOptions r;
  r.normalize = f.boolean("norm_topk_prob", false);
  r.scale = f.number("routed_scaling_factor", 1.0);
  MARROW_CHECK(r.scale > 0, "{}: routed_scaling_factor must be positive, got {}", source, r.scale);
  const std::string method = f.string("topk_method", "greedy");
  MARROW_CHECK(method == "greedy" || method == "group_limited_greedy", "{}: topk_method '{}' is not supported (greedy or group_limited_greedy)",
               source, method);
  if (method == "greedy") return r;
  r.groups = f.positive("n_group");
  r.top_groups = f.positive("topk_group");
  MARROW_CHECK(experts % r.groups == 0, "{}: n_routed_experts ({}) must be a multiple of n_group ({})", source, experts, r.groups);
  MARROW_CHECK(r.top_groups <= r.groups, "{}: topk_group ({}) exceeds n_group ({})", source, r.top_groups, r.groups);
  MARROW_CHECK(top_k <= r.top_groups * (experts / r.groups), "{}: num_experts_per_tok ({}) exceeds the experts of topk_group groups ({})",
               source, top_k, r.top_groups * (experts / r.groups));
  return r;
}

}  // namespace

ModelSize DeepseekV2Config::model_size() const {
  const double H = double(hidden_size), Hq = double(num_heads), L = double(num_layers), Ld = double(first_dense_layers);
  const double query = q_lora_rank ? double(q_lora_rank) * (H + 1 + Hq * double(qk_head_dim())) : H * Hq * double(qk_head_dim());
  const double attention = query + H * double(kv_lora_rank + qk_rope_head_dim) + double(kv_lora_rank) +
                           double(kv_lora_rank) * Hq * double(qk_nope_head_dim + v_head_dim) + Hq * double(v_head_dim) * H;
  const double E = double(num_experts), moe = E * H + 3.0 * H * double(expert_intermediate_size) * E + 3.0 * H * double(shared_intermediate_size());
  const double layers = L * (attention + 2.0 * H) + Ld * 3.0 * H * double(intermediate_size) + (L - Ld) * moe;
  const double shared = num_shared_experts > 0 ? 3.0 : 0.0;
  const double tensors = L * (7.0 + (q_lora_rank ? 2.0 : 0.0)) + Ld * 3.0 + (L - Ld) * (1.0 + shared + 3.0 * E) + 3.0;
  return {layers + 2.0 * double(vocab_size) * H + H, tensors};
}

DeepseekV2Config DeepseekV2Config::from_json(const Json& json, const std::string& source) {
  JsonFields f(json, source);
  DeepseekV2Config c;
  c.json = json;
  expect_family(f, source, "deepseek_v2", "DeepseekV2ForCausalLM");
  read_shared_fields(c, f, 1e-6);
  MARROW_CHECK(c.num_kv_heads == c.num_heads, "{}: num_key_value_heads ({}) must equal num_attention_heads ({}): kv_b_proj gives every head its key",
               source, c.num_kv_heads, c.num_heads);
  c.q_lora_rank = f.positive("q_lora_rank", 0);
  c.kv_lora_rank = f.positive("kv_lora_rank");
  c.qk_nope_head_dim = f.positive("qk_nope_head_dim");
  c.qk_rope_head_dim = f.positive("qk_rope_head_dim");
  c.v_head_dim = f.positive("v_head_dim");
  MARROW_CHECK(c.qk_rope_head_dim % 2 == 0, "{}: qk_rope_head_dim must be even for rotary embeddings, got {}", source, c.qk_rope_head_dim);
  c.num_experts = f.positive("n_routed_experts");
  c.expert_intermediate_size = f.positive("moe_intermediate_size");
  c.num_shared_experts = f.integer("n_shared_experts", 0);
  MARROW_CHECK(c.num_shared_experts >= 0, "{}: n_shared_experts must not be negative, got {}", source, c.num_shared_experts);
  c.first_dense_layers = f.integer("first_k_dense_replace", 0);
  MARROW_CHECK(c.first_dense_layers >= 0 && c.first_dense_layers < c.num_layers,
               "{}: first_k_dense_replace ({}) must be in [0, num_hidden_layers = {})", source, c.first_dense_layers, c.num_layers);
  c.intermediate_size = c.first_dense_layers > 0 ? f.positive("intermediate_size") : f.positive("intermediate_size", 0);
  c.routing = read_routing(f, source, c.num_experts, c.top_k);
  // DeepSeek's loss is aux_loss_alpha x E / K x sum_e f_e P_e summed over the MoE layers; Marrow's
  // coefficient multiplies the mean over layers of E x sum_e f_e P_e (ops/router.h), hence the factor.
  if (!f.has("router_aux_loss_coef") && f.has("aux_loss_alpha"))
    c.router_aux_loss_coef = f.number("aux_loss_alpha") * double(c.moe_layers()) / double(c.top_k);
  c.sequence_aux = f.boolean("seq_aux", false);
  c.rope = read_rope(f, source, 10000.0, Json::object(), true, true);
  c.softmax_scale = 1.0 / std::sqrt(double(c.qk_head_dim()));
  const Json& settings = rope_settings(f, Json::object());
  if (c.rope.yarn && settings.contains("mscale_all_dim") && settings["mscale_all_dim"].is_number()) {
    const double m = yarn_mscale(c.rope.factor, settings["mscale_all_dim"].get<double>());
    if (settings["mscale_all_dim"].get<double>() != 0) c.softmax_scale *= m * m;
  }
  check_shared_values(c, c.rope.theta, source, "n_routed_experts");
  refuse_unsupported(f, source);
  return c;
}

DeepseekV2::DeepseekV2(const Config& config, DType dtype, Device device, ExpertShard experts)
    : SwigluMoeModel(config, dtype, device, experts) {
  const Config& c = config_;
  const int64_t H = c.hidden_size, Hq = c.num_heads, I = c.expert_intermediate_size, Is = c.shared_intermediate_size();
  ParameterTable t(c.num_layers);
  t.add("model.embed_tokens.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    if (c.q_lora_rank) {
      t.add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, H}, ParamKind::matrix);
      t.add(p + "self_attn.q_b_proj.weight", {Hq * c.qk_head_dim(), c.q_lora_rank}, ParamKind::matrix);
    } else {
      t.add(p + "self_attn.q_proj.weight", {Hq * c.qk_head_dim(), H}, ParamKind::matrix);
    }
    t.add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H}, ParamKind::matrix);
    t.add(p + "self_attn.kv_b_proj.weight", {Hq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, ParamKind::matrix);
    t.add(p + "self_attn.o_proj.weight", {H, Hq * c.v_head_dim}, ParamKind::matrix);
    if (dense_layer(t.layer)) {
      for (const char* m : {"gate_proj", "up_proj"}) t.add(fmt::format("{}mlp.{}.weight", p, m), {c.intermediate_size, H}, ParamKind::matrix);
      t.add(p + "mlp.down_proj.weight", {H, c.intermediate_size}, ParamKind::matrix);
      continue;
    }
    if (Is > 0) {
      for (const char* m : {"gate_proj", "up_proj"}) t.add(fmt::format("{}mlp.shared_experts.{}.weight", p, m), {Is, H}, ParamKind::matrix);
      t.add(p + "mlp.shared_experts.down_proj.weight", {H, Is}, ParamKind::matrix);
    }
    t.add(p + "mlp.gate.weight", {c.num_experts, H}, ParamKind::table);
    for (int64_t e = experts_.first; e < experts_.first + experts_.count; ++e) {
      t.add(fmt::format("{}mlp.experts.{}.gate_proj.weight", p, e), {I, H}, ParamKind::matrix, true);
      t.add(fmt::format("{}mlp.experts.{}.up_proj.weight", p, e), {I, H}, ParamKind::matrix, true);
    }
    for (int64_t e = experts_.first; e < experts_.first + experts_.count; ++e)
      t.add(fmt::format("{}mlp.experts.{}.down_proj.weight", p, e), {H, I}, ParamKind::matrix, true);
  }
  t.layer = c.num_layers;
  t.add("lm_head.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    t.add(p + "input_layernorm.weight", {H}, ParamKind::norm);
    if (c.q_lora_rank) t.add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank}, ParamKind::norm);
    t.add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, ParamKind::norm);
    t.add(p + "post_attention_layernorm.weight", {H}, ParamKind::norm);
  }
  t.layer = c.num_layers;
  t.add("model.norm.weight", {H}, ParamKind::norm);
  specs_ = std::move(t.specs);
  num_parameters_ = t.numel;
}

int64_t DeepseekV2::num_active_parameters() const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, Hq = c.num_heads;
  const int64_t query = c.q_lora_rank ? c.q_lora_rank * (H + Hq * c.qk_head_dim()) : H * Hq * c.qk_head_dim();
  const int64_t attention = query + H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * Hq * (c.qk_nope_head_dim + c.v_head_dim) +
                            Hq * c.v_head_dim * H;
  const int64_t moe = c.num_experts * H + 3 * H * (c.top_k * c.expert_intermediate_size + c.shared_intermediate_size());
  return c.num_layers * attention + c.first_dense_layers * 3 * H * c.intermediate_size + c.moe_layers() * moe + c.vocab_size * H;
}

DeepseekV2Weights DeepseekV2::bind(const Placement& placement) const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, Hq = c.num_heads, I = c.expert_intermediate_size, Is = c.shared_intermediate_size(), El = experts_.count;
  TableCursor cursor(specs_, placement);
  auto take = [&](std::initializer_list<int64_t> dims, int64_t count = 1) { return cursor.take(dims, count); };
  DeepseekV2Weights w;
  w.embed = take({c.vocab_size, H});
  w.layers.resize(size_t(c.num_layers));
  for (auto& L : w.layers) {
    L.layer = &L - w.layers.data();
    L.dense = dense_layer(L.layer);
    if (c.q_lora_rank) {
      L.q_a_proj = take({c.q_lora_rank, H});
      L.q_b_proj = take({Hq * c.qk_head_dim(), c.q_lora_rank});
    } else {
      L.q_proj = take({Hq * c.qk_head_dim(), H});
    }
    const Tensor kv_a = take({c.kv_lora_rank + c.qk_rope_head_dim, H});
    L.kv_a_latent = kv_a.rows(0, c.kv_lora_rank);
    L.kv_a_rope = kv_a.rows(c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim);
    L.kv_b_proj = take({Hq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
    L.o_proj = take({H, Hq * c.v_head_dim});
    if (L.dense) {
      L.mlp_gate_up = take({2 * c.intermediate_size, H}, 2);
      L.mlp_down = take({H, c.intermediate_size});
      continue;
    }
    if (Is > 0) {
      L.mlp_gate_up = take({2 * Is, H}, 2);
      L.mlp_down = take({H, Is});
    }
    L.router = take({c.num_experts, H});
    L.experts_gate_up = take({El, 2 * I, H}, 2 * El);
    L.experts_down = take({El, H, I}, El);
  }
  w.lm_head = take({c.vocab_size, H});
  for (auto& L : w.layers) {
    L.input_norm = take({H});
    if (c.q_lora_rank) L.q_a_norm = take({c.q_lora_rank});
    L.kv_a_norm = take({c.kv_lora_rank});
    L.post_norm = take({H});
  }
  w.final_norm = take({H});
  cursor.expect_end();
  return w;
}

// MLA's steps between the input norm and the attention op, the same in the forward and (computing
// them again) the backward: the normed low-rank query and latent, and the attention op's heads.
struct DeepseekV2::Attention {
  const DeepseekV2& m;
  DeepseekV2AttentionActivations& a;
  const DeepseekV2Batch& batch;
  const DeepseekV2LayerWeights& w;
  int64_t T() const { return batch.batch * batch.seq; }
  const Config& c() const { return m.config_; }

  Buffer q_a_normed() const {
    Buffer y = m.buffer({T(), c().q_lora_rank});
    rmsnorm_forward(y, a.rstd_qa, a.q_a, w.q_a_norm, c().rms_norm_eps);
    return y;
  }
  Buffer latent_normed() const {
    Buffer y = m.buffer({T(), c().kv_lora_rank});
    rmsnorm_forward(y, a.rstd_kv, a.latent, w.kv_a_norm, c().rms_norm_eps);
    return y;
  }
  // The attention op's q [B, S, Hq, Dqk], scaled so that its 1/sqrt(Dqk) becomes the config's
  // softmax scale.
  Buffer query() const {
    const int64_t Hq = c().num_heads, Dqk = c().qk_head_dim();
    Buffer q = m.buffer({batch.batch, batch.seq, Hq, Dqk});
    mla_query_forward(q.view().reshape({T(), Hq, Dqk}), a.q.view().reshape({T(), Hq, Dqk}), batch.positions, c().qk_rope_head_dim, c().rope,
                      query_scale());
    return q;
  }
  // One process: the attention op's k [B, S, Hq, Dqk] and v [B, S, Hq, Dv] from a.kv and a.k_pe.
  std::array<Buffer, 2> keys_values() const {
    const int64_t Hq = c().num_heads, Dqk = c().qk_head_dim();
    Buffer k = m.buffer({batch.batch, batch.seq, Hq, Dqk}), v = m.buffer({batch.batch, batch.seq, Hq, c().v_head_dim});
    mla_key_value_forward(k.view().reshape({T(), Hq, Dqk}), v.view().reshape({T(), Hq, c().v_head_dim}),
                          a.kv.view().reshape({T(), Hq, c().qk_nope_head_dim + c().v_head_dim}), a.k_pe, batch.positions, c().rope);
    return {std::move(k), std::move(v)};
  }
  // Context parallelism: what travels the ring, [B, S, R + Dr] in the layout only expansion() reads:
  // the normed latent (T x R values), then the rope key already rotated at its true positions (T x Dr).
  Buffer packed() const {
    const int64_t R = c().kv_lora_rank, Dr = c().qk_rope_head_dim;
    Buffer packed = m.buffer({batch.batch, batch.seq, R + Dr});
    const auto [latent, k_pe] = packed_parts(packed, R, Dr);
    copy(latent, latent_normed());
    mla_query_forward(k_pe.reshape({T(), 1, Dr}), a.k_pe.view().reshape({T(), 1, Dr}), batch.positions, Dr, c().rope, 1.0);
    return packed;
  }
  static std::array<Tensor, 2> packed_parts(Tensor packed, int64_t R, int64_t Dr) {
    const int64_t T = packed.numel() / (R + Dr);
    const Tensor flat = packed.reshape({packed.numel()});
    return {flat.rows(0, T * R).reshape({T, R}), flat.rows(T * R, T * (R + Dr)).reshape({T, Dr})};
  }
  // A packed block's k and v: kv_b_proj's GEMM, then the heads with the rope key as it came (rotated
  // by angle 0: positions 0 and plain RoPE, the identity, exact). Its backward adds the block's share
  // to grads->kv_b_proj.
  KvExpansion expansion(const DeepseekV2LayerWeights* grads) const {
    const Config& cc = c();
    const int64_t Hq = cc.num_heads, R = cc.kv_lora_rank, Dr = cc.qk_rope_head_dim, Dqk = cc.qk_head_dim(), Dv = cc.v_head_dim;
    const int64_t Dkv = cc.qk_nope_head_dim + Dv;
    const DeepseekV2& model = m;
    const Tensor weight = w.kv_b_proj;
    KvExpansion e{R + Dr, Hq, Dqk, Dv, {}, {}};
    e.expand = [=, &model](Tensor k, Tensor v, Tensor packed) {
      const auto [latent, k_pe] = packed_parts(packed, R, Dr);
      const int64_t T = latent.size(0);
      Buffer kv = model.buffer({T, Hq * Dkv});
      linear_forward(kv, latent, weight);
      mla_key_value_forward(k.reshape({T, Hq, Dqk}), v.reshape({T, Hq, Dv}), kv.view().reshape({T, Hq, Dkv}), k_pe,
                            Buffer::zeros(DType::i32, k.device, {T}), RopeParameters{});
    };
    e.expand_backward = [=, &model](Tensor dpacked, Tensor dk, Tensor dv, Tensor packed) {
      const Tensor latent = packed_parts(packed, R, Dr)[0];
      const auto [dlatent, dk_pe] = packed_parts(dpacked, R, Dr);
      const int64_t T = latent.size(0);
      Buffer dkv = model.buffer({T, Hq * Dkv});
      mla_key_value_backward(dkv.view().reshape({T, Hq, Dkv}), dk_pe, dk.reshape({T, Hq, Dqk}), dv.reshape({T, Hq, Dv}),
                             Buffer::zeros(DType::i32, dk.device, {T}), RopeParameters{});
      linear_backward_weight(grads->kv_b_proj, dkv, latent);
      linear_backward_input(dlatent, dkv, weight);
    };
    return e;
  }
  // From the attention op's dattn [B, S, Hq, Dv], through the op and MLA's head assembly: the
  // gradients of a.q [T, Hq Dqk], the normed latent [T, R] and a.k_pe [T, Dr]; kv_b_proj's weight
  // gradient added to grads.
  struct InputGrads {
    Buffer dq, dnormed, dk_pe;
  };
  InputGrads op_backward(Buffer dattn, const DeepseekV2LayerWeights& grads) const {
    const int64_t Hq = c().num_heads, Dqk = c().qk_head_dim(), R = c().kv_lora_rank, Dr = c().qk_rope_head_dim;
    Buffer dq_heads = m.buffer({batch.batch, batch.seq, Hq, Dqk});
    InputGrads g;
    if (batch.attention) {
      Buffer dpacked = m.buffer({batch.batch, batch.seq, R + Dr});
      batch.attention->backward_packed(dq_heads, dpacked, dattn, query(), packed(), a.attn, a.lse, expansion(&grads), batch_documents(batch));
      dattn = Buffer{};
      const auto [dlatent, dk_pe_rotated] = packed_parts(dpacked, R, Dr);
      g.dnormed = m.buffer({T(), R});
      copy(g.dnormed, dlatent);
      g.dk_pe = m.buffer({T(), Dr});
      mla_query_backward(g.dk_pe.view().reshape({T(), 1, Dr}), dk_pe_rotated.reshape({T(), 1, Dr}), batch.positions, Dr, c().rope, 1.0);
    } else {
      key_value_backward(g, dq_heads, std::move(dattn), grads);
    }
    g.dq = m.buffer({T(), Hq * Dqk});
    mla_query_backward(g.dq.view().reshape({T(), Hq, Dqk}), dq_heads.view().reshape({T(), Hq, Dqk}), batch.positions, Dr, c().rope,
                       query_scale());
    return g;
  }
  // One process: the attention op's backward into dq_heads, then g.dnormed and g.dk_pe.
  void key_value_backward(InputGrads& g, Tensor dq_heads, Buffer dattn, const DeepseekV2LayerWeights& grads) const {
    const int64_t Hq = c().num_heads, Dqk = c().qk_head_dim(), Dv = c().v_head_dim, Dkv = c().qk_nope_head_dim + Dv;
    Buffer dk_heads = m.buffer({batch.batch, batch.seq, Hq, Dqk}), dv = m.buffer({batch.batch, batch.seq, Hq, Dv});
    {
      const auto [k, v] = keys_values();
      marrow::attention_backward(dq_heads, dk_heads, dv, {}, dattn, query(), k, v, a.attn, a.lse, {.documents = batch_documents(batch)});
    }
    dattn = Buffer{};
    Buffer dkv = m.buffer({T(), Hq * Dkv});
    g.dk_pe = m.buffer({T(), c().qk_rope_head_dim});
    mla_key_value_backward(dkv.view().reshape({T(), Hq, Dkv}), g.dk_pe, dk_heads.view().reshape({T(), Hq, Dqk}),
                           dv.view().reshape({T(), Hq, Dv}), batch.positions, c().rope);
    dk_heads = Buffer{};
    dv = Buffer{};
    linear_backward_weight(grads.kv_b_proj, dkv, latent_normed());
    g.dnormed = m.buffer({T(), c().kv_lora_rank});
    linear_backward_input(g.dnormed, dkv, w.kv_b_proj);
  }
  double query_scale() const { return c().softmax_scale * std::sqrt(double(c().qk_head_dim())); }
};

// a.x_mid = a.x_attn + the dense MLP or the shared experts of a.h2.
void DeepseekV2::mlp_forward(DeepseekV2AttentionActivations& a, const DeepseekV2LayerWeights& w) const {
  const int64_t T = a.h2.view().size(0), I = w.mlp_down.numel() ? w.mlp_down.size(1) : 0;
  if (I == 0) {  // no shared experts: the residual as it is (the post norm's backward finds it in x_mid)
    a.x_mid = std::move(a.x_attn);
    return;
  }
  a.x_mid = buffer({T, config_.hidden_size});
  a.mlp_gate_up = buffer({T, 2 * I});
  linear_forward(a.mlp_gate_up, a.h2, w.mlp_gate_up);
  const Buffer act = buffer({T, I});
  swiglu_forward(act, a.mlp_gate_up);
  linear_forward(a.x_mid, act, w.mlp_down);
  add(a.x_mid, a.x_mid, a.x_attn);
}

// dh2 gets the MLP's input gradient from dx_mid (added when `add`).
void DeepseekV2::mlp_backward(Tensor dh2, const DeepseekV2LayerWeights& grads, Tensor dx_mid, DeepseekV2AttentionActivations& a,
                              const DeepseekV2LayerWeights& w, bool add) const {
  const int64_t T = dx_mid.size(0), I = w.mlp_down.numel() ? w.mlp_down.size(1) : 0;
  if (I == 0) {
    MARROW_CHECK(add, "internal: a dense layer without its MLP");
    return;
  }
  Buffer act = buffer({T, I}), dact = buffer({T, I}), dgate_up = buffer({T, 2 * I});
  swiglu_forward(act, a.mlp_gate_up);
  linear_backward_weight(grads.mlp_down, dx_mid, act);
  linear_backward_input(dact, dx_mid, w.mlp_down);
  swiglu_backward(dgate_up, dact, a.mlp_gate_up);
  linear_backward_weight(grads.mlp_gate_up, dgate_up, a.h2);
  linear_backward_input(dh2, dgate_up, w.mlp_gate_up, add);
}

void DeepseekV2::route(DeepseekV2AttentionActivations& a, const DeepseekV2Batch& batch, const DeepseekV2LayerWeights& w) const {
  Buffer logits = stats({batch.batch * batch.seq, config_.num_experts});
  linear_forward(logits, a.h2, w.router);
  route_tokens(a, logits, batch, config_.routing, w.layer);
}

void DeepseekV2::attention_forward(DeepseekV2AttentionActivations& a, Buffer x, const DeepseekV2Batch& batch,
                                   const DeepseekV2LayerWeights& w) const {
  const Config& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size, Hq = c.num_heads;
  expect_shape("DeepseekV2::attention_forward", "x", x, {T, H});
  a.x = std::move(x);
  a.rstd1 = stats({T});
  a.q = buffer({T, Hq * c.qk_head_dim()});
  a.latent = buffer({T, c.kv_lora_rank});
  a.k_pe = buffer({T, c.qk_rope_head_dim});
  a.rstd_kv = stats({T});
  Attention mla{*this, a, batch, w};
  {
    const Buffer h1 = input_norm(a, w);
    if (c.q_lora_rank) {
      a.q_a = buffer({T, c.q_lora_rank});
      a.rstd_qa = stats({T});
      linear_forward(a.q_a, h1, w.q_a_proj);
      linear_forward(a.q, mla.q_a_normed(), w.q_b_proj);
    } else {
      linear_forward(a.q, h1, w.q_proj);
    }
    linear_forward(a.latent, h1, w.kv_a_latent);
    linear_forward(a.k_pe, h1, w.kv_a_rope);
  }
  a.attn = buffer({B, S, Hq, c.v_head_dim});
  a.lse = stats({B, Hq, S});
  if (batch.attention) {
    batch.attention->forward_packed(a.attn, a.lse, mla.query(), mla.packed(), mla.expansion(nullptr), batch_documents(batch));
  } else {
    a.kv = buffer({T, Hq * (c.qk_nope_head_dim + c.v_head_dim)});
    linear_forward(a.kv, mla.latent_normed(), w.kv_b_proj);
    const auto [k, v] = mla.keys_values();
    marrow::attention_forward(a.attn, a.lse, mla.query(), k, v, {.documents = batch_documents(batch)});
  }
  a.x_attn = buffer({T, H});
  linear_forward(a.x_attn, a.attn.view().reshape({T, Hq * c.v_head_dim}), w.o_proj);
  a.h2 = buffer({T, H});
  a.rstd2 = stats({T});
  rmsnorm_add_forward(a.h2, a.x_attn, a.rstd2, a.x_attn, a.x, w.post_norm, c.rms_norm_eps);
  mlp_forward(a, w);
  if (!w.dense) route(a, batch, w);
}

void DeepseekV2::attention_backward(Tensor dx, const DeepseekV2LayerWeights& grads, Tensor dx_mid, Tensor dh2_in, Tensor dtopk_weight,
                                    double aux_grad, DeepseekV2AttentionActivations& a, const DeepseekV2Batch& batch,
                                    const DeepseekV2LayerWeights& w) const {
  const Config& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size, Hq = c.num_heads;
  expect_shape("DeepseekV2::attention_backward", "dx", dx, {T, H});
  expect_shape("DeepseekV2::attention_backward", "dx_mid", dx_mid, {T, H});
  Buffer dense_dh2 = w.dense ? buffer({T, H}) : Buffer{};
  const Tensor dh2 = w.dense ? dense_dh2.view() : dh2_in;
  expect_shape("DeepseekV2::attention_backward", "dh2", dh2, {T, H});
  if (!w.dense) {
    Buffer dlogits = buffer({T, c.num_experts});
    route_tokens_backward(dlogits, dtopk_weight, a, batch, c.routing, aux_grad);
    linear_backward_weight(grads.router, dlogits, a.h2);
    linear_backward_input(dh2, dlogits, w.router, true);
  }
  mlp_backward(dh2, grads, dx_mid, a, w, !w.dense);
  Buffer dres = buffer({T, H});  // d(x_attn): through the post norm, plus dx_mid around it
  rmsnorm_backward(dres, grads.post_norm, dh2, a.x_attn.view().data ? a.x_attn : a.x_mid, w.post_norm, a.rstd2, dx_mid);

  const Tensor attn_2d = a.attn.view().reshape({T, Hq * c.v_head_dim});
  linear_backward_weight(grads.o_proj, dres, attn_2d);
  Buffer dattn = buffer({B, S, Hq, c.v_head_dim});
  linear_backward_input(dattn.view().reshape({T, Hq * c.v_head_dim}), dres, w.o_proj);
  Attention mla{*this, a, batch, w};
  const auto [dq, dnormed, dk_pe] = mla.op_backward(std::move(dattn), grads);
  Buffer dlatent = buffer({T, c.kv_lora_rank});
  rmsnorm_backward(dlatent, grads.kv_a_norm, dnormed, a.latent, w.kv_a_norm, a.rstd_kv);
  Buffer dq_a = c.q_lora_rank ? buffer({T, c.q_lora_rank}) : Buffer{};
  if (c.q_lora_rank) {
    const Buffer q_a = mla.q_a_normed();
    linear_backward_weight(grads.q_b_proj, dq, q_a);
    Buffer dq_a_normed = buffer({T, c.q_lora_rank});
    linear_backward_input(dq_a_normed, dq, w.q_b_proj);
    rmsnorm_backward(dq_a, grads.q_a_norm, dq_a_normed, a.q_a, w.q_a_norm, a.rstd_qa);
  }
  Buffer dh1 = buffer({T, H});  // the three projections' input gradients summed by their GEMMs
  {
    const Buffer h1 = input_norm(a, w);
    if (c.q_lora_rank) linear_backward_weight(grads.q_a_proj, dq_a, h1);
    else linear_backward_weight(grads.q_proj, dq, h1);
    linear_backward_weight(grads.kv_a_latent, dlatent, h1);
    linear_backward_weight(grads.kv_a_rope, dk_pe, h1);
  }
  if (c.q_lora_rank) linear_backward_input(dh1, dq_a, w.q_a_proj);
  else linear_backward_input(dh1, dq, w.q_proj);
  linear_backward_input(dh1, dlatent, w.kv_a_latent, true);
  linear_backward_input(dh1, dk_pe, w.kv_a_rope, true);
  rmsnorm_backward(dx, grads.input_norm, dh1, a.x, w.input_norm, a.rstd1, dres);
  a = DeepseekV2AttentionActivations{};
}

// Mirrors the stage functions above buffer by buffer for an MoE layer (a dense layer's MLP is
// counted as the shared experts' at intermediate_size where that is larger).
ModelActivationBytes DeepseekV2::activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const {
  const Config& c = config_;
  const int64_t T = batch * seq, R = expert_rows, H = c.hidden_size, Hq = c.num_heads, I = c.expert_intermediate_size;
  const int64_t Im = std::max(c.shared_intermediate_size(), c.first_dense_layers ? c.intermediate_size : 0);
  const int64_t q = Hq * c.qk_head_dim(), kv = Hq * (c.qk_nope_head_dim + c.v_head_dim), vo = Hq * c.v_head_dim;
  const int64_t latent = c.kv_lora_rank + c.qk_rope_head_dim, E = c.num_experts, K = c.top_k, V = c.vocab_size;
  const bool gpu = device_ == Device::cuda;
  const int64_t a = int64_t(dtype_size(dtype_)), s = gpu ? 4 : a, i32 = 4;
  ModelActivationBytes m;
  m.attention_heads = {Hq, Hq, c.qk_head_dim()};
  m.prolog.backward_scratch = gpu ? 4 * T * i32 : 0;
  // x, q_a, q, latent, k_pe, kv, attn, x_attn, x_mid, h2, the MLP's gate/up; norm scales, lse,
  // router probs and weights, statistics; top-k.
  m.attention.kept = T * (4 * H + c.q_lora_rank + q + latent + kv + vo + 2 * Im) * a +
                     (T * (4 + Hq + E + K) + (c.sequence_aux ? batch : 1) * (2 * E + 1)) * s + T * K * i32;
  // h1 and a normed low-rank input; the heads (q, k, v); the MLP's act or the router logits.
  m.attention.forward_scratch = std::max({T * (H + std::max(c.q_lora_rank, c.kv_lora_rank)) * a, T * (2 * q + vo) * a, T * Im * a, T * E * s});
  // Through the attention op: dres, dattn, the heads and their gradients; after it dq, dkv, dk_pe,
  // the low-rank gradients and h1.
  const int64_t op = gpu ? attention_backward_scratch(batch, seq, Hq, Hq, c.qk_head_dim()) : 0;
  m.attention.backward_scratch = T * H * a + std::max({T * 3 * Im * a + T * H * a, T * (vo + 2 * (2 * q + vo)) * a + op,
                                                       T * (q + kv + latent + 2 * H + c.q_lora_rank + c.kv_lora_rank) * a});
  m.experts.kept = R * 2 * I * a;
  m.experts.forward_scratch = R * I * a;
  m.experts.backward_scratch = R * 4 * I * a;
  m.experts.held_for_weights = R * 3 * I * a;
  m.epilog = epilog_bytes(T, H, V, logits_chunk(T), a, s);
  return m;
}

}  // namespace marrow
