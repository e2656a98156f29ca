#include "models/qwen3_moe.h"

#include <omp.h>

#include "core/weights_generation.h"
#include "engine/step.h"
#include "fp8_model_check.h"
#include "gradcheck.h"
#include "ops/cross_entropy.h"
#include "ops/grad_norm.h"
#include "ops/grouped_linear_fp8.h"
#include "parallel/sharded_params.h"

namespace marrow {
namespace {

Json tiny_config_json() {
  return Json{{"model_type", "qwen3_moe"},
              {"architectures", {"Qwen3MoeForCausalLM"}},
              {"vocab_size", 40},
              {"hidden_size", 16},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 8},
              {"num_experts", 8},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 12},
              {"norm_topk_prob", true},
              {"rope_theta", 10000.0},
              {"rms_norm_eps", 1e-6}};
}

std::string config_error(Json json) {
  try {
    Qwen3MoeConfig::from_json(json, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Qwen3MoeConfig, ReadsHuggingFaceFields) {
  Json j = tiny_config_json();
  j.erase("head_dim");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_theta", 5e5}, {"rope_type", "default"}};
  Qwen3MoeConfig c = Qwen3MoeConfig::from_json(j, "config.json");
  EXPECT_EQ(c.head_dim, 4);  // hidden_size / num_attention_heads when head_dim is absent
  EXPECT_EQ(c.rope_theta, 5e5);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_TRUE(c.norm_topk_prob);
}

TEST(Qwen3MoeConfig, BadFieldsGiveOneSentence) {
  Json j = tiny_config_json();
  j.erase("num_experts");
  EXPECT_EQ(config_error(j), "config.json: required key 'num_local_experts' is missing");
  j = tiny_config_json();
  j.erase("hidden_size");
  EXPECT_EQ(config_error(j), "config.json: required key 'hidden_size' is missing");
  j = tiny_config_json();
  j["num_attention_heads"] = -4;
  EXPECT_EQ(config_error(j), "config.json: key 'num_attention_heads' must be a positive integer, got -4");
  j = tiny_config_json();
  j["vocab_size"] = "big";
  EXPECT_EQ(config_error(j), "config.json: key 'vocab_size' must be a positive integer, got \"big\"");
  j = tiny_config_json();
  j["model_type"] = "llama";
  EXPECT_EQ(config_error(j), "config.json: model_type is 'llama' but this model is qwen3_moe");
  j = tiny_config_json();
  j["num_key_value_heads"] = 3;
  EXPECT_EQ(config_error(j), "config.json: num_attention_heads (4) must be a multiple of num_key_value_heads (3)");
  j = tiny_config_json();
  j["tie_word_embeddings"] = true;
  EXPECT_EQ(config_error(j), "config.json: tie_word_embeddings = true is not supported");
  j = tiny_config_json();
  j["num_experts_per_tok"] = 9;
  EXPECT_EQ(config_error(j), "config.json: num_experts_per_tok (9) exceeds num_experts (8)");
  // RoPE as transformers reads it (models/common.h's read_rope): the older `type` key is a rope_type,
  // and rope_scaling wins over rope_parameters.
  j = tiny_config_json();
  j["rope_parameters"] = {{"type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e4}};
  EXPECT_EQ(config_error(j), "config.json: rope_parameters: rope_type 'linear' is not supported (only default)");
  j = tiny_config_json();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e4}};
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  EXPECT_EQ(config_error(j), "config.json: rope_scaling: rope_type 'linear' is not supported (only default)");
  j["rope_scaling"] = {{"rope_type", "default"}};
  j["rope_theta"] = 2e4;
  EXPECT_EQ(Qwen3MoeConfig::from_json(j, "config.json").rope_theta, 2e4);  // the top level's, as rope_scaling has none
}

TEST(Qwen3MoeConfig, MissingFileIsNamed) {
  try {
    Qwen3MoeConfig::load("/nonexistent/config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "cannot open /nonexistent/config.json: no such file or it is not readable");
  }
}

TEST(Qwen3Moe, InitialisationIsAPureFunctionOfSeedAndName) {
  Qwen3Moe m(Qwen3MoeConfig::from_json(tiny_config_json(), "tiny"), DType::f32, Device::cpu);
  Arena a("parameters", DType::f32, Device::cpu, m.num_parameters()), b("parameters", DType::f32, Device::cpu, m.num_parameters());
  m.initialize(a, 7);
  m.initialize(b, 7);
  EXPECT_EQ(std::memcmp(a.all().data, b.all().data, a.bytes()), 0);
  // Two experts of one layer are not copies of each other; norms start at one.
  const auto w = m.bind(a);
  const Tensor gate = w.layers[0].experts_gate_up;
  const int64_t per_expert = gate.numel() / gate.size(0);
  EXPECT_NE(gate.ptr<float>()[0], gate.ptr<float>()[per_expert]);
  EXPECT_EQ(w.final_norm.ptr<float>()[0], 1.0f);
  // The tensor named model.layers.1.mlp.experts.3.up_proj.weight starts where the spec table says.
  for (const TensorSpec& s : m.specs())
    if (s.name == "model.layers.1.mlp.experts.3.up_proj.weight") {
      const float* fused = w.layers[1].experts_gate_up.ptr<float>() + 3 * per_expert + per_expert / 2;
      EXPECT_EQ(fused, a.slice(s.offset, {s.numel}).ptr<float>());
    }
}

struct TinyRun {
  Qwen3Moe model;
  Arena params, grads;
  Qwen3MoeBatch batch;
  double loss_scale, aux_grad;

  TinyRun(DType dtype, int64_t B, int64_t S, const Json& json)
      : model(Qwen3MoeConfig::from_json(json, "tiny"), dtype, Device::cpu),
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
    aux_grad = 0.05;
    // A larger init than Hugging Face's 0.02 makes routing and attention far from uniform, so the
    // check exercises every path with non-trivial values.
    model.initialize(params, 11);
    for (const TensorSpec& s : model.specs()) {
      Tensor t = params.slice(s.offset, {s.numel});
      for (int64_t i = 0; i < s.numel; ++i) testing::set_element(t, i, testing::element(t, i) * (s.is_norm ? 1.0 : 15.0));
    }
  }

  double loss_and_gradients(bool gathers_expert_inputs = false) {
    grads.fill_zero();
    MicroBatch<Qwen3Moe> mb;
    mb.gathers_expert_inputs = gathers_expert_inputs;
    const auto w = model.bind(params);
    forward(mb, model, w, batch);
    const double loss = loss_scale * mb.token_loss.value() + aux_grad * mb.aux_loss.value();
    backward(mb, model, w, model.bind(grads), batch, loss_scale, aux_grad);
    return loss;
  }
};

TEST(Qwen3Moe, WholeModelGradientsMatchFiniteDifferences) {
  for (int64_t S : {1, 6}) {
    TinyRun run(DType::f64, 2, S, tiny_config_json());
    run.loss_and_gradients();
    Arena analytic("analytic", DType::f64, Device::cpu, run.model.num_parameters());
    std::memcpy(analytic.all().data, run.grads.all().data, analytic.bytes());
    for (const TensorSpec& s : run.model.specs()) {
      testing::expect_gradient(s.name + " (S=" + std::to_string(S) + ")", run.params.slice(s.offset, {s.numel}),
                               analytic.slice(s.offset, {s.numel}), [&] { return run.loss_and_gradients(); }, 1e-5, 4);
    }
  }
}

// The bench model's logits (Qwen3's vocabulary, bf16): up to 8 GiB (28,268 tokens) they stay whole;
// longer sequences take the fewest even chunks of at most 2 GiB in whole multiples of 64 rows (each
// chunk costs the LM head's f32 gradient one more read and write).
TEST(Qwen3Moe, LogitsComeInTheFewestEvenChunksOfAtMostTwoGiB) {
  const Qwen3Moe bench(Qwen3MoeConfig::load(MARROW_SOURCE_DIR "/configs/bench-moe.json"), DType::bf16, Device::cuda);
  const int64_t row_bytes = 151936 * 2;
  EXPECT_EQ(bench.logits_chunk(4096), 4096);
  EXPECT_EQ(bench.logits_chunk(16384), 16384);
  EXPECT_EQ(bench.logits_chunk(28268), 28268);
  EXPECT_EQ(bench.logits_chunk(32768), 6592);  // 9.3 GiB: five chunks of 6,553.6 rows, rounded up
  const int64_t most = 7040;                   // 2 GiB of rows, a multiple of 64
  for (int64_t tokens : {28269, 32768, 45000, 131072}) {
    const int64_t chunk = bench.logits_chunk(tokens), chunks = (tokens + chunk - 1) / chunk;
    EXPECT_LE(chunk * row_bytes, kLogitsChunkBytes) << tokens;
    EXPECT_EQ(chunk % 64, 0) << tokens;
    EXPECT_EQ(chunks, (tokens + most - 1) / most) << tokens;
    EXPECT_LT(chunk * chunks - tokens, 64 * chunks) << tokens;  // even: no chunk more than 64 rows short
  }
}

// Logits computed in chunks of tokens (long sequences), the backward computing each chunk again,
// give the loss and gradients of whole logits: the same sums, the LM head's gradient added up over
// the chunks in another order.
TEST(Qwen3Moe, ChunkedLogitsGiveTheLossAndGradientsOfWholeOnes) {
  TinyRun whole(DType::f64, 2, 6, tiny_config_json()), chunked(DType::f64, 2, 6, tiny_config_json());
  chunked.model.set_logits_chunk(5);
  EXPECT_EQ(chunked.model.logits_chunk(12), 5);  // 12 tokens: chunks of 5, 5 and 2
  EXPECT_EQ(whole.model.logits_chunk(12), 12);
  EXPECT_NEAR(chunked.loss_and_gradients(), whole.loss_and_gradients(), 1e-12);
  const double* a = chunked.grads.all().ptr<double>();
  const double* b = whole.grads.all().ptr<double>();
  double largest = 0, worst = 0;
  for (int64_t i = 0; i < whole.model.num_parameters(); ++i) {
    largest = std::max(largest, std::abs(b[i]));
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  EXPECT_GT(largest, 0);
  EXPECT_LE(worst, 1e-12 * largest);
}

// x_perm dropped after the experts forward and gathered again from h2 for the backward
// (train.expert_inputs = gather) gives the same bits as keeping it: the same gather of the same rows.
TEST(Qwen3Moe, ExpertRowsGatheredAgainGiveTheSameBits) {
  TinyRun kept(DType::f32, 2, 8, tiny_config_json()), again(DType::f32, 2, 8, tiny_config_json());
  for (const bool gather : {false, true}) {  // the forward holds x_perm only when it is not gathered again
    MicroBatch<Qwen3Moe> mb;
    mb.gathers_expert_inputs = gather;
    forward(mb, kept.model, kept.model.bind(kept.params), kept.batch);
    for (const auto& layer : mb.layers) EXPECT_EQ(layer.experts.x_perm.view().data == nullptr, gather);
  }
  const double kept_loss = kept.loss_and_gradients(false);
  const double again_loss = again.loss_and_gradients(true);
  EXPECT_EQ(kept_loss, again_loss);
  EXPECT_EQ(std::memcmp(kept.grads.all().data, again.grads.all().data, kept.grads.bytes()), 0);
}

// train.fp8 (tests/fp8_model_check.h), the forward on the expert weights' quantization as stored.
TEST(Qwen3Moe, Fp8ExpertGemmsStayCloseAndFollowTheWeights) {
  TinyRun plain(DType::f32, 2, 8, tiny_config_json()), fp8(DType::f32, 2, 8, tiny_config_json()), again(DType::f32, 2, 8, tiny_config_json());
  testing::expect_fp8_experts_close<TinyRun>(plain, fp8, again, [](TinyRun& r) { return r.model.bind(r.params).layers[1].experts_gate_up; });
}

TEST(Qwen3Moe, SameInputsGiveBitwiseSameLossAndGradients) {
  TinyRun a(DType::f32, 2, 8, tiny_config_json()), b(DType::f32, 2, 8, tiny_config_json());
  EXPECT_EQ(a.loss_and_gradients(), b.loss_and_gradients());
  EXPECT_EQ(std::memcmp(a.grads.all().data, b.grads.all().data, a.grads.bytes()), 0);
}

// Two micro-batches where the first writes the expert and LM-head gradients (the trainer's way: it
// zeroes only the other gradients) give bitwise what zeroing everything and accumulating both gives;
// also with the logits in chunks, whose first alone writes the head's gradient, and with those
// chunks' backward run in the forward as training runs it.
TEST(Qwen3Moe, FirstMicroBatchWritingExpertGradientsEqualsZeroingThem) {
  for (const int64_t chunk : {0, 5}) {
    TinyRun run(DType::f32, 2, 8, tiny_config_json());
    run.model.set_logits_chunk(chunk);
    const auto w = run.model.bind(run.params);
    const auto g = run.model.bind(run.grads);
    // epilog_in_forward: as training runs it, the epilog's backward in the forward where the logits
    // come in chunks (the LM head's gradient and dh without computing a chunk twice).
    auto two_micro_batches = [&](bool first_writes, bool epilog_in_forward) {
      for (int micro = 0; micro < 2; ++micro) {
        MicroBatch<Qwen3Moe> mb;
        if (epilog_in_forward) mb.epilog_gradients = {&g, run.loss_scale, first_writes && micro == 0};
        forward(mb, run.model, w, run.batch);
        backward(mb, run.model, w, g, run.batch, run.loss_scale, run.aux_grad, first_writes && micro == 0);
      }
    };
    run.grads.fill_zero();
    two_micro_batches(false, false);
    Buffer expected = to_host(run.grads.all());
    for (const bool epilog_in_forward : {false, true}) {
      for (const TensorSpec& s : run.model.specs()) {
        Tensor t = run.grads.slice(s.offset, {s.numel});
        for (int64_t i = 0; i < s.numel; ++i) testing::set_element(t, i, s.first_backward_writes ? 1e30 : 0.0);
      }
      two_micro_batches(true, epilog_in_forward);
      EXPECT_EQ(std::memcmp(expected.view().data, run.grads.all().data, run.grads.bytes()), 0)
          << "logits chunk " << chunk << (epilog_in_forward ? ", the epilog's backward in the forward" : "");
    }
    int64_t written = 0;
    for (const TensorSpec& s : run.model.specs()) written += s.first_backward_writes ? s.numel : 0;
    EXPECT_GT(written, run.model.num_parameters() / 2);  // the experts are most of the model
  }
}

// Micro-batches paired for their expert weight gradients as the trainer pairs them (0 with 1, the
// earlier one's inputs held; 2 alone) give the bits of three plain backwards, each micro-batch its
// own tokens, the expert gradients garbage before the first (it writes them).
TEST(Qwen3Moe, PairedExpertWeightGradientsGiveTheSameBits) {
  TinyRun run(DType::f32, 2, 8, tiny_config_json());
  const auto w = run.model.bind(run.params);
  const auto g = run.model.bind(run.grads);
  const int64_t V = run.model.config().vocab_size, n = run.batch.batch * run.batch.seq;
  std::vector<Qwen3MoeBatch> batches;
  for (int32_t micro = 0; micro < 3; ++micro) {
    Qwen3MoeBatch b{run.batch.batch, run.batch.seq, Buffer(DType::i32, Device::cpu, {n}), Buffer(DType::i32, Device::cpu, {n}),
                    Buffer(DType::i32, Device::cpu, {n})};
    for (int64_t i = 0; i < n; ++i) {
      b.input_ids.ptr<int32_t>()[i] = int32_t((run.batch.input_ids.ptr<int32_t>()[i] + 7 * micro) % V);
      b.targets.ptr<int32_t>()[i] = run.batch.targets.ptr<int32_t>()[i];
      b.positions.ptr<int32_t>()[i] = run.batch.positions.ptr<int32_t>()[i];
    }
    batches.push_back(std::move(b));
  }
  auto three_micro_batches = [&](bool paired) {
    for (const TensorSpec& s : run.model.specs()) {
      Tensor t = run.grads.slice(s.offset, {s.numel});
      for (int64_t i = 0; i < s.numel; ++i) testing::set_element(t, i, s.first_backward_writes ? 1e30 : 0.0);
    }
    std::vector<MicroBatch<Qwen3Moe>::DeferredExperts> earlier;
    for (int micro = 0; micro < 3; ++micro) {
      MicroBatch<Qwen3Moe> mb;
      forward(mb, run.model, w, batches[size_t(micro)]);
      BackwardPass<Qwen3Moe>::Options options{run.loss_scale, run.aux_grad, micro == 0, paired && micro == 0};
      options.first_of_step = micro == 0;
      if (paired && micro == 1) {
        options.earlier = &earlier;
        options.earlier_overwrites = true;
      }
      backward(mb, run.model, w, g, batches[size_t(micro)], options);
      if (paired && micro == 0) {
        EXPECT_EQ(int64_t(mb.deferred.size()), run.model.num_layers());
        earlier = std::move(mb.deferred);
      }
      EXPECT_TRUE(mb.deferred.empty());
    }
    EXPECT_TRUE(earlier.empty());
    return to_host(run.grads.all());
  };
  const Buffer plain = three_micro_batches(false), paired = three_micro_batches(true);
  EXPECT_EQ(std::memcmp(plain.view().data, paired.view().data, plain.view().bytes()), 0);
}

// The known-zero flags, kept from step to step as the trainer keeps them: each step's gradients are
// the bits of the same steps without them, though most experts of a layer get no rows (two tokens,
// top 2 of 8), whose zeros the flagged steps write only once.
TEST(Qwen3Moe, KnownZeroExpertGradientsKeepTheBits) {
  TinyRun run(DType::f32, 1, 2, tiny_config_json());
  const auto w = run.model.bind(run.params);
  const auto g = run.model.bind(run.grads);
  const int64_t V = run.model.config().vocab_size, n = run.batch.batch * run.batch.seq;
  auto steps = [&](bool flagged) {
    std::vector<Buffer> known, after;
    std::vector<Tensor> views;
    for (const auto& layer : g.layers) {
      known.push_back(Buffer::zeros(DType::i32, Device::cpu, {run.model.expert_known_zero_count(layer)}));
      views.push_back(known.back());
    }
    auto fill = [&](bool first_writes, double value) {
      for (const TensorSpec& s : run.model.specs()) {
        const Tensor t = run.grads.slice(s.offset, {s.numel});
        if (s.first_backward_writes == first_writes)
          for (int64_t i = 0; i < s.numel; ++i) testing::set_element(t, i, value);
      }
    };
    fill(true, 1e30);
    for (int32_t step = 0; step < 3; ++step) {
      fill(false, 0.0);
      for (int64_t i = 0; i < n; ++i)
        run.batch.input_ids.ptr<int32_t>()[i] = int32_t((run.batch.input_ids.ptr<int32_t>()[i] + 5) % V);
      MicroBatch<Qwen3Moe> mb;
      forward(mb, run.model, w, run.batch);
      BackwardPass<Qwen3Moe>::Options options{run.loss_scale, run.aux_grad, true, false};
      options.first_of_step = true;
      if (flagged) options.expert_known_zero = views;
      backward(mb, run.model, w, g, run.batch, options);
      after.push_back(to_host(run.grads.all()));
    }
    int64_t set = 0;
    for (const Buffer& k : known) set += std::count(k.ptr<int32_t>(), k.ptr<int32_t>() + k.numel(), 1);
    EXPECT_EQ(set > 0, flagged);
    return after;
  };
  const std::vector<int32_t> ids(run.batch.input_ids.ptr<int32_t>(), run.batch.input_ids.ptr<int32_t>() + n);
  const std::vector<Buffer> plain = steps(false);
  std::copy(ids.begin(), ids.end(), run.batch.input_ids.ptr<int32_t>());
  const std::vector<Buffer> flagged = steps(true);
  for (size_t step = 0; step < plain.size(); ++step)
    EXPECT_EQ(std::memcmp(plain[step].view().data, flagged[step].view().data, plain[step].view().bytes()), 0) << step;
}

// The CPU references split loops over OpenMP threads only where each output keeps its sequential
// order of additions: one thread and three give the same bits. The shapes are large enough for
// every op's parallel threshold (ops/common.h).
TEST(Qwen3Moe, ThreadCountDoesNotChangeTheBits) {
  Json json = tiny_config_json();
  json["hidden_size"] = 64;
  json["vocab_size"] = 512;
  json["head_dim"] = 16;
  json["moe_intermediate_size"] = 64;
  const int saved = omp_get_max_threads();
  auto run_with = [&](int threads) {
    omp_set_num_threads(threads);
    EXPECT_EQ(omp_get_max_threads(), threads);
    TinyRun run(DType::f32, 4, 128, json);
    const double loss = run.loss_and_gradients();
    return std::pair{loss, to_host(run.grads.all())};
  };
  const auto [loss1, grads1] = run_with(1);
  const auto [loss3, grads3] = run_with(3);
  omp_set_num_threads(saved);
  EXPECT_EQ(loss1, loss3);
  EXPECT_EQ(std::memcmp(grads1.view().data, grads3.view().data, grads1.view().bytes()), 0);
}

// Every backward of a step (the first overwriting) updates each layer's sums of squares of its
// expert gradients: after the last they add up to what reading those gradients gives (also for
// experts the last micro-batch did not route to), and the gradient norm built from them (the rest
// of the arena read) is the norm of the whole arena, to the rounding of a different order of sums.
TEST(Qwen3Moe, ExpertSquaresOfTheLastBackwardGiveTheGradientNorm) {
  TinyRun run(DType::f32, 2, 8, tiny_config_json());
  const Mesh mesh = Mesh::create(MeshShape{}, Device::cpu);
  const int64_t L = run.model.num_layers();
  ShardedParameters state(run.model.specs(), L, std::vector<int64_t>(size_t(L + 2), 0), mesh, false, false, false, Device::cpu,
                          DType::f32);
  EXPECT_TRUE(state.expert_grads_final());
  copy(state.params().all(), run.params.all());
  const auto w = run.model.bind(state.weights());
  const auto g = run.model.bind(state.gradients());
  std::vector<Buffer> squares;
  std::vector<Tensor> views;
  for (const auto& layer : g.layers) {
    squares.emplace_back(DType::f64, Device::cpu, std::initializer_list<int64_t>{run.model.expert_squares_count(layer)});
    views.push_back(squares.back());
  }
  state.start_step();
  for (int micro = 0; micro < 2; ++micro) {
    MicroBatch<Qwen3Moe> mb;
    forward(mb, run.model, w, run.batch);
    backward(mb, run.model, w, g, run.batch, run.loss_scale, run.aux_grad, micro == 0, {}, nullptr, views);
  }
  for (int64_t l = 0; l < L; ++l) {
    const double read = std::pow(l2_norm(g.layers[size_t(l)].experts_down), 2) + std::pow(l2_norm(g.layers[size_t(l)].experts_gate_up), 2);
    double written = 0;
    for (int64_t i = 0; i < squares[size_t(l)].numel(); ++i) written += squares[size_t(l)].ptr<double>()[i];
    EXPECT_GT(read, 0);
    EXPECT_NEAR(written, read, 1e-13 * read) << "layer " << l;
  }
  const double whole = state.gradient_norm(), fused = state.gradient_norm(views);
  EXPECT_EQ(whole, l2_norm(state.grads().all()));
  EXPECT_NEAR(fused, whole, 1e-13 * whole);
  std::vector<Tensor> first_layer_only{views[0]};
  EXPECT_NEAR(state.gradient_norm(first_layer_only), whole, 1e-13 * whole);
}

// start_step zeroes every gradient the backward accumulates into (adjacent ones in one fill) and
// leaves those the first backward overwrites.
TEST(Qwen3Moe, StartStepZeroesTheAccumulatedGradientsOnly) {
  TinyRun run(DType::f32, 1, 2, tiny_config_json());
  const Mesh mesh = Mesh::create(MeshShape{}, Device::cpu);
  const int64_t L = run.model.num_layers();
  ShardedParameters state(run.model.specs(), L, std::vector<int64_t>(size_t(L + 2), 0), mesh, false, false, false, Device::cpu,
                          DType::f32);
  const Tensor all = state.grads().all();
  std::fill(all.ptr<float>(), all.ptr<float>() + all.numel(), 7.0f);
  state.start_step();
  int64_t zeroed = 0, kept = 0;
  for (const TensorSpec& s : run.model.specs()) {
    const Tensor g = state.gradients().slice(s.offset, {s.numel});
    const float want = s.first_backward_writes ? 7.0f : 0.0f;
    int64_t wrong = 0;
    for (int64_t i = 0; i < s.numel; ++i) wrong += g.ptr<float>()[i] != want;
    EXPECT_EQ(wrong, 0) << s.name;
    (s.first_backward_writes ? kept : zeroed) += 1;
  }
  EXPECT_GT(zeroed, 1);
  EXPECT_GT(kept, 0);
}

// AdamW given the known-zero flags: a flagged expert's gradient is taken as zero without being read
// (garbage planted there changes nothing), and the unit's other parts update as without flags.
TEST(Qwen3Moe, KnownZeroGradientsGiveTheOptimizerTheSameBits) {
  TinyRun run(DType::f32, 1, 2, tiny_config_json());
  const Mesh mesh = Mesh::create(MeshShape{}, Device::cpu);
  const int64_t L = run.model.num_layers();
  std::vector<Buffer> params;
  for (const bool flagged : {false, true}) {
    ShardedParameters state(run.model.specs(), L, std::vector<int64_t>(size_t(L + 2), 0), mesh, false, false, false, Device::cpu,
                            DType::f32);
    copy(state.params().all(), run.params.all());
    const auto w = run.model.bind(state.weights());
    const auto g = run.model.bind(state.gradients());
    std::vector<Buffer> known;
    std::vector<Tensor> views;
    std::vector<ShardedParameters::KnownZeroGrads> parts;
    for (const auto& layer : g.layers) {
      known.push_back(Buffer::zeros(DType::i32, Device::cpu, {run.model.expert_known_zero_count(layer)}));
      views.push_back(known.back());
    }
    state.start_step();
    MicroBatch<Qwen3Moe> mb;
    forward(mb, run.model, w, run.batch);
    BackwardPass<Qwen3Moe>::Options options{run.loss_scale, run.aux_grad, true, false};
    options.first_of_step = true;
    options.expert_known_zero = views;
    backward(mb, run.model, w, g, run.batch, options);
    int64_t planted = 0;
    for (size_t l = 0; l < g.layers.size(); ++l)
      for (const auto& [grad, flags] : run.model.expert_known_zero_parts(g.layers[l], views[l])) {
        parts.push_back({grad, flags});
        const int64_t per_expert = grad.numel() / flags.numel();
        for (int64_t e = 0; e < flags.numel(); ++e)
          if (flagged && flags.ptr<int32_t>()[e]) {
            testing::set_element(grad.reshape({grad.numel()}), e * per_expert, 1e3);
            ++planted;
          }
      }
    EXPECT_EQ(planted > 0, flagged);
    AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 1};
    if (flagged) state.optimizer_step(hyper, parts);
    else state.optimizer_step(hyper);
    params.push_back(to_host(state.params().all()));
  }
  EXPECT_EQ(std::memcmp(params[0].view().data, params[1].view().data, params[0].view().bytes()), 0);
}

// The embedding gradient's row flags through ShardedParameters, as the trainer runs them: each step
// restarts the gradient by rows (start_step), the backward clears the flags of its tokens' rows, the
// norm and AdamW skip the flagged ones. Three steps over shifting tokens give the gradients, norms
// and weights of the same steps without flags, bit for bit; in the last, NaN planted in the flagged
// rows after the backward reaches neither the norm nor AdamW.
TEST(Qwen3Moe, KnownZeroEmbeddingRowsKeepTheBits) {
  TinyRun run(DType::f32, 1, 4, tiny_config_json());
  const Mesh mesh = Mesh::create(MeshShape{}, Device::cpu);
  const int64_t L = run.model.num_layers(), V = run.model.config().vocab_size, n = run.batch.batch * run.batch.seq;
  const std::vector<int32_t> ids(run.batch.input_ids.ptr<int32_t>(), run.batch.input_ids.ptr<int32_t>() + n);
  std::vector<std::vector<Buffer>> grads(2);
  std::vector<std::vector<double>> norms(2);
  std::vector<Buffer> params;
  for (const bool flagged : {false, true}) {
    std::copy(ids.begin(), ids.end(), run.batch.input_ids.ptr<int32_t>());
    ShardedParameters state(run.model.specs(), L, std::vector<int64_t>(size_t(L + 2), 0), mesh, false, false, false, Device::cpu,
                            DType::f32);
    ASSERT_TRUE(state.grads_final(-1));
    copy(state.params().all(), run.params.all());
    const auto w = run.model.bind(state.weights());
    const auto g = run.model.bind(state.gradients());
    Buffer flags = Buffer::zeros(DType::i32, Device::cpu, {run.model.prolog_known_zero_count()});
    std::vector<ShardedParameters::KnownZeroGrads> known;
    if (flagged)
      for (const auto& [grad, part] : run.model.prolog_known_zero_parts(g, flags)) known.push_back({grad, part});
    std::vector<Buffer> squares;
    std::vector<Tensor> views;
    for (const auto& layer : g.layers) {
      squares.emplace_back(DType::f64, Device::cpu, std::initializer_list<int64_t>{run.model.expert_squares_count(layer)});
      views.push_back(squares.back());
    }
    for (int step = 1; step <= 3; ++step) {
      for (int64_t i = 0; i < n; ++i) run.batch.input_ids.ptr<int32_t>()[i] = int32_t((run.batch.input_ids.ptr<int32_t>()[i] + 3) % V);
      state.start_step(known);
      MicroBatch<Qwen3Moe> mb;
      forward(mb, run.model, w, run.batch);
      BackwardPass<Qwen3Moe>::Options options{run.loss_scale, run.aux_grad, true, false, views};
      options.first_of_step = true;
      if (flagged) options.prolog_known_zero = flags;
      backward(mb, run.model, w, g, run.batch, options);
      grads[flagged].push_back(to_host(state.grads().all()));
      const int64_t set = std::count(flags.ptr<int32_t>(), flags.ptr<int32_t>() + V, 1);
      EXPECT_EQ(set > 0, flagged) << step;
      if (flagged && step == 3)
        for (int64_t v = 0; v < V; ++v)
          if (flags.ptr<int32_t>()[v]) testing::set_element(g.embed.reshape({g.embed.numel()}), v * g.embed.size(1), std::nan(""));
      norms[flagged].push_back(state.gradient_norm(views, known));
      state.optimizer_step(AdamWHyper{1e-3, 0.9, 0.95, 1e-8, 0.1, step, 0.5}, known);
    }
    params.push_back(to_host(state.params().all()));
  }
  for (size_t step = 0; step < 3; ++step) {
    EXPECT_EQ(std::memcmp(grads[0][step].view().data, grads[1][step].view().data, grads[0][step].view().bytes()), 0) << step;
    EXPECT_EQ(norms[0][step], norms[1][step]) << step;
  }
  EXPECT_EQ(std::memcmp(params[0].view().data, params[1].view().data, params[0].view().bytes()), 0);
}

}  // namespace
}  // namespace marrow
