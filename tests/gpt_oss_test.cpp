#include "models/gpt_oss.h"

#include "engine/step.h"
#include "fp8_model_check.h"
#include "gradcheck.h"
#include "ops/cross_entropy.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/init.h"
#include "parallel/sharded_params.h"

namespace marrow {
namespace {

// Two layers (the first in a sliding window of 3, the second full), YaRN RoPE, a SwiGLU clamp low
// enough that some inputs pass it.
Json tiny_config_json() {
  return Json{{"model_type", "gpt_oss"},
              {"architectures", {"GptOssForCausalLM"}},
              {"vocab_size", 40},
              {"hidden_size", 16},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 8},
              {"num_local_experts", 8},
              {"num_experts_per_tok", 2},
              {"intermediate_size", 12},
              {"sliding_window", 3},
              {"swiglu_limit", 1.5},
              {"rope_parameters",
               {{"rope_type", "yarn"},
                {"rope_theta", 150000.0},
                {"factor", 32.0},
                {"beta_fast", 32.0},
                {"beta_slow", 1.0},
                {"truncate", false},
                {"original_max_position_embeddings", 4096}}},
              {"rms_norm_eps", 1e-5}};
}

std::string config_error(Json json) {
  try {
    GptOssConfig::from_json(json, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(GptOssConfig, ReadsHuggingFaceFields) {
  GptOssConfig c = GptOssConfig::from_json(tiny_config_json(), "config.json");
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.expert_intermediate_size, 12);
  EXPECT_EQ(c.sliding_window, 3);
  EXPECT_EQ(c.sliding, (std::vector<bool>{true, false}));  // Hugging Face's default: even layers slide
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_EQ(c.rope.original_max_positions, 4096);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_EQ(c.swiglu_alpha, 1.702);
  // The Hub's files: rope_theta and rope_scaling at the top level, layer_types given.
  Json j = tiny_config_json();
  j["rope_scaling"] = j["rope_parameters"];
  j["rope_scaling"].erase("rope_theta");
  j.erase("rope_parameters");
  j["rope_theta"] = 5e5;
  j["layer_types"] = {"full_attention", "sliding_attention"};
  c = GptOssConfig::from_json(j, "config.json");
  EXPECT_EQ(c.rope.theta, 5e5);
  EXPECT_EQ(c.sliding, (std::vector<bool>{false, true}));
  // The Hub's MXFP4 experts are read dequantized: the config Marrow keeps and exports says nothing of MXFP4.
  j["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"model.layers.*.self_attn"}}};
  c = GptOssConfig::from_json(j, "config.json");
  EXPECT_FALSE(c.json.contains("quantization_config"));
}

// RoPE and head_dim as transformers 5 reads them (modeling_rope_utils, GptOssConfig): a config that
// transformers loads as yarn is yarn here too, with the same numbers.
TEST(GptOssConfig, ReadsRopeAsTransformersDoes) {
  Json j = tiny_config_json();
  j.erase("rope_parameters");
  j.erase("head_dim");
  GptOssConfig c = GptOssConfig::from_json(j, "config.json");  // GptOssConfig's defaults
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_EQ(c.rope.theta, 150000.0);
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.original_max_positions, 4096);
  EXPECT_FALSE(c.rope.truncate);
  // The older `type` key; the top-level rope_theta and original_max_position_embeddings.
  j = tiny_config_json();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 2048}};
  j["rope_theta"] = 500.0;
  j["original_max_position_embeddings"] = 8;
  c = GptOssConfig::from_json(j, "config.json");  // rope_scaling wins over rope_parameters
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_EQ(c.rope.factor, 8.0);
  EXPECT_EQ(c.rope.theta, 500.0);
  EXPECT_EQ(c.rope.original_max_positions, 8);
  EXPECT_TRUE(c.rope.truncate);
  // Without either original_max_position_embeddings, max_position_embeddings stands in.
  j["rope_scaling"].erase("original_max_position_embeddings");
  j.erase("original_max_position_embeddings");
  j["max_position_embeddings"] = 1024;
  EXPECT_EQ(GptOssConfig::from_json(j, "config.json").rope.original_max_positions, 1024);
  // An empty rope_scaling (or null) leaves rope_parameters in charge.
  j = tiny_config_json();
  j["rope_scaling"] = Json::object();
  EXPECT_EQ(GptOssConfig::from_json(j, "config.json").rope.factor, 32.0);
}

TEST(GptOssConfig, BadFieldsGiveOneSentence) {
  Json j = tiny_config_json();
  j.erase("intermediate_size");
  EXPECT_EQ(config_error(j), "config.json: required key 'intermediate_size' is missing");
  j = tiny_config_json();
  j["model_type"] = "qwen3_moe";
  EXPECT_EQ(config_error(j), "config.json: model_type is 'qwen3_moe' but this model is gpt_oss");
  j = tiny_config_json();
  j["layer_types"] = {"full_attention"};
  EXPECT_EQ(config_error(j), "config.json: layer_types must list 2 layers, got [\"full_attention\"]");
  j = tiny_config_json();
  j["layer_types"] = {"full_attention", "local"};
  EXPECT_EQ(config_error(j), "config.json: layer_types[1] is \"local\", not \"sliding_attention\" or \"full_attention\"");
  j = tiny_config_json();
  j["rope_parameters"]["mscale"] = 0.7;
  EXPECT_EQ(config_error(j), "config.json: mscale is not supported");
  j = tiny_config_json();
  j["rope_parameters"]["rope_type"] = "longrope";
  EXPECT_EQ(config_error(j), "config.json: rope_parameters: rope_type 'longrope' is not supported (default or yarn)");
  j = tiny_config_json();
  j["rope_parameters"] = {{"full_attention", j["rope_parameters"]}};
  EXPECT_EQ(config_error(j), "config.json: rope_parameters: settings per layer type are not supported");
  j = tiny_config_json();
  j["quantization_config"] = {{"quant_method", "bitsandbytes"}};
  EXPECT_EQ(config_error(j), "config.json: quantization_config.quant_method 'bitsandbytes' is not supported (mxfp4 is, read dequantized)");
  j = tiny_config_json();
  j["num_experts_per_tok"] = 9;
  EXPECT_EQ(config_error(j), "config.json: num_experts_per_tok (9) exceeds num_local_experts (8)");
}

// An expert-parallel rank holds its experts' rows of the fused tensors, addressed in the canonical
// tensor (TensorSpec::canonical_first), and initialises them with the whole model's numbers.
TEST(GptOss, AnExpertShardHoldsItsRowsOfTheFusedTensors) {
  const GptOssConfig c = GptOssConfig::from_json(tiny_config_json(), "config.json");
  const GptOss whole(c, DType::f32, Device::cpu), shard(c, DType::f32, Device::cpu, ExpertShard{4, 4});
  EXPECT_EQ(shard.num_local_experts(), 4);
  ASSERT_EQ(whole.specs().size(), shard.specs().size());
  Arena a("parameters", DType::f32, Device::cpu, whole.num_parameters()), b("parameters", DType::f32, Device::cpu, shard.num_parameters());
  whole.initialize(a, 5);
  shard.initialize(b, 5);
  int parts = 0;
  for (size_t i = 0; i < whole.specs().size(); ++i) {
    const TensorSpec &w = whole.specs()[i], &s = shard.specs()[i];
    ASSERT_EQ(w.name, s.name);
    EXPECT_TRUE(w.canonical_shape.empty()) << w.name;
    const int64_t first = s.canonical_shape.empty() ? 0 : w.numel / 2;
    if (!s.canonical_shape.empty()) {
      ++parts;
      EXPECT_TRUE(s.is_expert) << s.name;
      EXPECT_EQ(s.canonical_shape, w.shape) << s.name;
      EXPECT_EQ(s.shape[0], 4) << s.name;
      EXPECT_EQ(s.canonical_first, first) << s.name;
      EXPECT_EQ(s.numel, w.numel / 2) << s.name;
    }
    EXPECT_EQ(std::memcmp(a.all().ptr<float>() + w.offset + first, b.all().ptr<float>() + s.offset, size_t(s.numel) * sizeof(float)), 0)
        << s.name;
  }
  EXPECT_EQ(parts, 4 * c.num_layers);  // gate_up_proj, its bias, down_proj, its bias
  try {
    GptOss m(c, DType::f32, Device::cpu, ExpertShard{6, 4});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "experts [6, 10) are not a range of the model's 8 experts");
  }
}

