// What the backward computes again rather than keep (the ops are deterministic, so with the same
// bits): the input norm, the queries and keys normed and rotated, the gate split from q_proj's
// output and the gated attention output, the causal convolution and the DeltaNet's gated norm.
// activation_bytes mirrors what is kept.
#include "models/qwen3_5_moe.h"

#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "ops/add.h"
#include "ops/attention.h"
#include "ops/causal_conv.h"
#include "ops/gated_delta.h"
#include "ops/gated_rmsnorm.h"
#include "ops/init.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/sigmoid_gate.h"
#include "ops/swiglu.h"

namespace marrow {

namespace {

std::vector<bool> read_layer_types(const JsonFields& f, int64_t layers, const std::string& source) {
  std::vector<bool> full(static_cast<size_t>(layers), false);
  if (!f.has("layer_types")) {
    const int64_t interval = f.positive("full_attention_interval", 4);
    for (int64_t i = 0; i < layers; ++i) full[size_t(i)] = (i + 1) % interval == 0;
    return full;
  }
  const Json& types = f.raw("layer_types");
  MARROW_CHECK(types.is_array() && int64_t(types.size()) == layers, "{}: layer_types must list {} layers, got {}", source, layers, types.dump());
  for (int64_t i = 0; i < layers; ++i) {
    const Json& t = types[size_t(i)];
    MARROW_CHECK(t == "linear_attention" || t == "full_attention", "{}: layer_types[{}] is {}, not \"linear_attention\" or \"full_attention\"",
                 source, i, t.dump());
    full[size_t(i)] = t == "full_attention";
  }
  return full;
}

// partial_rotary_factor, in rope_parameters (transformers 5) or at the top level; read_rope reads the rest without it.
double read_partial_rotary(Json& json) {
  double factor = json.value("partial_rotary_factor", 0.25);
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (json.contains(key) && json[key].is_object() && json[key].contains("partial_rotary_factor")) {
      factor = json[key]["partial_rotary_factor"].get<double>();
      json[key].erase("partial_rotary_factor");
    }
  json.erase("partial_rotary_factor");
  return factor;
}

void refuse_unsupported(const JsonFields& f, const std::string& source) {
  MARROW_CHECK(!f.boolean("attention_bias", false), "{}: attention_bias = true is not supported", source);
  MARROW_CHECK(f.string("hidden_act", "silu") == "silu", "{}: hidden_act '{}' is not supported (only silu)", source, f.string("hidden_act"));
}

}  // namespace

int64_t Qwen3_5MoeConfig::full_layers() const { return std::count(full_attention.begin(), full_attention.end(), true); }

ModelSize Qwen3_5MoeConfig::model_size() const {
  const double H = double(hidden_size), D = double(head_dim), E = double(num_experts), Lf = double(full_layers());
  const double Ll = double(num_layers) - Lf, Hv = double(linear_value_heads);
  const double full = H * D * (3.0 * double(num_heads) + 2.0 * double(num_kv_heads)) + 2.0 * D;
  const double linear = H * (double(conv_channels() + value_width()) + 2.0 * Hv) + double(conv_channels() * conv_kernel) +
                        double(value_width()) * H + 2.0 * Hv + double(linear_value_dim);
  const double moe = E * H + 3.0 * E * H * double(expert_intermediate_size) + 3.0 * H * double(shared_intermediate_size) + H + 2.0 * H;
  const double layers = Lf * full + Ll * linear + double(num_layers) * moe;
  const double tensors = Lf * 6.0 + Ll * 9.0 + double(num_layers) * (7.0 + 3.0 * E) + 3.0;
  return {layers + 2.0 * double(vocab_size) * H + H, tensors};
}

Qwen3_5MoeConfig Qwen3_5MoeConfig::from_json(const Json& json, const std::string& source) {
  if (json.value("model_type", "") == "qwen3_5_moe" && json.contains("text_config")) {  // the multimodal model: its text tower
    Json text = json["text_config"];
    text["model_type"] = "qwen3_5_moe_text";
    text["architectures"] = Json::array({"Qwen3_5MoeForCausalLM"});
    if (!text.contains("tie_word_embeddings")) text["tie_word_embeddings"] = json.value("tie_word_embeddings", false);
    return from_json(text, source + " (text_config)");
  }
  Json edited = json;
  const double partial = read_partial_rotary(edited);
  JsonFields f(edited, source);
  Qwen3_5MoeConfig c;
  c.json = json;
  expect_family(f, source, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM");
  read_shared_fields(c, f, 1e-6);
  c.head_dim = f.positive("head_dim", 256);
  c.num_experts = f.positive("num_experts");
  c.expert_intermediate_size = f.positive("moe_intermediate_size");
  c.shared_intermediate_size = f.positive("shared_expert_intermediate_size");
  c.conv_kernel = f.positive("linear_conv_kernel_dim", 4);
  c.linear_key_heads = f.positive("linear_num_key_heads", 16);
  c.linear_value_heads = f.positive("linear_num_value_heads", 32);
  c.linear_key_dim = f.positive("linear_key_head_dim", 128);
  c.linear_value_dim = f.positive("linear_value_head_dim", 128);
  c.full_attention = read_layer_types(f, c.num_layers, source);
  c.rope_theta = read_rope(f, source, 10000.0, Json::object(), false).theta;
  c.rotary_dim = int64_t(double(c.head_dim) * partial);
  check_shared_values(c, c.rope_theta, source, "num_experts");
  MARROW_CHECK(c.rotary_dim > 0 && c.rotary_dim % 2 == 0 && c.rotary_dim <= c.head_dim,
               "{}: partial_rotary_factor {} gives {} rotary dims of head_dim {}: they must be even, positive and at most head_dim", source,
               partial, c.rotary_dim, c.head_dim);
  MARROW_CHECK(c.linear_value_heads % c.linear_key_heads == 0, "{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
               source, c.linear_value_heads, c.linear_key_heads);
  refuse_unsupported(f, source);
  return c;
}

Qwen3_5Moe::Qwen3_5Moe(const Config& config, DType dtype, Device device, ExpertShard experts)
    : SwigluMoeModel(config, dtype, device, experts) {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size, Is = c.shared_intermediate_size;
  const int64_t Hv = c.linear_value_heads;
  ParameterTable t(c.num_layers);
  t.add("model.embed_tokens.weight", {c.vocab_size, H}, ParamKind::table);
  for (t.layer = 0; t.layer < c.num_layers; ++t.layer) {
    const std::string p = fmt::format("model.layers.{}.", t.layer);
    if (c.full_attention[size_t(t.layer)]) {
      t.add(p + "self_attn.q_proj.weight", {2 * c.num_heads * D, H}, ParamKind::matrix);
      t.add(p + "self_attn.k_proj.weight", {c.num_kv_heads * D, H}, ParamKind::matrix);
      t.add(p + "self_attn.v_proj.weight", {c.num_kv_heads * D, H}, ParamKind::matrix);
      t.add(p + "self_attn.o_proj.weight", {H, c.num_heads * D}, ParamKind::matrix);
    } else {
      t.add(p + "linear_attn.in_proj_qkv.weight", {c.conv_channels(), H}, ParamKind::matrix);
      t.add(p + "linear_attn.in_proj_z.weight", {c.value_width(), H}, ParamKind::matrix);
      t.add(p + "linear_attn.in_proj_b.weight", {Hv, H}, ParamKind::matrix);
      t.add(p + "linear_attn.in_proj_a.weight", {Hv, H}, ParamKind::matrix);
      t.add(p + "linear_attn.conv1d.weight", {c.conv_channels(), 1, c.conv_kernel}, ParamKind::table);  // a row a channel, not a map
      t.add(p + "linear_attn.out_proj.weight", {H, c.value_width()}, ParamKind::matrix);
    }
    for (const char* m : {"gate_proj", "up_proj"}) t.add(fmt::format("{}mlp.shared_expert.{}.weight", p, m), {Is, H}, ParamKind::matrix);
    t.add(p + "mlp.shared_expert.down_proj.weight", {H, Is}, ParamKind::matrix);
    t.add(p + "mlp.shared_expert_gate.weight", {1, H}, ParamKind::table);
    t.add(p + "mlp.gate.weight", {c.num_experts, H}, ParamKind::table);
    if (!c.full_attention[size_t(t.layer)]) {  // the unit's biases after its matrices
      t.add(p + "linear_attn.A_log", {Hv}, ParamKind::bias);
      t.add(p + "linear_attn.dt_bias", {Hv}, ParamKind::bias);
    }
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
    if (c.full_attention[size_t(t.layer)]) {
      t.add(p + "self_attn.q_norm.weight", {D}, ParamKind::norm);
      t.add(p + "self_attn.k_norm.weight", {D}, ParamKind::norm);
    } else {
      t.add(p + "linear_attn.norm.weight", {c.linear_value_dim}, ParamKind::norm);
    }
    t.add(p + "post_attention_layernorm.weight", {H}, ParamKind::norm);
  }
  t.layer = c.num_layers;
  t.add("model.norm.weight", {H}, ParamKind::norm);
  specs_ = std::move(t.specs);
  num_parameters_ = t.numel;
}

void Qwen3_5Moe::initialize(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed) const {
  if (spec.name.ends_with("A_log")) {  // HF's log(uniform(0.01, 16)), drawn from Philox(seed, name) as every tensor
    Buffer host(out.dtype, Device::cpu, {out.numel()});
    const Philox rng = philox_for(seed, spec.name);
    for (int64_t i = 0; i < out.numel(); ++i) {
      const float value = std::log(0.01f + 15.99f * rng.uniform(uint64_t(spec.canonical_first + first + i)));
      if (out.dtype == DType::f64) host.ptr<double>()[i] = value;
      else host.ptr<float>()[i] = value;
    }
    return copy(out, host);
  }
  if (spec.name.ends_with("dt_bias") || spec.name.ends_with("linear_attn.norm.weight")) return fill_constant(out, 1.0);
  if (spec.is_norm) return fill_constant(out, 0.0);  // zero-centred: the scale starts at 1 + 0
  initialize_tensor(out, spec, first, seed, config_.initializer_range);
}

int64_t Qwen3_5Moe::num_active_parameters() const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, Lf = c.full_layers(), Ll = c.num_layers - Lf;
  const int64_t full = H * D * (3 * c.num_heads + 2 * c.num_kv_heads);
  const int64_t linear = H * (c.conv_channels() + 2 * c.value_width() + 2 * c.linear_value_heads);
  const int64_t moe = (c.num_experts + 1) * H + 3 * H * (c.top_k * c.expert_intermediate_size + c.shared_intermediate_size);
  return Lf * full + Ll * linear + c.num_layers * moe + c.vocab_size * H;
}

double Qwen3_5Moe::attention_flops_per_token(int64_t seq) const {
  const Config& c = config_;
  const double Dk = double(c.linear_key_dim), Dv = double(c.linear_value_dim);
  const double full = 6.0 * double(seq) * double(attention_width()), delta = 3.0 * double(c.linear_value_heads) * (4.0 * Dk * Dv + 128.0 * (Dk + Dv));
  return double(c.full_layers()) * full + double(c.num_layers - c.full_layers()) * delta;
}

Qwen3_5MoeWeights Qwen3_5Moe::bind(const Placement& placement) const {
  const Config& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size, Is = c.shared_intermediate_size, El = experts_.count;
  const int64_t Hv = c.linear_value_heads, C = c.conv_channels();
  TableCursor cursor(specs_, placement);
  auto take = [&](std::initializer_list<int64_t> dims, int64_t count = 1) { return cursor.take(dims, count); };
  Qwen3_5MoeWeights w;
  w.embed = take({c.vocab_size, H});
  w.layers.resize(size_t(c.num_layers));
  for (auto& L : w.layers) {
    L.layer = &L - w.layers.data();
    L.full = c.full_attention[size_t(L.layer)];
    if (L.full) {
      L.q_proj = take({2 * c.num_heads * D, H});
      L.k_proj = take({c.num_kv_heads * D, H});
      L.v_proj = take({c.num_kv_heads * D, H});
      L.o_proj = take({H, c.num_heads * D});
    } else {
      L.in_proj_qkv = take({C, H});
      L.in_proj_z = take({c.value_width(), H});
      L.in_proj_ba = take({2 * Hv, H}, 2);
      L.conv = take({C, c.conv_kernel});
      L.out_proj = take({H, c.value_width()});
    }
    L.shared_gate_up = take({2 * Is, H}, 2);
    L.shared_down = take({H, Is});
    L.shared_gate = take({1, H});
    L.router = take({c.num_experts, H});
    if (!L.full) {
      L.A_log = take({Hv});
      L.dt_bias = take({Hv});
    }
    L.experts_gate_up = take({El, 2 * I, H}, 2 * El);
    L.experts_down = take({El, H, I}, El);
  }
  w.lm_head = take({c.vocab_size, H});
  for (auto& L : w.layers) {
    L.input_norm = take({H});
    if (L.full) {
      L.q_norm = take({D});
      L.k_norm = take({D});
    } else {
      L.delta_norm = take({c.linear_value_dim});
    }
    L.post_norm = take({H});
  }
  w.final_norm = take({H});
  cursor.expect_end();
  return w;
}

// The token mixers' steps that the backward computes again, and each mixer's two passes.
struct Qwen3_5Moe::Mixer {
  const Qwen3_5Moe& m;
  Qwen3_5MoeAttentionActivations& a;
  const Qwen3_5MoeBatch& batch;
  const Qwen3_5MoeLayerWeights& w;
  const Config& c() const { return m.config_; }
  int64_t T() const { return batch.batch * batch.seq; }

