// Neither the input norm's output nor attention's q/k inputs are kept: attention_backward computes
// them again (input_norm, attention_inputs, which rewrite rstd1/rstd_q/rstd_k with the same bits). A
// change to those ops must stay deterministic, or the backward no longer sees the forward's values;
// activation_bytes mirrors what is kept.
#include "models/qwen3_moe.h"

#include <algorithm>

#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"

namespace marrow {

namespace {

// Features of the family that Marrow does not implement: refuse rather than train something else.
void refuse_unsupported(const JsonFields& f, const std::string& source) {
  MARROW_CHECK(!f.boolean("attention_bias", false), "{}: attention_bias = true is not supported", source);
  MARROW_CHECK(!f.boolean("use_sliding_window", false), "{}: use_sliding_window = true is not supported", source);
  MARROW_CHECK(f.string("hidden_act", "silu") == "silu", "{}: hidden_act '{}' is not supported (only silu)", source,
               f.string("hidden_act"));
  MARROW_CHECK(f.integer("decoder_sparse_step", 1) == 1, "{}: decoder_sparse_step must be 1 (every layer is MoE)", source);
  MARROW_CHECK(!f.has("mlp_only_layers") || f.raw("mlp_only_layers").empty(),
               "{}: mlp_only_layers is not supported (every layer is MoE)", source);
}

}  // namespace

ModelSize Qwen3MoeConfig::model_size() const {
  const double H = double(hidden_size), D = double(head_dim), E = double(num_experts), L = double(num_layers);
  const double attention = H * D * (2.0 * double(num_heads) + 2.0 * double(num_kv_heads));
  const double layer = attention + E * H + 3.0 * E * H * double(expert_intermediate_size) + 2.0 * H + 2.0 * D;
  return {L * layer + 2.0 * double(vocab_size) * H + H, L * (9.0 + 3.0 * E) + 3.0};
}

Qwen3MoeConfig Qwen3MoeConfig::from_json(const Json& json, const std::string& source) {
  JsonFields f(json, source);
  Qwen3MoeConfig c;
  c.json = json;
  expect_family(f, source, "qwen3_moe", "Qwen3MoeForCausalLM");
  read_shared_fields(c, f, 1e-6);
  // transformers 5 writes num_local_experts; checkpoints on the Hub write num_experts.
  c.num_experts = f.has("num_experts") ? f.positive("num_experts") : f.positive("num_local_experts");
  c.expert_intermediate_size = f.positive("moe_intermediate_size");
  c.norm_topk_prob = f.boolean("norm_topk_prob", false);
  c.rope_theta = read_rope(f, source, 10000.0, Json::object(), false).theta;
  check_shared_values(c, c.rope_theta, source, "num_experts");
  refuse_unsupported(f, source);
  return c;
}

Qwen3Moe::Qwen3Moe(const Config& config, DType dtype, Device device, ExpertShard experts)
    : SwigluMoeModel(config, dtype, device, experts) {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size;
  const int64_t first = experts_.first, last = experts_.first + experts_.count;
  ParameterTable t(c.num_layers);
  t.add("model.embed_tokens.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    t.add(p + "self_attn.q_proj.weight", {c.num_heads * D, H}, ParamKind::matrix);
    t.add(p + "self_attn.k_proj.weight", {c.num_kv_heads * D, H}, ParamKind::matrix);
    t.add(p + "self_attn.v_proj.weight", {c.num_kv_heads * D, H}, ParamKind::matrix);
    t.add(p + "self_attn.o_proj.weight", {H, c.num_heads * D}, ParamKind::matrix);
    t.add(p + "mlp.gate.weight", {c.num_experts, H}, ParamKind::table);
    for (int64_t e = first; e < last; ++e) {
      t.add(fmt::format("{}mlp.experts.{}.gate_proj.weight", p, e), {I, H}, ParamKind::matrix, true);
      t.add(fmt::format("{}mlp.experts.{}.up_proj.weight", p, e), {I, H}, ParamKind::matrix, true);
    }
    for (int64_t e = first; e < last; ++e) t.add(fmt::format("{}mlp.experts.{}.down_proj.weight", p, e), {H, I}, ParamKind::matrix, true);
  }
  t.layer = c.num_layers;  // the epilog
  t.add("lm_head.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    t.add(p + "input_layernorm.weight", {H}, ParamKind::norm);
    t.add(p + "self_attn.q_norm.weight", {D}, ParamKind::norm);
    t.add(p + "self_attn.k_norm.weight", {D}, ParamKind::norm);
    t.add(p + "post_attention_layernorm.weight", {H}, ParamKind::norm);
  }
  t.layer = c.num_layers;
  t.add("model.norm.weight", {H}, ParamKind::norm);
  specs_ = std::move(t.specs);
  num_parameters_ = t.numel;
}

int64_t Qwen3Moe::num_active_parameters() const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t attention = H * D * (2 * c.num_heads + 2 * c.num_kv_heads);
  const int64_t experts = c.top_k * 3 * H * c.expert_intermediate_size;
  return c.num_layers * (attention + c.num_experts * H + experts) + c.vocab_size * H;
}