// The bench's attention FLOPs: the tiny config's layers are sliding (window 3) then full. A query
// of a sliding layer sees min(i + 1, W) keys; the count is that mean up to the convention's S / 2
// for a full layer (W - W^2 / (2 S) against W - W (W - 1) / (2 S)).
TEST(GptOss, AttentionFlopsCountEachLayersWindow) {
  const GptOss m(GptOssConfig::from_json(tiny_config_json(), "config.json"), DType::f32, Device::cpu);
  const double width = 4 * 8, full = 6.0 * 64 * width;  // S = 64
  EXPECT_DOUBLE_EQ(m.attention_flops_per_token(64), full + 12.0 * (3 - 9.0 / 128) * width);
  EXPECT_DOUBLE_EQ(m.attention_flops_per_token(3), 2 * 6.0 * 3 * width);  // the window spans the sequence
  EXPECT_DOUBLE_EQ(m.attention_flops_per_token(2), 2 * 6.0 * 2 * width);
}

// Hugging Face's tensors, in its names and shapes; biases start at zero except the router's.
TEST(GptOss, ParameterTableIsHuggingFacesAndInitialisesAsItDoes) {
  GptOss m(GptOssConfig::from_json(tiny_config_json(), "config.json"), DType::f32, Device::cpu);
  Arena a("parameters", DType::f32, Device::cpu, m.num_parameters());
  m.initialize(a, 5);
  int64_t total = 0;
  for (const TensorSpec& s : m.specs()) {
    total += s.numel;
    const Tensor t = a.slice(s.offset, {s.numel});
    double sum_abs = 0;
    for (int64_t i = 0; i < s.numel; ++i) sum_abs += std::abs(testing::element(t, i));
    const bool zero = s.name.ends_with("bias") && !s.name.ends_with("router.bias");
    if (s.is_norm) EXPECT_EQ(sum_abs, double(s.numel)) << s.name;
    else if (zero) EXPECT_EQ(sum_abs, 0.0) << s.name;
    else EXPECT_GT(sum_abs, 0.0) << s.name;
  }
  EXPECT_EQ(total, m.num_parameters());
  const auto find = [&](const std::string& name) {
    for (const TensorSpec& s : m.specs())
      if (s.name == name) return s.shape;
    return std::vector<int64_t>{};
  };
  EXPECT_EQ(find("model.layers.1.mlp.experts.gate_up_proj"), (std::vector<int64_t>{8, 16, 24}));
  EXPECT_EQ(find("model.layers.1.mlp.experts.down_proj"), (std::vector<int64_t>{8, 12, 16}));
  EXPECT_EQ(find("model.layers.0.self_attn.sinks"), (std::vector<int64_t>{4}));
  EXPECT_EQ(find("model.layers.0.mlp.router.bias"), (std::vector<int64_t>{8}));
}