  // Gated attention: the query (normed, rotated) and gate split from a.qg, the key normed and rotated.
  std::array<Buffer, 3> query_gate_key() const {
    const int64_t Hq = c().num_heads, Hkv = c().num_kv_heads, D = c().head_dim;
    Buffer q = m.buffer({T(), Hq, D}), gate = m.buffer({T(), Hq, D}), q_rope = m.buffer({T(), Hq, D}), k_rope = m.buffer({T(), Hkv, D});
    split_query_gate_forward(q, gate, a.qg.view().reshape({T(), Hq, 2 * D}));
    rmsnorm_forward(q_rope.view().reshape({T() * Hq, D}), a.rstd_q, q.view().reshape({T() * Hq, D}), {w.q_norm, 1}, c().rms_norm_eps);
    rmsnorm_forward(k_rope.view().reshape({T() * Hkv, D}), a.rstd_k, a.k.view().reshape({T() * Hkv, D}), {w.k_norm, 1}, c().rms_norm_eps);
    rope_forward(q_rope, q_rope, batch.positions, c().rope_theta, c().rotary_dim);
    rope_forward(k_rope, k_rope, batch.positions, c().rope_theta, c().rotary_dim);
    return {std::move(q_rope), std::move(gate), std::move(k_rope)};
  }
  Tensor heads(const Buffer& b, int64_t h) const { return b.view().reshape({batch.batch, batch.seq, h, c().head_dim}); }
  // o_proj's input: the attention output times sigmoid(gate).
  Buffer gated(const Buffer& gate) const {
    const int64_t width = c().num_heads * c().head_dim;
    Buffer y = m.buffer({T(), width});
    sigmoid_gate_forward(y, a.attn.view().reshape({T(), width}), gate.view().reshape({T(), width}));
    return y;
  }
  void attention_forward(Tensor h1, Tensor out) const {
    const int64_t Hq = c().num_heads, Hkv = c().num_kv_heads, D = c().head_dim;
    a.qg = m.buffer({T(), 2 * Hq * D});
    a.k = m.buffer({T(), Hkv * D});
    a.v = m.buffer({T(), Hkv * D});
    linear_forward(a.qg, h1, w.q_proj);
    linear_forward(a.k, h1, w.k_proj);
    linear_forward(a.v, h1, w.v_proj);
    a.rstd_q = m.stats({T() * Hq});
    a.rstd_k = m.stats({T() * Hkv});
    a.attn = m.buffer({batch.batch, batch.seq, Hq, D});
    a.lse = m.stats({batch.batch, Hq, batch.seq});
    const auto [q, gate, k] = query_gate_key();
    if (batch.attention) batch.attention->forward(a.attn, a.lse, heads(q, Hq), heads(k, Hkv), heads(a.v, Hkv), {});
    else marrow::attention_forward(a.attn, a.lse, heads(q, Hq), heads(k, Hkv), heads(a.v, Hkv));
    linear_forward(out, gated(gate), w.o_proj);
  }
  // dh1 (overwritten) from dout, the gradient of the mixer's output; weight gradients into grads.
  void attention_backward(Tensor dh1, Tensor dout, Tensor h1, const Qwen3_5MoeLayerWeights& grads) const {
    const int64_t Hq = c().num_heads, Hkv = c().num_kv_heads, D = c().head_dim, width = Hq * D;
    auto [q, gate, k] = query_gate_key();
    linear_backward_weight(grads.o_proj, dout, gated(gate));
    Buffer dgated = m.buffer({T(), width}), dattn = m.buffer({T(), width}), dgate = m.buffer({T(), width});
    linear_backward_input(dgated, dout, w.o_proj);
    sigmoid_gate_backward(dattn, dgate, dgated, a.attn.view().reshape({T(), width}), gate.view().reshape({T(), width}));
    dgated = Buffer{};
    Buffer dq = m.buffer({T(), Hq, D}), dk = m.buffer({T(), Hkv, D}), dv = m.buffer({T(), Hkv * D});
    const std::array grad_heads{heads(dq, Hq), heads(dk, Hkv), heads(dv, Hkv), heads(dattn, Hq)};
    const std::array input_heads{heads(q, Hq), heads(k, Hkv), heads(a.v, Hkv)};
    if (batch.attention)
      batch.attention->backward(grad_heads[0], grad_heads[1], grad_heads[2], {}, grad_heads[3], input_heads[0], input_heads[1], input_heads[2],
                                a.attn, a.lse, {});
    else
      marrow::attention_backward(grad_heads[0], grad_heads[1], grad_heads[2], grad_heads[3], input_heads[0], input_heads[1], input_heads[2],
                                 a.attn, a.lse);
    q = Buffer{}, k = Buffer{}, dattn = Buffer{};
    rope_backward(dq, dq, batch.positions, c().rope_theta, c().rotary_dim);
    rope_backward(dk, dk, batch.positions, c().rope_theta, c().rotary_dim);
    Buffer dq_raw = m.buffer({T(), Hq, D}), dk_raw = m.buffer({T(), Hkv * D}), dqg = m.buffer({T(), 2 * width});
    Buffer q_raw = m.buffer({T(), Hq, D});
    split_query_gate_forward(q_raw, gate, a.qg.view().reshape({T(), Hq, 2 * D}));
    rmsnorm_backward(dq_raw.view().reshape({T() * Hq, D}), grads.q_norm, dq.view().reshape({T() * Hq, D}), q_raw.view().reshape({T() * Hq, D}),
                     {w.q_norm, 1}, a.rstd_q);
    rmsnorm_backward(dk_raw.view().reshape({T() * Hkv, D}), grads.k_norm, dk.view().reshape({T() * Hkv, D}), a.k.view().reshape({T() * Hkv, D}),
                     {w.k_norm, 1}, a.rstd_k);
    split_query_gate_backward(dqg.view().reshape({T(), Hq, 2 * D}), dq_raw, dgate.view().reshape({T(), Hq, D}));
    linear_backward_weight(grads.q_proj, dqg, h1);
    linear_backward_weight(grads.k_proj, dk_raw, h1);
    linear_backward_weight(grads.v_proj, dv, h1);
    linear_backward_input(dh1, dqg, w.q_proj);
    linear_backward_input(dh1, dk_raw, w.k_proj, true);
    linear_backward_input(dh1, dv, w.v_proj, true);
  }

