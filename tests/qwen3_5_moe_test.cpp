#include "models/qwen3_5_moe.h"

#include <algorithm>
#include <cstring>

#include "engine/memory_estimate.h"
#include "engine/step.h"
#include "gradcheck.h"
#include "ops/cross_entropy.h"

namespace marrow {
namespace {

// Every layer kind: two Gated DeltaNet layers (value heads twice the key heads) and a gated attention layer.
Json tiny_config_json() {
  return Json{{"model_type", "qwen3_5_moe_text"},
              {"architectures", {"Qwen3_5MoeForCausalLM"}},
              {"vocab_size", 40},
              {"hidden_size", 16},
              {"num_hidden_layers", 3},
              {"layer_types", {"linear_attention", "full_attention", "linear_attention"}},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 8},
              {"linear_num_key_heads", 1},
              {"linear_num_value_heads", 2},
              {"linear_key_head_dim", 4},
              {"linear_value_head_dim", 6},
              {"moe_intermediate_size", 6},
              {"shared_expert_intermediate_size", 10},
              {"num_experts", 4},
              {"num_experts_per_tok", 2},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}},
              {"rms_norm_eps", 1e-6}};
}

std::string config_error(Json json) {
  try {
    Qwen3_5MoeConfig::from_json(json, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Qwen3_5MoeConfig, ReadsHuggingFaceFields) {
  const Qwen3_5MoeConfig c = Qwen3_5MoeConfig::from_json(tiny_config_json(), "tiny");
  EXPECT_EQ(c.rotary_dim, 4);
  EXPECT_EQ(c.conv_channels(), 2 * 4 + 2 * 6);
  EXPECT_EQ(c.full_attention, (std::vector<bool>{false, true, false}));
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  Json interval = tiny_config_json();
  interval.erase("layer_types");
  interval["num_hidden_layers"] = 8;
  EXPECT_EQ(Qwen3_5MoeConfig::from_json(interval, "tiny").full_attention,
            (std::vector<bool>{false, false, false, true, false, false, false, true}));
  // The multimodal model's config reads as its text tower, written back as the text model's.
  const Json full{{"model_type", "qwen3_5_moe"}, {"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"text_config", tiny_config_json()}};
  const Qwen3_5MoeConfig text = Qwen3_5MoeConfig::from_json(full, "full");
  EXPECT_EQ(text.hidden_size, 16);
  EXPECT_EQ(text.json["model_type"], "qwen3_5_moe_text");
}

TEST(Qwen3_5MoeConfig, BadFieldsGiveOneSentence) {
  auto with = [](const char* key, Json value) {
    Json j = tiny_config_json();
    j[key] = std::move(value);
    return config_error(j);
  };
  EXPECT_EQ(with("layer_types", Json{"linear_attention", "sliding_attention", "full_attention"}),
            "config.json: layer_types[1] is \"sliding_attention\", not \"linear_attention\" or \"full_attention\"");
  EXPECT_EQ(with("linear_num_key_heads", 4), "config.json: linear_num_value_heads (2) must be a multiple of linear_num_key_heads (4)");
  EXPECT_EQ(with("attention_bias", true), "config.json: attention_bias = true is not supported");
  Json odd = tiny_config_json();
  odd["rope_parameters"]["partial_rotary_factor"] = 0.375;
  EXPECT_EQ(config_error(odd), "config.json: partial_rotary_factor 0.375 gives 3 rotary dims of head_dim 8: they must be even, positive and at most head_dim");
}

// Under context parallelism each DeltaNet layer keeps its pieces' initial states and conv histories
// (SequenceChain) besides a cp = 1 process's activations at seq_len / cp: stage 1's kept bytes at
// the peak grow by a whole number of layers' chain_kept, and not at all without CP.
TEST(Qwen3_5Moe, ContextParallelEstimateKeepsTheChainsStates) {
  const Qwen3_5MoeConfig config = Qwen3_5MoeConfig::from_json(tiny_config_json(), "tiny");
  RunConfig cp2, half;
  cp2.global_batch = half.global_batch = 2, cp2.micro_batch = half.micro_batch = 1;
  cp2.cp = 2, cp2.seq_len = 256, half.seq_len = 128;
  auto stage1 = [&](const RunConfig& rc) {
    for (const BillItem& i : estimate_memory<Qwen3_5Moe>(rc, config, 2, Device::cuda).items)
      if (i.name == "attention + router (stage 1)") return i.bytes;
    return int64_t{-1};
  };
  // Two pieces' f32 states [Hv, Dk, Dv] and bf16 histories [K - 1, C] (one sequence a micro-batch).
  const int64_t chain = 2 * (config.linear_value_heads * config.linear_key_dim * config.linear_value_dim * 4 + 3 * config.conv_channels() * 2);
  const int64_t grown = stage1(cp2) - stage1(half);
  EXPECT_GT(grown, 0);
  EXPECT_EQ(grown % chain, 0) << grown << " is not a whole number of layers' " << chain;
}

TEST(Qwen3_5Moe, ParameterTableHasHuggingFacesNames) {
  const Qwen3_5Moe model(Qwen3_5MoeConfig::from_json(tiny_config_json(), "tiny"), DType::f32, Device::cpu);
  std::vector<std::string> names;
  for (const TensorSpec& s : model.specs()) names.push_back(s.name);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const char* n : {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.A_log",
                        "model.layers.0.linear_attn.norm.weight", "model.layers.1.self_attn.q_norm.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                        "model.layers.2.mlp.experts.3.down_proj.weight", "model.norm.weight"})
    EXPECT_TRUE(has(n)) << n;
  EXPECT_FALSE(has("model.layers.1.linear_attn.A_log"));
  EXPECT_DOUBLE_EQ(model.config().model_size().parameters, double(model.num_parameters()));
  EXPECT_DOUBLE_EQ(model.config().model_size().tensors, double(model.specs().size()));
}

struct TinyRun {
  Qwen3_5Moe model;
  Arena params, grads;
  Qwen3_5MoeBatch batch;
  double loss_scale, aux_grad = 0.05;

  TinyRun(DType dtype, int64_t B, int64_t S)
      : model(Qwen3_5MoeConfig::from_json(tiny_config_json(), "tiny"), dtype, Device::cpu),
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
    // Matrices 15x Hugging Face's scale (decisive routing, non-trivial values, as the other families'
    // tests); norms drawn around their start, so the offsets' gradients are not all alike; A_log and
    // dt_bias as initialised (their exp and softplus would overflow at 15x).
    model.initialize(params, 11);
    Philox norm_rng = philox_for(4, "norms");
    for (const TensorSpec& s : model.specs()) {
      if (s.name.ends_with("A_log") || s.name.ends_with("dt_bias")) continue;
      Tensor t = params.slice(s.offset, {s.numel});
      for (int64_t i = 0; i < s.numel; ++i)
        testing::set_element(t, i, s.is_norm ? norm_rng.uniform(uint64_t(s.offset + i)) - 0.5 : testing::element(t, i) * 15.0);
    }
  }

  double loss_and_gradients() {
    grads.fill_zero();
    MicroBatch<Qwen3_5Moe> mb;
    const auto w = model.bind(params);
    forward(mb, model, w, batch);
    const double loss = loss_scale * mb.token_loss.value() + aux_grad * mb.aux_loss.value();
    backward(mb, model, w, model.bind(grads), batch, loss_scale, aux_grad);
    return loss;
  }
};

// Every parameter's gradient, through both mixers (the delta rule over several of the CPU's chunks
// at S = 70), the shared expert's gate, the routing and the load-balance loss, against central
// differences of the loss (f64).
TEST(Qwen3_5Moe, WholeModelGradientsMatchFiniteDifferences) {
  for (const int64_t S : {int64_t(7), int64_t(70)}) {
    TinyRun run(DType::f64, 2, S);
    run.loss_and_gradients();
    Arena analytic("analytic", DType::f64, Device::cpu, run.model.num_parameters());
    std::memcpy(analytic.all().data, run.grads.all().data, analytic.bytes());
    for (const TensorSpec& s : run.model.specs())
      testing::expect_gradient(fmt::format("{} (S={})", s.name, S), run.params.slice(s.offset, {s.numel}), analytic.slice(s.offset, {s.numel}),
                               [&] { return run.loss_and_gradients(); }, 1e-5, 4);
  }
}

TEST(Qwen3_5Moe, SameInputsGiveBitwiseSameLossAndGradients) {
  TinyRun a(DType::f32, 2, 8), b(DType::f32, 2, 8);
  EXPECT_EQ(a.loss_and_gradients(), b.loss_and_gradients());
  EXPECT_EQ(std::memcmp(a.grads.all().data, b.grads.all().data, a.grads.bytes()), 0);
}

}  // namespace
}  // namespace marrow
