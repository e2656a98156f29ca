// The load-balance forms (train.load_balance) and DeepSeek-V3's expert bias (train.expert_bias_update)
// against small references written here in f64: the global-batch form's running sums over a step's
// micro-batches, the sequence-wise loss, the bias in the choice of experts, the bias update.
#include <cmath>
#include <vector>

#include "engine/run_config.h"
#include "engine/step.h"
#include "gradcheck.h"
#include "models/qwen3_moe.h"
#include "ops/router.h"

namespace marrow {
namespace {

// Hand-made routing of n tokens over e experts: random logits, their softmax, and top-k indices
// chosen by a formula (the losses do not need them to be the top k).
struct Routing {
  int64_t n, e, k;
  Buffer logits, probs, index;
  Routing(int64_t n_, int64_t e_, int64_t k_, uint64_t seed)
      : n(n_), e(e_), k(k_), logits(testing::random_buffer(DType::f64, {n_, e_}, seed)), probs(DType::f64, Device::cpu, {n_, e_}),
        index(DType::i32, Device::cpu, {n_, k_}) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j) index.ptr<int32_t>()[t * k + j] = int32_t((t * t + 2 * j + int64_t(seed)) % e);
    softmax();
  }
  void softmax() {
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0;
      for (int64_t i = 0; i < e; ++i) sum += std::exp(logits.ptr<double>()[t * e + i]);
      for (int64_t i = 0; i < e; ++i) probs.ptr<double>()[t * e + i] = std::exp(logits.ptr<double>()[t * e + i]) / sum;
    }
  }
  int64_t count(int64_t first, int64_t last, int64_t expert) const {
    int64_t c = 0;
    for (int64_t i = first * k; i < last * k; ++i) c += index.ptr<int32_t>()[i] == expert;
    return c;
  }
  double mean_prob(int64_t first, int64_t last, int64_t expert) const {
    double s = 0;
    for (int64_t t = first; t < last; ++t) s += probs.ptr<double>()[t * e + expert];
    return s / double(last - first);
  }
  // d(aux_grad x the loss of stats)/dlogits, the routing weights' gradient zero.
  Buffer aux_gradient(const Buffer& stats) const {
    Buffer dlogits(DType::f64, Device::cpu, {n, e}), weights = Buffer::zeros(DType::f64, Device::cpu, {n, k});
    router_backward(dlogits, Buffer::zeros(DType::f64, Device::cpu, {n, k}), probs, index, weights, false, 1.0, stats);
    return dlogits;
  }
};

// Qwen's global-batch balance under gradient accumulation: micro-batch m's loss takes the expert
// fractions of every token of micro-batches 0..m (the totals), its own mean probabilities:
// E * sum_e (C_e(0..m) / N(0..m)) * P_e(m). Its gradient, the fractions held, by finite differences.
TEST(LoadBalance, GlobalBatchFormTakesTheFractionsOfTheStepSoFar) {
  const int64_t e = 5, k = 2, micro = 3;
  std::vector<Routing> mbs;
  for (int64_t m = 0; m < micro; ++m) mbs.emplace_back(4 + m, e, k, uint64_t(7 + m));
  Buffer totals = Buffer::zeros(DType::f64, Device::cpu, {e + 1});
  std::vector<int64_t> counts(size_t(e), 0);
  int64_t tokens = 0;
  for (Routing& r : mbs) {
    Buffer stats(DType::f64, Device::cpu, {2 * e + 1});
    router_statistics(stats, r.probs, r.index);
    router_step_statistics(totals, stats, true);
    tokens += r.n;
    for (int64_t i = 0; i < e; ++i) counts[size_t(i)] += r.count(0, r.n, i);
    auto reference = [&] {
      double loss = 0;
      for (int64_t i = 0; i < e; ++i) loss += double(counts[size_t(i)]) / double(tokens) * r.mean_prob(0, r.n, i);
      return double(e) * loss;
    };
    EXPECT_NEAR(router_aux_loss(stats), reference(), 1e-13) << "micro-batch of " << r.n << " tokens";
    const Buffer analytic = r.aux_gradient(stats);
    testing::expect_gradient("global-batch form", r.logits, analytic, [&] {
      r.softmax();
      return reference();
    });
  }
  for (int64_t i = 0; i < e; ++i) EXPECT_EQ(totals.ptr<double>()[i], double(counts[size_t(i)]));
  EXPECT_EQ(totals.ptr<double>()[e], double(tokens));
}