  // Under context parallelism the local sequences are B P pieces of S / P consecutive tokens, each
  // reaching back along the runner's chain: piece i = b P + p of t [B, S, ...] as [1, S / P, ...].
  const SequenceChain* chain() const { return batch.attention ? &batch.attention->chain : nullptr; }
  Tensor piece(Tensor t, int64_t i) const {
    t.shape[0] = batch.batch * chain()->pieces, t.shape[1] = batch.seq / chain()->pieces;
    return t.rows(i, i + 1);
  }
  // t [B, S, F] with each piece's history [B, P, n, F] before it: [B P, n + S / P, F]; and back
  // (history left out when empty).
  int64_t history_tokens() const { return c().conv_kernel - 1; }
  Buffer with_history(Tensor t, Tensor history) const {
    const int64_t blocks = batch.batch * chain()->pieces, n = history_tokens(), len = batch.seq / chain()->pieces, F = t.size(2);
    Buffer ext = m.buffer({blocks, n + len, F});
    for (int64_t i = 0; i < blocks; ++i) {
      copy(ext.view().rows(i, i + 1).reshape({n + len, F}).rows(0, n), history.reshape({blocks * n, F}).rows(i * n, i * n + n));
      copy(ext.view().rows(i, i + 1).reshape({n + len, F}).rows(n, n + len), t.reshape({blocks * len, F}).rows(i * len, i * len + len));
    }
    return ext;
  }
  void without_history(Tensor t, Tensor history, Tensor ext) const {
    const int64_t blocks = ext.size(0), n = history_tokens(), len = ext.size(1) - n, F = t.size(2);
    for (int64_t i = 0; i < blocks; ++i) {
      copy(t.reshape({blocks * len, F}).rows(i * len, i * len + len), ext.rows(i, i + 1).reshape({n + len, F}).rows(n, n + len));
      if (history.data) copy(history.reshape({blocks * n, F}).rows(i * n, i * n + n), ext.rows(i, i + 1).reshape({n + len, F}).rows(0, n));
    }
  }
  Tensor conv_input() const { return a.qkv.view().reshape({batch.batch, batch.seq, c().conv_channels()}); }

