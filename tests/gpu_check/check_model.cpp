// Whole-model GPU checks: the same model (Qwen3-MoE, GPT-OSS and DeepSeek-V2; same initial weights, rounded to bf16 so both sides compute with identical numbers)
// runs one micro-batch forward and backward on the CPU in f32 and on the GPU in bf16.
//
// Top-k routing is discontinuous: a token whose k-th and (k+1)-th experts are nearly tied can pick a
// different expert in bf16 than in f32 (the check prints how many choices differ; measured: a few
// per hundred), and that token's gradients then differ by far more than rounding. So every
// gradient is compared on configs that route each token to every expert (K = E), where the model is
// smooth and only rounding separates the sides (bound 5e-2 of the tensor's largest element); the
// routed configs (K < E) are compared on the loss and the load-balance loss.
// Routed MoE (K < E) is discontinuous: bf16 and f32 can pick different experts for near-tied tokens,
// so the GPU-vs-CPU gradient and logit rows use K = E configs. GPT-OSS's clamp is a discontinuity of
// the same kind: the rows keep gates away from it.
#include <cmath>
#include <optional>

#include "gpu_check/check.h"
#include "core/rng.h"
#include "engine/step.h"
#include "models/deepseek_v2.h"
#include "models/qwen3_5_moe.h"
#include "models/gpt_oss.h"
#include "models/qwen3_moe.h"
#include "ops/cast.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/init.h"

namespace marrow {

namespace {

template <class M>
struct ModelSide {
  M model;
  Arena params, grads;
  std::optional<Arena> working;
  double loss = 0, aux = 0;
  std::vector<Buffer> routing;  // each layer's top-k expert choices, on the host

  ModelSide(const typename M::Config& config, Device device)
      : model(config, device == Device::cuda ? DType::bf16 : DType::f32, device),
        params("parameters", DType::f32, device, model.num_parameters()),
        grads("gradients", DType::f32, device, model.num_parameters()) {
    model.initialize(params, 5);
    // Biases drawn like the weights (the init's zeros would hide a bias that is never added): the same
    // numbers on both sides, as every tensor's are.
    for (const TensorSpec& s : model.specs())
      if (s.name.ends_with("bias")) fill_normal(params.slice(s.offset, {s.numel}), 6, s.name, 0.2);
    if (device == Device::cuda) {
      working.emplace("bf16 weights", DType::bf16, device, model.num_parameters());
      cast(working->all(), params.all());
    } else {
      round_to_bf16(params.all());
    }
  }

  void run(const std::vector<int32_t>& ids, const std::vector<int32_t>& targets, int64_t B, int64_t S) {
    const Device device = model.device();
    const int64_t T = B * S;
    typename M::Batch batch{B, S, Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T})};
    std::vector<int32_t> positions(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) positions[size_t(i)] = int32_t(i % S);
    copy(batch.input_ids, Tensor(const_cast<int32_t*>(ids.data()), DType::i32, Device::cpu, {T}));
    copy(batch.targets, Tensor(const_cast<int32_t*>(targets.data()), DType::i32, Device::cpu, {T}));
    copy(batch.positions, Tensor(positions.data(), DType::i32, Device::cpu, {T}));
    const auto w = model.bind(working ? *working : params);
    MicroBatch<M> mb;
    forward(mb, model, w, batch);
    const double loss_scale = 1.0 / double(T), aux_grad = 0.01;
    loss = mb.token_loss.value() * loss_scale;
    aux = mb.aux_loss.value();
    for (const auto& layer : mb.layers)
      routing.push_back(layer.attention.topk_index.view().data ? to_host(layer.attention.topk_index) : Buffer(DType::i32, Device::cpu, {0}));
    backward(mb, model, w, model.bind(grads), batch, loss_scale, aux_grad);
    if (device == Device::cuda) synchronize();
  }
};

// Each family's layer gradients, relative to each tensor's largest element.
// Each family's layer gradients by their Hugging Face names.
using Qwen = Qwen3MoeLayerWeights;
const std::pair<const char*, Tensor Qwen::*> kQwenLayer[] = {
    {"input_layernorm", &Qwen::input_norm}, {"q_proj", &Qwen::q_proj}, {"k_proj", &Qwen::k_proj}, {"v_proj", &Qwen::v_proj},
    {"o_proj", &Qwen::o_proj}, {"q_norm", &Qwen::q_norm}, {"k_norm", &Qwen::k_norm}, {"post_attention_layernorm", &Qwen::post_norm},
    {"router", &Qwen::router}, {"experts gate/up", &Qwen::experts_gate_up}, {"experts down", &Qwen::experts_down}};