Qwen3MoeWeights Qwen3Moe::bind(const Placement& placement) const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size, E = c.num_experts, El = experts_.count;
  // Walks the spec table in the constructor's order, so each view lands on its canonical tensor.
  TableCursor cursor(specs_, placement);
  auto take = [&](std::initializer_list<int64_t> dims, int64_t count = 1) { return cursor.take(dims, count); };
  Qwen3MoeWeights w;
  w.embed = take({c.vocab_size, H});
  w.layers.resize(size_t(c.num_layers));
  for (auto& L : w.layers) {
    L.layer = &L - w.layers.data();
    L.q_proj = take({c.num_heads * D, H});
    L.k_proj = take({c.num_kv_heads * D, H});
    L.v_proj = take({c.num_kv_heads * D, H});
    L.o_proj = take({H, c.num_heads * D});
    L.router = take({E, H});
    L.experts_gate_up = take({El, 2 * I, H}, 2 * El);
    L.experts_down = take({El, H, I}, El);
  }
  w.lm_head = take({c.vocab_size, H});
  for (auto& L : w.layers) {
    L.input_norm = take({H});
    L.q_norm = take({D});
    L.k_norm = take({D});
    L.post_norm = take({H});
  }
  w.final_norm = take({H});
  cursor.expect_end();
  return w;
}

// The micro-batch's RoPE cosines and sines on the GPU (built on first use), none on the CPU.
Tensor Qwen3Moe::rope_cos_sin(const Qwen3MoeBatch& batch) const {
  if (batch.positions.view().device != Device::cuda) return {};
  if (!batch.rope_cos_sin.view().data) {
    const int64_t T = batch.positions.view().size(0), D = config_.head_dim;
    batch.rope_cos_sin = Buffer(DType::f32, Device::cuda, {T, D / 2, 2});
    rope_cos_sin_table(batch.rope_cos_sin, batch.positions, D, config_.rope_theta);
  }
  return batch.rope_cos_sin;
}

// QK-norm and RoPE of a.q and a.k, one op per tensor, writing a.rstd_q and a.rstd_k (again, with the
// same bits, in the backward): the attention op's q and k, [T, heads, D].
std::pair<Buffer, Buffer> Qwen3Moe::attention_inputs(Qwen3MoeAttentionActivations& a, const Qwen3MoeBatch& batch,
                                                     const Qwen3MoeLayerWeights& w) const {
  const Config& c = config_;
  const int64_t T = batch.batch * batch.seq, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads;
  Buffer q_rope = buffer({T, Hq, D}), k_rope = buffer({T, Hkv, D});
  const Tensor cos_sin = rope_cos_sin(batch);
  rmsnorm_rope_forward(q_rope, a.rstd_q, a.q.view().reshape({T, Hq, D}), w.q_norm, batch.positions, c.rms_norm_eps, c.rope_theta,
                       cos_sin);
  rmsnorm_rope_forward(k_rope, a.rstd_k, a.k.view().reshape({T, Hkv, D}), w.k_norm, batch.positions, c.rms_norm_eps, c.rope_theta,
                       cos_sin);
  return {std::move(q_rope), std::move(k_rope)};
}

