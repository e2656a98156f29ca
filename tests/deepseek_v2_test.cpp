#include "models/deepseek_v2.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "engine/step.h"
#include "gradcheck.h"
#include "ops/add.h"
#include "ops/cross_entropy.h"

namespace marrow {
namespace {

// Every feature: q-LoRA (or not), a dense first layer, shared experts, group-limited routing with a
// routed scaling factor, YaRN with DeepSeek's mscale.
Json tiny_config_json(bool q_lora = true, bool sequence_aux = false) {
  Json j{{"model_type", "deepseek_v2"},
         {"architectures", {"DeepseekV2ForCausalLM"}},
         {"vocab_size", 40},
         {"hidden_size", 16},
         {"num_hidden_layers", 3},
         {"num_attention_heads", 2},
         {"num_key_value_heads", 2},
         {"kv_lora_rank", 6},
         {"qk_nope_head_dim", 4},
         {"qk_rope_head_dim", 4},
         {"v_head_dim", 6},
         {"intermediate_size", 20},
         {"moe_intermediate_size", 6},
         {"n_routed_experts", 8},
         {"n_shared_experts", 1},
         {"num_experts_per_tok", 3},
         {"first_k_dense_replace", 1},
         {"topk_method", "group_limited_greedy"},
         {"n_group", 4},
         {"topk_group", 2},
         {"routed_scaling_factor", 1.5},
         {"seq_aux", sequence_aux},
         {"rope_scaling",
          {{"type", "yarn"}, {"factor", 40.0}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}, {"original_max_position_embeddings", 4096}}},
         {"max_position_embeddings", 163840},
         {"rms_norm_eps", 1e-6}};
  j["q_lora_rank"] = q_lora ? Json(5) : Json();
  return j;
}

std::string config_error(Json json) {
  try {
    DeepseekV2Config::from_json(json, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(DeepseekV2Config, ReadsHuggingFaceFields) {
  const DeepseekV2Config c = DeepseekV2Config::from_json(tiny_config_json(), "tiny");
  EXPECT_EQ(c.q_lora_rank, 5);
  EXPECT_EQ(c.qk_head_dim(), 8);
  EXPECT_EQ(c.shared_intermediate_size(), 6);
  EXPECT_EQ(c.first_dense_layers, 1);
  EXPECT_EQ(c.routing.groups, 4);
  EXPECT_EQ(c.routing.top_groups, 2);
  EXPECT_DOUBLE_EQ(c.routing.scale, 1.5);
  EXPECT_FALSE(c.routing.normalize);
  EXPECT_TRUE(c.rope.yarn);
  // mscale == mscale_all_dim: the rotary temperature is 1 and the softmax takes mscale^2 (transformers' yarn_apply_mscale).
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, 1.0);
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(c.softmax_scale, m * m / std::sqrt(8.0));
  EXPECT_EQ(DeepseekV2Config::from_json(tiny_config_json(false), "tiny").q_lora_rank, 0);
  Json alpha = tiny_config_json();
  alpha["aux_loss_alpha"] = 0.003;
  EXPECT_DOUBLE_EQ(DeepseekV2Config::from_json(alpha, "tiny").router_aux_loss_coef, 0.003 * 2 / 3);  // two MoE layers, top-3
}

TEST(DeepseekV2Config, BadFieldsGiveOneSentence) {
  auto with = [](const char* key, Json value) {
    Json j = tiny_config_json();
    j[key] = std::move(value);
    return config_error(j);
  };
  EXPECT_EQ(with("num_key_value_heads", 1),
            "config.json: num_key_value_heads (1) must equal num_attention_heads (2): kv_b_proj gives every head its key");
  EXPECT_EQ(with("topk_method", "noaux_tc"), "config.json: topk_method 'noaux_tc' is not supported (greedy or group_limited_greedy)");
  EXPECT_EQ(with("n_group", 3), "config.json: n_routed_experts (8) must be a multiple of n_group (3)");
  EXPECT_EQ(with("topk_group", 1), "config.json: num_experts_per_tok (3) exceeds the experts of topk_group groups (2)");
  EXPECT_EQ(with("first_k_dense_replace", 3), "config.json: first_k_dense_replace (3) must be in [0, num_hidden_layers = 3)");
  EXPECT_EQ(with("attention_bias", true), "config.json: attention_bias = true is not supported");
  EXPECT_EQ(with("qk_rope_head_dim", 3), "config.json: qk_rope_head_dim must be even for rotary embeddings, got 3");
  Json no_lora_rank = tiny_config_json();
  no_lora_rank.erase("kv_lora_rank");
  EXPECT_NE(config_error(no_lora_rank).find("kv_lora_rank"), std::string::npos);
}

TEST(DeepseekV2, ParameterTableHasHuggingFacesNames) {
  const DeepseekV2 model(DeepseekV2Config::from_json(tiny_config_json(), "tiny"), DType::f32, Device::cpu);
  std::vector<std::string> names;
  for (const TensorSpec& s : model.specs()) names.push_back(s.name);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const char* n : {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_a_proj.weight",
                        "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                        "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.gate.weight",
                        "model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.2.self_attn.kv_a_layernorm.weight"})
    EXPECT_TRUE(has(n)) << n;
  EXPECT_FALSE(has("model.layers.0.mlp.gate.weight"));
  EXPECT_FALSE(has("model.layers.0.self_attn.q_proj.weight"));
  int64_t total = 0;
  for (const TensorSpec& s : model.specs()) total += s.numel;
  EXPECT_EQ(total, model.num_parameters());
  EXPECT_DOUBLE_EQ(model.config().model_size().parameters, double(model.num_parameters()));
  EXPECT_DOUBLE_EQ(model.config().model_size().tensors, double(model.specs().size()));
}

struct TinyRun {
  DeepseekV2 model;
  Arena params, grads;
  DeepseekV2Batch batch;
  double loss_scale, aux_grad = 0.05;

  TinyRun(DType dtype, int64_t B, int64_t S, bool q_lora = true, bool sequence_aux = false)
      : model(DeepseekV2Config::from_json(tiny_config_json(q_lora, sequence_aux), "tiny"), dtype, Device::cpu),
        params("parameters", dtype, Device::cpu, model.num_parameters()),
        grads("gradients", dtype, Device::cpu, model.num_parameters()),
        batch{B, S, Buffer(DType::i32, Device::cpu, {B * S}), Buffer(DType::i32, Device::cpu, {B * S}), Buffer(DType::i32, Device::cpu, {B * S})} {
    const int64_t V = model.config().vocab_size;
    Philox rng = philox_for(3, "tokens");
    int64_t counted = 0;
    for (int64_t i = 0; i < B * S; ++i) {
      batch.input_ids.ptr<int32_t>()[i] = int32_t(rng.uniform(uint64_t(i)) * V);
      batch.targets.ptr<int32_t>()[i] = i % 5 == 4 ? kIgnoreIndex : int32_t(rng.uniform(uint64_t(i), 1) * V);
      batch.positions.ptr<int32_t>()[i] = int32_t(i % S);
      counted += i % 5 != 4;
    }
    loss_scale = 1.0 / double(counted);
    // Larger than Hugging Face's 0.02 (as the other families' tests): routing and attention see
    // non-trivial values; the norms' weights vary too, so that their gradients are not all alike.
    model.initialize(params, 11);
    Philox norm_rng = philox_for(4, "norms");
    for (const TensorSpec& s : model.specs()) {
      Tensor t = params.slice(s.offset, {s.numel});
      for (int64_t i = 0; i < s.numel; ++i)
        testing::set_element(t, i, s.is_norm ? 0.5 + norm_rng.uniform(uint64_t(s.offset + i)) : testing::element(t, i) * 15.0);
    }
  }

  double loss_and_gradients() {
    grads.fill_zero();
    MicroBatch<DeepseekV2> mb;
    const auto w = model.bind(params);
    forward(mb, model, w, batch);
    const double loss = loss_scale * mb.token_loss.value() + aux_grad * mb.aux_loss.value();
    backward(mb, model, w, model.bind(grads), batch, loss_scale, aux_grad);
    return loss;
  }
};

// Every parameter's gradient, through MLA (with and without q-LoRA), the dense layer, the shared
// experts, group-limited routing and the per-sequence load-balance loss, against central
// differences of the loss (f64).
TEST(DeepseekV2, WholeModelGradientsMatchFiniteDifferences) {
  for (const auto [q_lora, sequence_aux, S] : {std::tuple{true, false, int64_t(7)}, {false, true, 5}, {true, true, 1}}) {
    TinyRun run(DType::f64, 2, S, q_lora, sequence_aux);
    run.loss_and_gradients();
    Arena analytic("analytic", DType::f64, Device::cpu, run.model.num_parameters());
    std::memcpy(analytic.all().data, run.grads.all().data, analytic.bytes());
    for (const TensorSpec& s : run.model.specs())
      testing::expect_gradient(fmt::format("{} (q-LoRA {}, seq_aux {}, S={})", s.name, q_lora, sequence_aux, S), run.params.slice(s.offset, {s.numel}),
                               analytic.slice(s.offset, {s.numel}), [&] { return run.loss_and_gradients(); }, 1e-5, 4);
  }
}

// Rows [first, first + count) of a host tensor [n] or [n, width], copied.
Buffer rows_of(const Tensor& t, int64_t first, int64_t count) {
  Buffer out = t.ndim == 1 ? Buffer(t.dtype, Device::cpu, {count}) : Buffer(t.dtype, Device::cpu, {count, t.size(1)});
  copy(out, t.rows(first, first + count));
  return out;
}

double max_relative_difference(Tensor a, Tensor b) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::abs(testing::element(a, i) - testing::element(b, i)));
    scale = std::max(scale, std::abs(testing::element(a, i)));
  }
  return diff / scale;
}