using Gpt = GptOssLayerWeights;
const std::pair<const char*, Tensor Gpt::*> kGptOssLayer[] = {
    {"input_layernorm", &Gpt::input_norm}, {"q_proj", &Gpt::q_proj}, {"q_proj bias", &Gpt::q_bias}, {"k_proj", &Gpt::k_proj},
    {"k_proj bias", &Gpt::k_bias}, {"v_proj", &Gpt::v_proj}, {"v_proj bias", &Gpt::v_bias}, {"o_proj", &Gpt::o_proj},
    {"o_proj bias", &Gpt::o_bias}, {"sinks", &Gpt::sinks}, {"post_attention_layernorm", &Gpt::post_norm}, {"router", &Gpt::router},
    {"router bias", &Gpt::router_bias}, {"experts gate_up_proj", &Gpt::experts_gate_up},
    {"experts gate_up_proj_bias", &Gpt::experts_gate_up_bias}, {"experts down_proj", &Gpt::experts_down},
    {"experts down_proj_bias", &Gpt::experts_down_bias}};
using Deepseek = DeepseekV2LayerWeights;
const std::pair<const char*, Tensor Deepseek::*> kDeepseekLayer[] = {
    {"input_layernorm", &Deepseek::input_norm}, {"q_proj", &Deepseek::q_proj}, {"q_a_proj", &Deepseek::q_a_proj},
    {"q_a_layernorm", &Deepseek::q_a_norm}, {"q_b_proj", &Deepseek::q_b_proj}, {"kv_a_proj_with_mqa (latent)", &Deepseek::kv_a_latent},
    {"kv_a_proj_with_mqa (rope key)", &Deepseek::kv_a_rope}, {"kv_a_layernorm", &Deepseek::kv_a_norm}, {"kv_b_proj", &Deepseek::kv_b_proj},
    {"o_proj", &Deepseek::o_proj}, {"post_attention_layernorm", &Deepseek::post_norm}, {"mlp (dense or shared) gate/up", &Deepseek::mlp_gate_up},
    {"mlp (dense or shared) down", &Deepseek::mlp_down}, {"router", &Deepseek::router}, {"experts gate/up", &Deepseek::experts_gate_up},
    {"experts down", &Deepseek::experts_down}};
using Qwen35 = Qwen3_5MoeLayerWeights;
const std::pair<const char*, Tensor Qwen35::*> kQwen35Layer[] = {
    {"input_layernorm", &Qwen35::input_norm}, {"q_proj", &Qwen35::q_proj}, {"k_proj", &Qwen35::k_proj}, {"v_proj", &Qwen35::v_proj},
    {"o_proj", &Qwen35::o_proj}, {"q_norm", &Qwen35::q_norm}, {"k_norm", &Qwen35::k_norm}, {"in_proj_qkv", &Qwen35::in_proj_qkv},
    {"in_proj_z", &Qwen35::in_proj_z}, {"in_proj_b/a", &Qwen35::in_proj_ba}, {"conv1d", &Qwen35::conv}, {"out_proj", &Qwen35::out_proj},
    {"A_log", &Qwen35::A_log}, {"dt_bias", &Qwen35::dt_bias}, {"linear_attn norm", &Qwen35::delta_norm},
    {"post_attention_layernorm", &Qwen35::post_norm}, {"shared_expert gate/up", &Qwen35::shared_gate_up},
    {"shared_expert down", &Qwen35::shared_down}, {"shared_expert_gate", &Qwen35::shared_gate}, {"router", &Qwen35::router},
    {"experts gate/up", &Qwen35::experts_gate_up}, {"experts down", &Qwen35::experts_down}};
const auto& layer_tensors(const Qwen&) { return kQwenLayer; }
const auto& layer_tensors(const Qwen35&) { return kQwen35Layer; }
const auto& layer_tensors(const Deepseek&) { return kDeepseekLayer; }
const auto& layer_tensors(const Gpt&) { return kGptOssLayer; }