void Qwen3Moe::attention_forward(Qwen3MoeAttentionActivations& a, Buffer x, const Qwen3MoeBatch& batch,
                                 const Qwen3MoeLayerWeights& w) const {
  const Config& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, E = c.num_experts;
  expect_shape("Qwen3Moe::attention_forward", "x", x, {T, H});
  a.x = std::move(x);
  a.rstd1 = stats({T});
  a.q = buffer({T, Hq * D});
  a.k = buffer({T, Hkv * D});
  a.v = buffer({T, Hkv * D});
  {
    const Buffer h1 = input_norm(a, w);
    linear_forward(a.q, h1, w.q_proj);
    linear_forward(a.k, h1, w.k_proj);
    linear_forward(a.v, h1, w.v_proj);
  }
  a.rstd_q = stats({T * Hq});
  a.rstd_k = stats({T * Hkv});
  a.attn = buffer({B, S, Hq, D});
  a.lse = stats({B, Hq, S});
  {
    const auto [q_rope, k_rope] = attention_inputs(a, batch, w);
    const Tensor q = q_rope.view().reshape({B, S, Hq, D}), k = k_rope.view().reshape({B, S, Hkv, D}),
                 v = a.v.view().reshape({B, S, Hkv, D});
    // Qualified: the member of the same name is the whole stage.
    const AttentionVariant variant{.documents = batch_documents(batch)};
    if (batch.attention) batch.attention->forward(a.attn, a.lse, q, k, v, variant);
    else marrow::attention_forward(a.attn, a.lse, q, k, v, variant);
  }
  a.x_mid = buffer({T, H});
  linear_forward(a.x_mid, a.attn.view().reshape({T, Hq * D}), w.o_proj);
  a.h2 = buffer({T, H});
  a.rstd2 = stats({T});
  // x_mid = o_proj's output + x (in place), h2 = norm(x_mid).
  rmsnorm_add_forward(a.h2, a.x_mid, a.rstd2, a.x_mid, a.x, w.post_norm, c.rms_norm_eps);
  Buffer logits = stats({T, E});
  linear_forward(logits, a.h2, w.router);
  route_tokens(a, logits, batch, {.normalize = c.norm_topk_prob}, w.layer);
}

void Qwen3Moe::attention_backward(Tensor dx, const Qwen3MoeLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight,
                                  double aux_grad, Qwen3MoeAttentionActivations& a, const Qwen3MoeBatch& batch,
                                  const Qwen3MoeLayerWeights& w) const {
  const Config& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, E = c.num_experts;
  expect_shape("Qwen3Moe::attention_backward", "dx", dx, {T, H});
  expect_shape("Qwen3Moe::attention_backward", "dx_mid", dx_mid, {T, H});
  expect_shape("Qwen3Moe::attention_backward", "dh2", dh2, {T, H});

  // Router: its input h2 also feeds the experts, so its gradient joins dh2 (added by the GEMM).
  Buffer dlogits = buffer({T, E});
  route_tokens_backward(dlogits, dtopk_weight, a, batch, {.normalize = c.norm_topk_prob}, aux_grad);
  linear_backward_weight(grads.router, dlogits, a.h2);
  linear_backward_input(dh2, dlogits, w.router, true);

  // Post-attention norm; the residual carries dx_mid straight through.
  Buffer dres = buffer({T, H});
  rmsnorm_backward(dres, grads.post_norm, dh2, a.x_mid, w.post_norm, a.rstd2, dx_mid);

  linear_backward_weight(grads.o_proj, dres, a.attn.view().reshape({T, Hq * D}));
  Buffer dattn = buffer({T, Hq * D});
  linear_backward_input(dattn, dres, w.o_proj);
  Buffer dq_rope = buffer({T, Hq, D}), dk_rope = buffer({T, Hkv, D}), dv = buffer({T, Hkv * D});
  const Tensor dq_4d = dq_rope.view().reshape({B, S, Hq, D}), dk_4d = dk_rope.view().reshape({B, S, Hkv, D}),
               dv_4d = dv.view().reshape({B, S, Hkv, D}), dattn_4d = dattn.view().reshape({B, S, Hq, D});
  {
    const auto [q_rope, k_rope] = attention_inputs(a, batch, w);
    const Tensor q = q_rope.view().reshape({B, S, Hq, D}), k = k_rope.view().reshape({B, S, Hkv, D}),
                 v = a.v.view().reshape({B, S, Hkv, D});
    const AttentionVariant variant{.documents = batch_documents(batch)};
    if (batch.attention) batch.attention->backward(dq_4d, dk_4d, dv_4d, {}, dattn_4d, q, k, v, a.attn, a.lse, variant);
    else marrow::attention_backward(dq_4d, dk_4d, dv_4d, {}, dattn_4d, q, k, v, a.attn, a.lse, variant);
  }
  Buffer dq = buffer({T, Hq * D}), dk = buffer({T, Hkv * D});
  rmsnorm_rope_backward(dq.view().reshape({T, Hq, D}), grads.q_norm, dq_rope, a.q.view().reshape({T, Hq, D}), w.q_norm, a.rstd_q,
                        batch.positions, c.rope_theta, rope_cos_sin(batch));
  rmsnorm_rope_backward(dk.view().reshape({T, Hkv, D}), grads.k_norm, dk_rope, a.k.view().reshape({T, Hkv, D}), w.k_norm, a.rstd_k,
                        batch.positions, c.rope_theta, rope_cos_sin(batch));

  {
    const Buffer h1 = input_norm(a, w);
    linear_backward_weight(grads.q_proj, dq, h1);
    linear_backward_weight(grads.k_proj, dk, h1);
    linear_backward_weight(grads.v_proj, dv, h1);
  }
  Buffer dh1 = buffer({T, H});  // the three projections' input gradients summed by their GEMMs
  linear_backward_input(dh1, dq, w.q_proj);
  linear_backward_input(dh1, dk, w.k_proj, true);
  linear_backward_input(dh1, dv, w.v_proj, true);
  rmsnorm_backward(dx, grads.input_norm, dh1, a.x, w.input_norm, a.rstd1, dres);
  a = Qwen3MoeAttentionActivations{};
}