// DeepSeek-V3's sequence-wise loss: per sequence sum_i f_i P_i, f_i = E / (K T) x count_i, P_i the
// sequence's mean probability; the mean over sequences. Marrow's form is K times it (balanced reads K,
// as the micro-batch form; router_aux_loss_coef = alpha / K).
TEST(LoadBalance, SequenceFormIsDeepSeekV3sLossTimesK) {
  const int64_t sequences = 3, length = 4, e = 6, k = 2;
  Routing r(sequences * length, e, k, 5);
  Buffer stats(DType::f64, Device::cpu, {sequences, 2 * e + 1});
  auto reference = [&] {
    double mean = 0;
    for (int64_t s = 0; s < sequences; ++s) {
      double loss = 0;
      for (int64_t i = 0; i < e; ++i)
        loss += double(e) / double(k * length) * double(r.count(s * length, (s + 1) * length, i)) * r.mean_prob(s * length, (s + 1) * length, i);
      mean += loss / double(sequences);
    }
    return mean;
  };
  router_statistics_grouped(stats, r.probs, r.index, length);
  EXPECT_NEAR(router_aux_loss(stats), double(k) * reference(), 1e-13);
  const Buffer analytic = r.aux_gradient(stats);
  testing::expect_gradient("sequence form", r.logits, analytic, [&] {
    r.softmax();
    return double(k) * reference();
  });
}

float probs_of_quarters[4] = {0.1f, 0.2f, 0.3f, 0.4f};

// Logits whose softmax is [0.1, 0.2, 0.3, 0.4] routed with a bias; returns (indices, weights).
std::pair<std::vector<int32_t>, std::vector<float>> route_with_bias(std::vector<float> bias, RouterOptions o, int64_t k) {
  std::vector<float> logits(4), probs(4), weights(static_cast<size_t>(k));
  std::vector<int32_t> index(static_cast<size_t>(k));
  for (int i = 0; i < 4; ++i) logits[size_t(i)] = std::log(probs_of_quarters[i]);
  o.selection_bias = Tensor(bias.data(), DType::f32, Device::cpu, {4});
  router_forward(Tensor(probs.data(), DType::f32, Device::cpu, {1, 4}), Tensor(index.data(), DType::i32, Device::cpu, {1, k}),
                 Tensor(weights.data(), DType::f32, Device::cpu, {1, k}), Tensor(logits.data(), DType::f32, Device::cpu, {1, 4}), o);
  return {index, weights};
}

TEST(LoadBalance, ExpertBiasSteersTheChoiceNotTheWeights) {
  RouterOptions normalized;
  normalized.normalize = true;
  // Biased scores [0.35, 0.2, 0.3, 0.4]: experts 3 and 0, weighted by their own probabilities.
  auto [index, weights] = route_with_bias({0.25f, 0, 0, 0}, normalized, 2);
  EXPECT_EQ(index, (std::vector<int32_t>{3, 0}));
  EXPECT_NEAR(weights[0], 0.4 / 0.5, 1e-6);
  EXPECT_NEAR(weights[1], 0.1 / 0.5, 1e-6);
  // Groups {0, 1} and {2, 3}, one kept: the bias lifts group 0 (0.45 against 0.4) and expert 0 in it.
  RouterOptions grouped;
  grouped.groups = 2;
  auto [group_index, group_weights] = route_with_bias({0.35f, 0, 0, 0}, grouped, 1);
  EXPECT_EQ(group_index, (std::vector<int32_t>{0}));
  EXPECT_NEAR(group_weights[0], 0.1, 1e-6);
  // A zero bias chooses as none does.
  auto [plain_index, plain_weights] = route_with_bias({0, 0, 0, 0}, normalized, 2);
  EXPECT_EQ(plain_index, (std::vector<int32_t>{3, 2}));
}