template <class M>
void compare_model(CheckReport& report, const std::string& name, const Json& config_json, int64_t B, int64_t S,
                   bool compare_gradients) {
  const typename M::Config config = M::Config::from_json(config_json, name);
  const int64_t T = B * S;
  std::vector<int32_t> ids(static_cast<size_t>(T)), targets(static_cast<size_t>(T));
  Philox rng = philox_for(17, "check_model");
  for (int64_t i = 0; i < T; ++i) {
    ids[size_t(i)] = int32_t(rng.uniform(uint64_t(i)) * float(config.vocab_size));
    targets[size_t(i)] = int32_t(rng.uniform(uint64_t(i), 1) * float(config.vocab_size));
  }
  ModelSide<M> cpu(config, Device::cpu), gpu(config, Device::cuda);
  cpu.run(ids, targets, B, S);
  gpu.run(ids, targets, B, S);
  int64_t flips = 0, choices = 0;
  for (size_t l = 0; l < cpu.routing.size(); ++l)  // a dense layer's are empty
    for (int64_t i = 0; i < cpu.routing[l].numel(); ++i, ++choices)
      flips += cpu.routing[l].template ptr<int32_t>()[i] != gpu.routing[l].template ptr<int32_t>()[i];
  std::printf("%s: %lld of %lld top-k choices differ between CPU (f32) and GPU (bf16)\n", name.c_str(), (long long)flips,
              (long long)choices);
  const double loss_error = std::abs(gpu.loss - cpu.loss) / std::abs(cpu.loss);
  report.add({name + ": loss", loss_error, 1e-2, std::isfinite(gpu.loss) && loss_error <= 1e-2});
  const double aux_error = std::abs(gpu.aux - cpu.aux) / std::abs(cpu.aux);
  report.add({name + ": load-balance loss", aux_error, 2e-2, std::isfinite(gpu.aux) && aux_error <= 2e-2});
  if (!compare_gradients) return;

  // Gradients: f32 on both sides, accumulated from bf16 activations on the GPU. The bound is relative
  // to the largest gradient element of each tensor.
  const double bound = 5e-2;
  const auto gg = gpu.model.bind(gpu.grads), cg = cpu.model.bind(cpu.grads);
  report.compare(name + ": d embed_tokens", gg.embed, cg.embed, bound);
  report.compare(name + ": d lm_head", gg.lm_head, cg.lm_head, bound);
  report.compare(name + ": d final norm", gg.final_norm, cg.final_norm, bound);
  for (size_t l = 0; l < gg.layers.size(); ++l)
    for (const auto& [tensor, member] : layer_tensors(gg.layers[l]))
      if ((gg.layers[l].*member).data != nullptr)  // a DeepSeek layer has one query form, a dense one no router
        report.compare(fmt::format("{}: layer {} d {}", name, l, tensor), gg.layers[l].*member, cg.layers[l].*member, bound);
}

// GPT-OSS's tiny model: head_dim 64 (the GPU kernels' size), a sliding layer whose window (16) is
// shorter than the 37-token sequences and a full one, YaRN. The clamp is a discontinuity like top-k
// routing: an element within bf16 rounding of the limit passes on one side and not the other (the
// first H200 run: limit 1.5 at initializer_range 0.2 put 23% into gate_up's gradient). So the
// gradient rows take GPT-OSS's limit 7 at a scale where no element comes near it, and the loss rows
// a limit of 1.5 that clamps about a third of the gates; the op rows test the clamps at their bounds.
Json tiny_gpt_oss(int64_t top_k, double limit, double init) {
  return {{"model_type", "gpt_oss"}, {"vocab_size", 300}, {"hidden_size", 64}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"head_dim", 64}, {"num_local_experts", 8}, {"num_experts_per_tok", top_k},
          {"intermediate_size", 40}, {"sliding_window", 16}, {"layer_types", {"sliding_attention", "full_attention"}},
          {"swiglu_limit", limit}, {"initializer_range", init},
          {"rope_parameters",
           {{"rope_type", "yarn"}, {"rope_theta", 150000.0}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
            {"original_max_position_embeddings", 4096}}}};
}

// DeepSeek-V2's tiny model: MLA at V2's head dims (q/k 128 + 64, v 128: cuDNN's kernels), q-LoRA, a
// dense first layer, shared experts, YaRN with DeepSeek's mscale; routed rows group-limited with a
// routed scaling factor, gradient rows K = E (every group kept).
Json tiny_deepseek_v2(int64_t top_k, int64_t top_groups) {
  return {{"model_type", "deepseek_v2"}, {"vocab_size", 300}, {"hidden_size", 64}, {"num_hidden_layers", 2}, {"num_attention_heads", 2},
          {"num_key_value_heads", 2}, {"q_lora_rank", 48}, {"kv_lora_rank", 32}, {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64},
          {"v_head_dim", 128}, {"intermediate_size", 96}, {"moe_intermediate_size", 40}, {"n_routed_experts", 8}, {"n_shared_experts", 1},
          {"num_experts_per_tok", top_k}, {"first_k_dense_replace", 1}, {"topk_method", "group_limited_greedy"}, {"n_group", 4},
          {"topk_group", top_groups}, {"routed_scaling_factor", 2.0}, {"initializer_range", 0.1},
          {"rope_scaling", {{"type", "yarn"}, {"factor", 40.0}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}, {"original_max_position_embeddings", 4096}}},
          {"max_position_embeddings", 163840}};
}