  // Gated DeltaNet: the convolution of a.qkv and the gated norm of a.core, computed again in the backward.
  Buffer conv() const {
    Buffer y = m.buffer({batch.batch, batch.seq, c().conv_channels()});
    if (!chain()) {
      causal_conv_forward(y, conv_input(), w.conv);
      return y;
    }
    const Buffer ext = with_history(conv_input(), a.conv_history), y_ext = m.buffer({ext.view().size(0), ext.view().size(1), ext.view().size(2)});
    causal_conv_forward(y_ext, ext, w.conv);
    without_history(y, {}, y_ext);
    return y;
  }
  // dqkv [B, S, C] (overwritten) from dy, the conv output's gradient; under the chain, the history's
  // gradient goes back to the pieces it was read from.
  void conv_backward(Tensor dqkv, Tensor dy, const Qwen3_5MoeLayerWeights& grads) const {
    if (!chain()) return causal_conv_backward(dqkv, grads.conv, dy, conv_input(), w.conv);
    const Tensor history = a.conv_history.view();
    const Buffer no_history = m.buffer({history.size(0), history.size(1), history.size(2), history.size(3)}), dhistory = m.buffer(
        {history.size(0), history.size(1), history.size(2), history.size(3)});
    fill_zero(no_history);
    const Buffer dy_ext = with_history(dy, no_history), x_ext = with_history(conv_input(), history);
    const Buffer dx_ext = m.buffer({dy_ext.view().size(0), dy_ext.view().size(1), dy_ext.view().size(2)});
    causal_conv_backward(dx_ext, grads.conv, dy_ext, x_ext, w.conv);
    without_history(dqkv, dhistory, dx_ext);
    chain()->previous_tokens_backward(dqkv, dhistory);
  }
  // The delta rule over y, the conv's output, in one call, or piece by piece along the chain (each
  // piece's initial state kept in a.delta_states for the backward).
  void delta_rule_forward(Tensor y) const {
    const int64_t Hk = c().linear_key_heads, Dk = c().linear_key_dim;
    if (!chain()) return gated_delta_forward(a.core, {}, y, per_head(a.g), per_head(a.beta), Hk, Dk);
    const int64_t B = batch.batch, P = chain()->pieces;
    a.delta_states = m.stats({P * B, c().linear_value_heads, Dk, c().linear_value_dim});
    chain()->forward(a.delta_states, [&](int64_t p, Tensor final) {
      for (int64_t b = 0, i = p; b < B; ++b, i += P)
        gated_delta_forward(piece(a.core, i), final.rows(b, b + 1), piece(y, i), piece(per_head(a.g), i), piece(per_head(a.beta), i), Hk, Dk,
                            a.delta_states.view().rows(p * B + b, p * B + b + 1));
    });
  }
  void delta_rule_backward(Tensor dy, Tensor dg, Tensor dbeta, Tensor dcore, Tensor y) const {
    const int64_t Hk = c().linear_key_heads, Dk = c().linear_key_dim;
    if (!chain()) return gated_delta_backward(dy, dg, dbeta, {}, dcore, y, per_head(a.g), per_head(a.beta), Hk, Dk);
    const int64_t B = batch.batch, P = chain()->pieces;
    const Buffer d_final = m.stats({P * B, c().linear_value_heads, Dk, c().linear_value_dim});
    chain()->backward(d_final, [&](int64_t p, Tensor d_initial) {
      for (int64_t b = 0, i = p; b < B; ++b, i += P)
        gated_delta_backward(piece(dy, i), piece(dg, i), piece(dbeta, i), d_initial.rows(b, b + 1), piece(dcore, i), piece(y, i),
                             piece(per_head(a.g), i), piece(per_head(a.beta), i), Hk, Dk, a.delta_states.view().rows(p * B + b, p * B + b + 1),
                             d_final.view().rows(p * B + b, p * B + b + 1));
    });
  }
  Buffer core_normed() const {
    const int64_t rows = T() * c().linear_value_heads, Dv = c().linear_value_dim;
    Buffer y = m.buffer({T(), c().value_width()});
    gated_rmsnorm_forward(y.view().reshape({rows, Dv}), a.rstd_core, a.core.view().reshape({rows, Dv}), a.z.view().reshape({rows, Dv}),
                          w.delta_norm, c().rms_norm_eps);
    return y;
  }
  Tensor per_head(const Buffer& b) const { return b.view().reshape({batch.batch, batch.seq, c().linear_value_heads}); }
  void delta_forward(Tensor h1, Tensor out) const {
    const int64_t Hv = c().linear_value_heads;
    a.qkv = m.buffer({T(), c().conv_channels()});
    a.z = m.buffer({T(), c().value_width()});
    a.ba = m.buffer({T(), 2 * Hv});
    linear_forward(a.qkv, h1, w.in_proj_qkv);
    if (chain()) {
      MARROW_CHECK(batch.seq / chain()->pieces >= history_tokens(), "Qwen3.5-MoE under context parallelism needs chunks of at least "
                   "conv_kernel - 1 = {} tokens (train.seq_len / (2 x parallel.cp)), got {}", history_tokens(), batch.seq / chain()->pieces);
      a.conv_history = m.buffer({batch.batch, chain()->pieces, history_tokens(), c().conv_channels()});
      chain()->previous_tokens(a.conv_history, conv_input());
    }
    linear_forward(a.z, h1, w.in_proj_z);
    linear_forward(a.ba, h1, w.in_proj_ba);
    a.g = m.stats({T(), Hv});
    a.beta = m.stats({T(), Hv});
    delta_gates_forward(a.g, a.beta, a.ba, w.A_log, w.dt_bias);
    a.core = m.buffer({batch.batch, batch.seq, Hv, c().linear_value_dim});
    delta_rule_forward(conv());
    a.rstd_core = m.stats({T() * Hv});
    linear_forward(out, core_normed(), w.out_proj);
  }
  void delta_backward(Tensor dh1, Tensor dout, Tensor h1, const Qwen3_5MoeLayerWeights& grads) const {
    const int64_t Hv = c().linear_value_heads, Dv = c().linear_value_dim, rows = T() * Hv, C = c().conv_channels();
    linear_backward_weight(grads.out_proj, dout, core_normed());
    Buffer dnormed = m.buffer({T(), c().value_width()}), dcore = m.buffer({rows, Dv}), dz = m.buffer({T(), c().value_width()});
    linear_backward_input(dnormed, dout, w.out_proj);
    gated_rmsnorm_backward(dcore, dz.view().reshape({rows, Dv}), grads.delta_norm, dnormed.view().reshape({rows, Dv}),
                           a.core.view().reshape({rows, Dv}), a.z.view().reshape({rows, Dv}), w.delta_norm, a.rstd_core);
    dnormed = Buffer{};
    Buffer dconv = m.buffer({batch.batch, batch.seq, C}), dg = m.stats({T(), Hv}), dbeta = m.stats({T(), Hv});
    delta_rule_backward(dconv, per_head(dg), per_head(dbeta), dcore.view().reshape({batch.batch, batch.seq, Hv, Dv}), conv());
    dcore = Buffer{};
    Buffer dba = m.buffer({T(), 2 * Hv}), dqkv = m.buffer({batch.batch, batch.seq, C});
    delta_gates_backward(dba, grads.A_log, grads.dt_bias, dg, dbeta, a.ba, w.A_log, w.dt_bias);
    conv_backward(dqkv, dconv, grads);
    const Tensor dqkv_2d = dqkv.view().reshape({T(), C});
    linear_backward_weight(grads.in_proj_qkv, dqkv_2d, h1);
    linear_backward_weight(grads.in_proj_z, dz, h1);
    linear_backward_weight(grads.in_proj_ba, dba, h1);
    linear_backward_input(dh1, dqkv_2d, w.in_proj_qkv);
    linear_backward_input(dh1, dz, w.in_proj_z, true);
    linear_backward_input(dh1, dba, w.in_proj_ba, true);
  }
};

// From a.x_attn: the post norm h2, the shared expert joined to the residual (a.x_mid), the routing.
void Qwen3_5Moe::moe_forward(Qwen3_5MoeAttentionActivations& a, const Qwen3_5MoeBatch& batch, const Qwen3_5MoeLayerWeights& w) const {
  const int64_t T = batch.batch * batch.seq, H = config_.hidden_size, Is = config_.shared_intermediate_size;
  a.shared_gate_up = buffer({T, 2 * Is});
  linear_forward(a.shared_gate_up, a.h2, w.shared_gate_up);
  {
    const Buffer act = buffer({T, Is});
    swiglu_forward(act, a.shared_gate_up);
    a.shared_out = buffer({T, H});
    linear_forward(a.shared_out, act, w.shared_down);
  }
  a.shared_logit = buffer({T, 1});
  linear_forward(a.shared_logit, a.h2, w.shared_gate);
  a.x_mid = buffer({T, H});
  sigmoid_gate_forward(a.x_mid, a.shared_out, a.shared_logit);
  add(a.x_mid, a.x_mid, a.x_attn);
  Buffer logits = stats({T, config_.num_experts});
  linear_forward(logits, a.h2, w.router);
  route_tokens(a, logits, batch, {.normalize = true}, w.layer);
}

// dres (overwritten): the gradient reaching a.x_attn, through the post norm and around it; dh2 holds
// the experts' input gradient and is used as scratch.
void Qwen3_5Moe::moe_backward(Tensor dres, Tensor dh2, const Qwen3_5MoeLayerWeights& grads, Tensor dx_mid, Tensor dtopk_weight,
                              double aux_grad, Qwen3_5MoeAttentionActivations& a, const Qwen3_5MoeBatch& batch,
                              const Qwen3_5MoeLayerWeights& w) const {
  const int64_t T = batch.batch * batch.seq, H = config_.hidden_size, Is = config_.shared_intermediate_size;
  Buffer dlogits = buffer({T, config_.num_experts});
  route_tokens_backward(dlogits, dtopk_weight, a, batch, {.normalize = true}, aux_grad);
  linear_backward_weight(grads.router, dlogits, a.h2);
  linear_backward_input(dh2, dlogits, w.router, true);
  dlogits = Buffer{};
  Buffer dshared = buffer({T, H}), dlogit = buffer({T, 1});
  sigmoid_gate_backward(dshared, dlogit, dx_mid, a.shared_out, a.shared_logit);
  linear_backward_weight(grads.shared_gate, dlogit, a.h2);
  linear_backward_input(dh2, dlogit, w.shared_gate, true);
  Buffer act = buffer({T, Is}), dact = buffer({T, Is}), dgate_up = buffer({T, 2 * Is});
  swiglu_forward(act, a.shared_gate_up);
  linear_backward_weight(grads.shared_down, dshared, act);
  linear_backward_input(dact, dshared, w.shared_down);
  swiglu_backward(dgate_up, dact, a.shared_gate_up);
  linear_backward_weight(grads.shared_gate_up, dgate_up, a.h2);
  linear_backward_input(dh2, dgate_up, w.shared_gate_up, true);
  rmsnorm_backward(dres, grads.post_norm, dh2, a.x_attn, {w.post_norm, 1}, a.rstd2, dx_mid);
}

void Qwen3_5Moe::attention_forward(Qwen3_5MoeAttentionActivations& a, Buffer x, const Qwen3_5MoeBatch& batch,
                                   const Qwen3_5MoeLayerWeights& w) const {
  const int64_t T = batch.batch * batch.seq, H = config_.hidden_size;
  expect_shape("Qwen3_5Moe::attention_forward", "x", x, {T, H});
  MARROW_CHECK(!batch.documents, "Qwen3.5-MoE does not take data.document_mask yet: its DeltaNet layers would need the state reset "
               "at each document");
  a.x = std::move(x);
  a.rstd1 = stats({T});
  a.x_attn = buffer({T, H});
  {
    const Buffer h1 = input_norm(a, w);
    const Mixer mixer{*this, a, batch, w};
    if (w.full) mixer.attention_forward(h1, a.x_attn);
    else mixer.delta_forward(h1, a.x_attn);
  }
  a.h2 = buffer({T, H});
  a.rstd2 = stats({T});
  rmsnorm_add_forward(a.h2, a.x_attn, a.rstd2, a.x_attn, a.x, {w.post_norm, 1}, config_.rms_norm_eps);
  moe_forward(a, batch, w);
}

void Qwen3_5Moe::attention_backward(Tensor dx, const Qwen3_5MoeLayerWeights& grads, Tensor dx_mid, Tensor dh2, Tensor dtopk_weight,
                                    double aux_grad, Qwen3_5MoeAttentionActivations& a, const Qwen3_5MoeBatch& batch,
                                    const Qwen3_5MoeLayerWeights& w) const {
  const int64_t T = batch.batch * batch.seq, H = config_.hidden_size;
  for (const auto& [name, t] : {std::pair{"dx", dx}, {"dx_mid", dx_mid}, {"dh2", dh2}}) expect_shape("Qwen3_5Moe::attention_backward", name, t, {T, H});
  Buffer dres = buffer({T, H});
  moe_backward(dres, dh2, grads, dx_mid, dtopk_weight, aux_grad, a, batch, w);
  Buffer dh1 = buffer({T, H});
  {
    const Buffer h1 = input_norm(a, w);
    const Mixer mixer{*this, a, batch, w};
    if (w.full) mixer.attention_backward(dh1, dres, h1, grads);
    else mixer.delta_backward(dh1, dres, h1, grads);
  }
  rmsnorm_backward(dx, grads.input_norm, dh1, a.x, {w.input_norm, 1}, a.rstd1, dres);
  a = Qwen3_5MoeAttentionActivations{};
}

// The larger of the two mixers' bytes (every layer gets the same budget), buffer by buffer as above.
ModelActivationBytes Qwen3_5Moe::activation_bytes(int64_t batch, int64_t seq, int64_t expert_rows) const {
  const Config& c = config_;
  const int64_t T = batch * seq, R = expert_rows, H = c.hidden_size, D = c.head_dim, I = c.expert_intermediate_size;
  const int64_t Is = c.shared_intermediate_size, E = c.num_experts, K = c.top_k, V = c.vocab_size, Hv = c.linear_value_heads;
  const int64_t q = c.num_heads * D, kv = c.num_kv_heads * D, C = c.conv_channels(), Vw = c.value_width();
  const bool gpu = device_ == Device::cuda;
  const int64_t a = int64_t(dtype_size(dtype_)), s = gpu ? 4 : a, i32 = 4;
  ModelActivationBytes m;
  m.attention_heads = {c.num_heads, c.num_kv_heads, D};
  m.prolog.backward_scratch = gpu ? 4 * T * i32 : 0;
  // x, x_attn, h2, shared_out, x_mid, shared gate/up; the mixer's (qg, k, v, attn or qkv, z, ba, core); statistics.
  const int64_t mixer = std::max(T * (3 * q + 2 * kv) * a + T * (2 * c.num_heads + c.num_kv_heads) * s,
                                 T * (C + 2 * Vw + 2 * Hv) * a + T * 3 * Hv * s);
  m.chain_kept = 2 * batch * (Hv * c.linear_key_dim * c.linear_value_dim * s + (c.conv_kernel - 1) * C * a);
  m.attention.kept = T * (5 * H + 2 * Is + 1) * a + mixer + (T * (3 + E + K) + (c.sequence_aux ? batch : 1) * (2 * E + 1)) * s + T * K * i32;
  m.attention.forward_scratch = T * H * a + std::max({T * (3 * q + kv) * a, T * (C + Vw) * a, T * Is * a, T * E * s});
  const int64_t op = gpu ? std::max(attention_backward_scratch(batch, seq, c.num_heads, c.num_kv_heads, D),
                                    gated_delta_backward_scratch({batch, seq, c.linear_key_heads, c.linear_key_dim, Hv, c.linear_value_dim}))
                         : 0;
  m.attention.backward_scratch = 2 * T * H * a + std::max({T * (H + 5 * Is) * a, T * (7 * q + 4 * kv) * a + op, T * (3 * C + 3 * Vw) * a + op});
  m.experts.kept = R * 2 * I * a;
  m.experts.forward_scratch = R * I * a;
  m.experts.backward_scratch = R * 4 * I * a;
  m.experts.held_for_weights = R * 3 * I * a;
  m.epilog = epilog_bytes(T, H, V, logits_chunk(T), a, s);
  return m;
}

}  // namespace marrow