// bias += rate x sign(mean load - load), each expert of each layer; a layer without load keeps its bias.
TEST(LoadBalance, ExpertBiasMovesBySignOfTheLoadBelowTheMean) {
  const int64_t layers = 3, e = 4;
  const float rate = 1e-3f;
  Buffer bias = testing::random_buffer(DType::f32, {layers, e}, 3, 0.01), totals = Buffer::zeros(DType::f64, Device::cpu, {layers, e + 1});
  const double loads[2][4] = {{5, 1, 3, 3}, {2, 2, 2, 2}};  // layer 0: mean 3; layer 1 balanced; layer 2 none
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t i = 0; i < e; ++i) totals.ptr<double>()[l * (e + 1) + i] = loads[l][i];
  const Buffer before = to_host(bias);
  expert_bias_update(bias, totals, rate);
  const float* b = before.ptr<float>();
  const std::vector<float> want = {b[0] - rate, b[1] + rate, b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11]};
  for (int64_t i = 0; i < layers * e; ++i) EXPECT_EQ(bias.ptr<float>()[i], want[size_t(i)]) << i;
  EXPECT_THROW(expert_bias_update(bias, totals, 0), Error);
  EXPECT_THROW(expert_bias_update(bias, Buffer::zeros(DType::f64, Device::cpu, {layers, e}), rate), Error);
}

Json tiny_qwen3() {
  return Json{{"model_type", "qwen3_moe"}, {"vocab_size", 40}, {"hidden_size", 16}, {"num_hidden_layers", 2},
              {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8}, {"num_experts", 8},
              {"num_experts_per_tok", 2}, {"moe_intermediate_size", 12}, {"norm_topk_prob", true}, {"rope_theta", 10000.0},
              {"rms_norm_eps", 1e-6}};
}

Qwen3MoeBatch tiny_batch(int64_t B, int64_t S, int64_t vocab, int32_t shift) {
  Qwen3MoeBatch b{B, S, Buffer(DType::i32, Device::cpu, {B * S}), Buffer(DType::i32, Device::cpu, {B * S}), Buffer(DType::i32, Device::cpu, {B * S})};
  for (int64_t i = 0; i < B * S; ++i) {
    b.input_ids.ptr<int32_t>()[i] = int32_t((i * 7 + shift) % vocab);
    b.targets.ptr<int32_t>()[i] = int32_t((i * 3 + shift) % vocab);
    b.positions.ptr<int32_t>()[i] = int32_t(i % S);
  }
  return b;
}

// What the global form computes across a step's micro-batches through the engine (StepGroups'
// step_totals): micro-batch m's load-balance loss, summed over the layers, is
// sum_l E * sum_e (C_le(0..m) / N(0..m)) * P_le(m), from the routing each forward kept.
TEST(LoadBalance, GlobalFormOfAStepRunsOverItsMicroBatchesInOrder) {
  const Qwen3Moe model(Qwen3MoeConfig::from_json(tiny_qwen3(), "tiny"), DType::f64, Device::cpu);
  Arena params("parameters", DType::f64, Device::cpu, model.num_parameters());
  model.initialize(params, 5);
  const auto w = model.bind(params);
  const int64_t L = model.num_layers(), E = model.num_experts(), K = model.top_k();
  Buffer totals = Buffer::zeros(DType::f64, Device::cpu, {L, E + 1});
  StepGroups groups;
  groups.step_totals = totals;
  groups.global_balance = true;
  std::vector<std::vector<double>> counts(size_t(L), std::vector<double>(size_t(E), 0.0));
  double tokens = 0;
  for (int32_t micro = 0; micro < 3; ++micro) {
    const Qwen3MoeBatch batch = tiny_batch(2, 3 + micro, 40, 11 * micro);
    MicroBatch<Qwen3Moe> mb;
    forward(mb, model, w, batch, groups);
    const int64_t T = batch.batch * batch.seq;
    tokens += double(T);
    double want = 0;
    for (int64_t l = 0; l < L; ++l) {
      const auto& a = mb.layers[size_t(l)].attention;
      for (int64_t i = 0; i < T * K; ++i) counts[size_t(l)][size_t(a.topk_index.ptr<int32_t>()[i])] += 1;
      for (int64_t i = 0; i < E; ++i) {
        double p = 0;
        for (int64_t t = 0; t < T; ++t) p += a.probs.ptr<double>()[t * E + i];
        want += double(E) * counts[size_t(l)][size_t(i)] / tokens * (p / double(T));
      }
    }
    EXPECT_NEAR(mb.aux_loss.value(), want, 1e-12) << "micro-batch " << micro;
  }
  for (int64_t l = 0; l < L; ++l) EXPECT_EQ(totals.ptr<double>()[l * (E + 1) + E], tokens);
}