// AdamW decays matrices and embeddings, not norms, biases or sinks (TensorSpec::decayed): from a zero
// gradient a decayed weight of 1 becomes 1 - lr * weight_decay and the others keep their bits. A
// unit's matrices come before its biases, so each unit takes at most one run of either.
TEST(GptOss, WeightDecaySkipsNormsBiasesAndSinks) {
  const GptOss m(GptOssConfig::from_json(tiny_config_json(), "config.json"), DType::f32, Device::cpu);
  const int64_t L = m.num_layers();
  const Mesh mesh = Mesh::create(MeshShape{}, Device::cpu);
  ShardedParameters state(m.specs(), L, std::vector<int64_t>(size_t(L + 2), 0), mesh, false, false, false, Device::cpu, DType::f32);
  fill_constant(state.params().all(), 1.0);
  const AdamWHyper hyper{1e-2, 0.9, 0.95, 1e-8, 0.1, 1};
  state.optimizer_step(hyper);
  const float decayed = float(1.0 * (1.0 - hyper.lr * hyper.weight_decay));
  int64_t undecayed_tensors = 0;
  for (size_t i = 0; i < m.specs().size(); ++i) {
    const TensorSpec& s = m.specs()[i];
    const bool bias = s.name.ends_with("bias") || s.name.ends_with("sinks");
    EXPECT_EQ(s.decayed, !bias && !s.is_norm) << s.name;
    undecayed_tensors += !s.decayed;
    const Tensor t = state.params().slice(s.offset, {s.numel});
    for (int64_t e = 0; e < s.numel; ++e) ASSERT_EQ(float(testing::element(t, e)), s.decayed ? decayed : 1.0f) << s.name << " " << e;
    if (i > 0 && s.layer == m.specs()[i - 1].layer && s.is_expert == m.specs()[i - 1].is_expert && !s.is_norm)
      EXPECT_TRUE(m.specs()[i - 1].decayed || !s.decayed) << s.name << " follows a bias in its unit";
  }
  EXPECT_EQ(undecayed_tensors, 2 * L + 1 + L * 8);  // norms; q, k, v, o, router, expert biases and sinks
}