// Mirrors the stage functions above buffer by buffer; op scratch of a few KiB (router counts, the
// norm weight-gradient partials, grouped-GEMM pointer arrays) is left out.
ModelActivationBytes Qwen3Moe::activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const {
  const Config& c = config_;
  const int64_t T = batch * seq, R = expert_rows, H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size;
  const int64_t q = c.num_heads * D, kv = c.num_kv_heads * D, E = c.num_experts, K = c.top_k, V = c.vocab_size;
  const bool gpu = device_ == Device::cuda;
  const int64_t a = int64_t(dtype_size(dtype_)), s = gpu ? 4 : a, i32 = 4;  // buffer(), stats(), indices
  ModelActivationBytes m;
  m.attention_heads = {c.num_heads, c.num_kv_heads, D};
  // The GPU embedding backward sorts the token ids: three index arrays and cub's temporary.
  m.prolog.backward_scratch = gpu ? 4 * T * i32 : 0;

  // x, q, k, v, attn, x_mid, h2; norm scales, lse, router probs and weights; top-k.
  m.attention.kept = T * (3 * H + 2 * q + 2 * kv) * a + (T * (2 + 2 * c.num_heads + c.num_kv_heads + E + K) + 2 * E + 1) * s +
                     T * K * i32;
  // h1, then q_rope and k_rope, then the router logits: one at a time.
  m.attention.forward_scratch = std::max({T * H * a, T * (q + kv) * a, T * E * s});
  // Alive through the attention op: dlogits, dres, dattn, dq_rope, dk_rope, dv, and q_rope, k_rope
  // computed again; after it, dq, dk, dh1 and h1 computed again.
  const int64_t before_op = T * (E + H + 2 * q + 2 * kv) * a;
  const int64_t op = gpu ? attention_backward_scratch(batch, seq, c.num_heads, c.num_kv_heads, D) : 0;
  m.attention.backward_scratch = before_op + std::max(T * (q + kv) * a + op, T * (q + kv + 2 * H) * a);

  m.experts.kept = R * 2 * I * a;              // gate_up (x_perm is the engine's: EngineBytes)
  m.experts.forward_scratch = R * I * a;       // act
  m.experts.backward_scratch = R * 4 * I * a;  // act (again), dact, dgate_up
  m.experts.held_for_weights = R * 3 * I * a;  // act, dgate_up (gate_up is freed)

  m.epilog = epilog_bytes(T, H, V, logits_chunk(T), a, s);
  return m;
}

}  // namespace marrow