// seq_aux under data parallelism: two processes' halves of a batch, each writing its sequences'
// rows (DeepseekV2Batch::sequences) with the statistics then summed as the engine's all-reduce
// does, give the whole batch's statistics and load-balance loss bit for bit, and its gradients
// (MoE layer 1's stage 1, f64).
TEST(DeepseekV2, PerSequenceStatisticsOfDataParallelHalvesAreTheWholeBatchs) {
  TinyRun run(DType::f64, 4, 5, true, true);
  const DeepseekV2& m = run.model;
  const int64_t B = 4, S = 5, T = B * S, H = m.hidden_size();
  const auto w = m.bind(run.params);
  const Buffer x = testing::random_buffer(DType::f64, {T, H}, 1), dx_mid = testing::random_buffer(DType::f64, {T, H}, 2);
  const Buffer dh2 = testing::random_buffer(DType::f64, {T, H}, 3), dtopk = testing::random_buffer(DType::f64, {T, m.top_k()}, 4);
  auto aux_loss = [&](const DeepseekV2AttentionActivations& a) {
    Buffer total = Buffer::zeros(DType::f64, Device::cpu, {1});
    m.add_aux_loss(total, a);
    return total.ptr<double>()[0];
  };

  DeepseekV2AttentionActivations whole;
  m.attention_forward(whole, rows_of(x, 0, T), run.batch, w.layers[1]);
  const Buffer whole_stats = rows_of(whole.routing_stats, 0, B);
  const double whole_aux = aux_loss(whole);
  run.grads.fill_zero();
  Buffer dx(DType::f64, Device::cpu, {T, H});
  m.attention_backward(dx, m.bind(run.grads).layers[1], dx_mid, rows_of(dh2, 0, T), dtopk, run.aux_grad, whole, run.batch, w.layers[1]);

  Arena grads("half gradients", DType::f64, Device::cpu, m.num_parameters());
  grads.fill_zero();
  std::array<DeepseekV2Batch, 2> batches;
  std::array<DeepseekV2AttentionActivations, 2> halves;
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t first = h * 2 * S;
    batches[size_t(h)] = {2, S, rows_of(run.batch.input_ids, first, 2 * S), rows_of(run.batch.targets, first, 2 * S),
                          rows_of(run.batch.positions, first, 2 * S), nullptr};
    batches[size_t(h)].sequences = {2 * h, B};
    m.attention_forward(halves[size_t(h)], rows_of(x, first, 2 * S), batches[size_t(h)], w.layers[1]);
  }
  add(halves[0].routing_stats, halves[0].routing_stats, halves[1].routing_stats);
  copy(halves[1].routing_stats, halves[0].routing_stats);
  EXPECT_EQ(std::memcmp(halves[0].routing_stats.view().data, whole_stats.view().data, whole_stats.numel() * sizeof(double)), 0);
  EXPECT_EQ(aux_loss(halves[0]), whole_aux);
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t first = h * 2 * S;
    Buffer dx_half(DType::f64, Device::cpu, {2 * S, H});
    m.attention_backward(dx_half, m.bind(grads).layers[1], rows_of(dx_mid, first, 2 * S), rows_of(dh2, first, 2 * S),
                         rows_of(dtopk, first, 2 * S), run.aux_grad, halves[size_t(h)], batches[size_t(h)], w.layers[1]);
    EXPECT_LE(max_relative_difference(dx_half, rows_of(dx, first, 2 * S)), 1e-12) << "half " << h;
  }
  EXPECT_LE(max_relative_difference(grads.all(), run.grads.all()), 1e-12);
}

TEST(DeepseekV2, SameInputsGiveBitwiseSameLossAndGradients) {
  TinyRun a(DType::f32, 2, 8), b(DType::f32, 2, 8);
  EXPECT_EQ(a.loss_and_gradients(), b.loss_and_gradients());
  EXPECT_EQ(std::memcmp(a.grads.all().data, b.grads.all().data, a.grads.bytes()), 0);
}

}  // namespace
}  // namespace marrow