// Qwen3.5-MoE's tiny model: three Gated DeltaNet layers at the model's head dims (128, value heads
// twice the key heads) and one gated attention layer (head dim 128: the own kernels serve it), 64
// positions a chunk so S 150 crosses two chunk boundaries.
Json tiny_qwen3_5(int64_t top_k) {
  return {{"model_type", "qwen3_5_moe_text"}, {"vocab_size", 300}, {"hidden_size", 64}, {"num_hidden_layers", 4}, {"num_attention_heads", 2},
          {"num_key_value_heads", 1}, {"head_dim", 128}, {"linear_num_key_heads", 1}, {"linear_num_value_heads", 2},
          {"linear_key_head_dim", 128}, {"linear_value_head_dim", 128}, {"num_experts", 8}, {"num_experts_per_tok", top_k},
          {"moe_intermediate_size", 40}, {"shared_expert_intermediate_size", 48}, {"initializer_range", 0.1},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}}}};
}

}  // namespace

void check_model(CheckReport& report) {
  Json tiny = {{"model_type", "qwen3_moe"}, {"vocab_size", 300}, {"hidden_size", 64}, {"num_hidden_layers", 2},
               {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 64}, {"num_experts", 8},
               {"num_experts_per_tok", 2}, {"moe_intermediate_size", 40}, {"norm_topk_prob", true}, {"initializer_range", 0.2}};
  compare_model<Qwen3Moe>(report, "tiny model, top-2 of 8", tiny, 2, 37, false);
  tiny["num_experts_per_tok"] = 8;
  compare_model<Qwen3Moe>(report, "tiny model, K = E = 8", tiny, 2, 37, true);
  compare_model<GptOss>(report, "tiny gpt_oss, top-2 of 8, limit 1.5", tiny_gpt_oss(2, 1.5, 0.2), 2, 37, false);
  compare_model<GptOss>(report, "tiny gpt_oss, K = E = 8", tiny_gpt_oss(8, 7.0, 0.1), 2, 37, true);
  compare_model<DeepseekV2>(report, "tiny deepseek_v2, top-3 of 8 in 2 of 4 groups", tiny_deepseek_v2(3, 2), 2, 37, false);
  compare_model<DeepseekV2>(report, "tiny deepseek_v2, K = E = 8", tiny_deepseek_v2(8, 4), 2, 37, true);
  compare_model<Qwen3_5Moe>(report, "tiny qwen3_5_moe, top-2 of 8", tiny_qwen3_5(2), 2, 150, false);
  compare_model<Qwen3_5Moe>(report, "tiny qwen3_5_moe, K = E = 8", tiny_qwen3_5(8), 2, 150, true);
  {
    // train.fp8 on both sides (the CPU multiplies the dequantized E4M3 operands): each family's
    // choice of its experts' quantized weights, as stored or transposed, against the reference.
    struct ExpertFp8On {
      ExpertFp8On() { set_expert_fp8(true); }
      ~ExpertFp8On() { set_expert_fp8(false); }
    } fp8;
    compare_model<Qwen3Moe>(report, "tiny model, K = E = 8, fp8 experts", tiny, 2, 37, false);
    compare_model<GptOss>(report, "tiny gpt_oss, K = E = 8, fp8 experts", tiny_gpt_oss(8, 7.0, 0.1), 2, 37, false);
    compare_model<DeepseekV2>(report, "tiny deepseek_v2, K = E = 8, fp8 experts", tiny_deepseek_v2(8, 4), 2, 37, false);
  }
  // One layer of the bench shape (GPU.md: Qwen3-30B-A3B's layer). The vocabulary and sequence are
  // cut so the single-threaded CPU reference finishes in seconds.
  Json bench_layer = tiny;
  bench_layer.update({{"vocab_size", 4096}, {"hidden_size", 2048}, {"num_hidden_layers", 1}, {"num_attention_heads", 32},
                      {"num_key_value_heads", 4}, {"head_dim", 128}, {"num_experts", 128}, {"num_experts_per_tok", 8},
                      {"moe_intermediate_size", 768}, {"rope_theta", 1000000.0}, {"initializer_range", 0.05}});
  compare_model<Qwen3Moe>(report, "bench layer, top-8 of 128", bench_layer, 1, 512, false);
  bench_layer["num_experts_per_tok"] = 128;
  compare_model<Qwen3Moe>(report, "bench layer, K = E = 128", bench_layer, 1, 64, true);
}

}  // namespace marrow