// The sequence form on a family that had none (Qwen3-MoE): the router's gradient of the token loss
// plus the per-sequence load-balance loss, against finite differences.
TEST(LoadBalance, SequenceFormGradientsMatchFiniteDifferencesOnQwen3) {
  Qwen3MoeConfig config = Qwen3MoeConfig::from_json(tiny_qwen3(), "tiny");
  config.sequence_aux = true;
  const Qwen3Moe model(config, DType::f64, Device::cpu);
  Arena params("parameters", DType::f64, Device::cpu, model.num_parameters()), grads("gradients", DType::f64, Device::cpu, model.num_parameters());
  model.initialize(params, 5);
  for (const TensorSpec& s : model.specs()) {  // far from uniform routing
    Tensor t = params.slice(s.offset, {s.numel});
    for (int64_t i = 0; i < s.numel; ++i) testing::set_element(t, i, testing::element(t, i) * (s.is_norm ? 1.0 : 15.0));
  }
  const Qwen3MoeBatch batch = tiny_batch(3, 4, 40, 1);
  const double loss_scale = 1.0 / 12, aux_grad = 0.5;
  auto loss = [&] {
    grads.fill_zero();
    MicroBatch<Qwen3Moe> mb;
    forward(mb, model, model.bind(params), batch);
    EXPECT_EQ(mb.layers[0].attention.routing_stats.view().size(0), 3);  // a row a sequence
    const double value = loss_scale * mb.token_loss.value() + aux_grad * mb.aux_loss.value();
    backward(mb, model, model.bind(params), model.bind(grads), batch, loss_scale, aux_grad);
    return value;
  };
  loss();
  const Buffer analytic = to_host(grads.all());
  for (const TensorSpec& s : model.specs())
    if (s.name.ends_with("mlp.gate.weight"))
      testing::expect_gradient(s.name, params.slice(s.offset, {s.numel}), analytic.view().rows(s.offset, s.offset + s.numel), loss, 1e-5, 16);
}

RunConfig parse(std::vector<std::string> args) {
  args.insert(args.begin(), {"train", MARROW_SOURCE_DIR "/configs/tiny-moe.toml", "--data.path=unused"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return parse_run_config(int(argv.size()), argv.data());
}

std::string parse_error(std::vector<std::string> args) {
  try {
    parse(std::move(args));
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(LoadBalance, RunConfigKeysTakeTheFormsAndANonNegativeRate) {
  EXPECT_EQ(parse({}).load_balance, "");
  EXPECT_EQ(parse({"--train.load_balance=global_batch", "--train.expert_bias_update=1e-3"}).expert_bias_update, 1e-3);
  EXPECT_NE(parse_error({"--train.load_balance=global"}).find("--train.load_balance: global not in {micro_batch,global_batch,sequence}"),
            std::string::npos)
      << parse_error({"--train.load_balance=global"});
  EXPECT_NE(parse_error({"--train.expert_bias_update=-1"}).find("--train.expert_bias_update"), std::string::npos);
}

}  // namespace
}  // namespace marrow