struct TinyRun {
  GptOss model;
  Arena params, grads;
  GptOssBatch batch;
  double loss_scale, aux_grad = 0.05;

  TinyRun(DType dtype, int64_t B, int64_t S)
      : model(GptOssConfig::from_json(tiny_config_json(), "tiny"), dtype, Device::cpu),
        params("parameters", dtype, Device::cpu, model.num_parameters()),
        grads("gradients", dtype, Device::cpu, model.num_parameters()),
        batch{B, S, Buffer(DType::i32, Device::cpu, {B * S}), Buffer(DType::i32, Device::cpu, {B * S}),
              Buffer(DType::i32, Device::cpu, {B * S})} {
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
    // Larger than Hugging Face's 0.02, as in the Qwen3-MoE test: routing, attention and the clamp
    // see non-trivial values. Biases get values too, so that their paths carry gradients.
    model.initialize(params, 11);
    Philox bias_rng = philox_for(4, "biases");
    for (const TensorSpec& s : model.specs()) {
      Tensor t = params.slice(s.offset, {s.numel});
      for (int64_t i = 0; i < s.numel; ++i) {
        const double v = s.name.ends_with("bias") ? bias_rng.uniform(uint64_t(s.offset + i)) - 0.5 : testing::element(t, i) * 15.0;
        if (!s.is_norm) testing::set_element(t, i, v);
      }
    }
  }

  double loss_and_gradients() {
    grads.fill_zero();
    MicroBatch<GptOss> mb;
    const auto w = model.bind(params);
    forward(mb, model, w, batch);
    const double loss = loss_scale * mb.token_loss.value() + aux_grad * mb.aux_loss.value();
    backward(mb, model, w, model.bind(grads), batch, loss_scale, aux_grad);
    return loss;
  }
};

// train.fp8 (tests/fp8_model_check.h): the fused [E, in, out] tensors' transposed quantization in the
// forward, as stored in the backward input. Each expert tensor's gradient stays close on its own too.
TEST(GptOss, Fp8ExpertGemmsStayCloseAndFollowTheWeights) {
  TinyRun plain(DType::f32, 2, 8), fp8(DType::f32, 2, 8), again(DType::f32, 2, 8);
  testing::expect_fp8_experts_close<TinyRun>(plain, fp8, again, [](TinyRun& r) { return r.model.bind(r.params).layers[1].experts_down; });
  set_expert_fp8(true);
  fp8.loss_and_gradients();
  set_expert_fp8(false);
  plain.loss_and_gradients();
  for (const char* name : {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}) {
    double error = 0, norm = 0;
    for (const TensorSpec& s : plain.model.specs())
      if (s.name.find(name) != std::string::npos)
        for (int64_t i = s.offset; i < s.offset + s.numel; ++i) {
          error += std::pow(double(fp8.grads.all().ptr<float>()[i]) - plain.grads.all().ptr<float>()[i], 2);
          norm += std::pow(double(plain.grads.all().ptr<float>()[i]), 2);
        }
    EXPECT_GT(norm, 0.0) << name;
    EXPECT_LT(std::sqrt(error / norm), 0.15) << name;
  }
}

// Every parameter's gradient, through sinks, windows shorter than the sequence, YaRN, the clamp, the
// biases and the routing weights, against central differences of the loss (f64).
TEST(GptOss, WholeModelGradientsMatchFiniteDifferences) {
  for (int64_t S : {1, 7}) {
    TinyRun run(DType::f64, 2, S);
    run.loss_and_gradients();
    Arena analytic("analytic", DType::f64, Device::cpu, run.model.num_parameters());
    std::memcpy(analytic.all().data, run.grads.all().data, analytic.bytes());
    for (const TensorSpec& s : run.model.specs()) {
      testing::expect_gradient(s.name + " (S=" + std::to_string(S) + ")", run.params.slice(s.offset, {s.numel}),
                               analytic.slice(s.offset, {s.numel}), [&] { return run.loss_and_gradients(); }, 1e-5, 4);
    }
  }
}

TEST(GptOss, SameInputsGiveBitwiseSameLossAndGradients) {
  TinyRun a(DType::f32, 2, 8), b(DType::f32, 2, 8);
  EXPECT_EQ(a.loss_and_gradients(), b.loss_and_gradients());
  EXPECT_EQ(std::memcmp(a.grads.all().data, b.grads.all().data, a.grads.bytes()), 0);
}

}  // namespace
}  // namespace marrow
