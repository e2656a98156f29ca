// marrow sample <checkpoint-or-hf-dir> --prompt "..." [--tokens N] [--temperature T] [--seed S] [--samples K]
// Continues a prompt with a trained model: the whole sequence goes through the fp32 CPU forward for
// each new token (no KV cache: this is for reading what a small model learned, not for serving).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "apps/commands.h"
#include "apps/model_switch.h"
#include "data/tokenizer.h"
#include "engine/checkpoint.h"
#include "engine/step.h"
#include "ops/cross_entropy.h"

namespace marrow {

namespace {

struct SampleOptions {
  std::string prompt;
  int64_t tokens = 64;
  double temperature = 0.8;
  uint64_t seed = 1;
  int64_t samples = 1;
};

// The next token from the logits of the last position: the most likely one at temperature 0,
// otherwise a draw from softmax(logits / temperature). vocab: the ids the tokenizer has, which a
// model may pad beyond (Qwen3's 151,936 embeddings for 151,669 tokens); the padding rows are not drawn.
int32_t pick(const float* logits, int64_t vocab, double temperature, std::mt19937_64& rng) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return int32_t(best);
  std::vector<double> p(static_cast<size_t>(vocab));
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += p[size_t(i)] = std::exp((double(logits[i]) - logits[best]) / temperature);
  double u = double(rng() >> 11) * 0x1.0p-53 * sum;  // uniform in [0, sum), the same on every platform
  for (int64_t i = 0; i < vocab; ++i)
    if ((u -= p[size_t(i)]) < 0) return int32_t(i);
  return int32_t(best);
}

// The text with each byte that is not part of a well-formed UTF-8 sequence replaced by U+FFFD (a
// small model may emit tokens that split characters).
std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    bool ok = n > 0 && i + n <= s.size();
    for (size_t k = 1; ok && k < n; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
    if (ok) out.append(s, i, n);
    else out += "\xEF\xBF\xBD";
    i += ok ? n : 1;
  }
  return out;
}

// Each new token runs the whole sequence through the model (no KV cache), so the work grows with
// the square of the length: the sequence stays within the positions the model was made for
// (max_position_embeddings; kMaxSampleLength without one), or the command would run for ever.
constexpr int64_t kMaxSampleLength = 32768;
void check_length(int64_t prompt, int64_t tokens, int64_t max_positions) {
  const int64_t limit = max_positions > 0 ? max_positions : kMaxSampleLength;
  const char* what = max_positions > 0 ? "the model's max_position_embeddings" : "sample's limit without max_position_embeddings";
  MARROW_CHECK(prompt <= limit, "the prompt is {} tokens long, more than {} ({})", prompt, what, limit);
  MARROW_CHECK(tokens <= limit - prompt, "--tokens {} and the prompt's {} tokens exceed {} ({}): ask for at most {} new tokens", tokens,
               prompt, what, limit, limit - prompt);
}

template <MoeModel M>
void sample(const ModelSource& source, const typename M::Config& config, const Tokenizer& tokenizer, const SampleOptions& o) {
  M model(config, DType::f32, Device::cpu);
  Arena params("parameters", DType::f32, Device::cpu, model.num_parameters());
  load_model_weights(source, model.specs(), params);
  const auto w = model.bind(params);
  const int64_t vocab = config.vocab_size;
  std::vector<int32_t> prompt = tokenizer.encode(o.prompt);
  std::optional<int32_t> eos = tokenizer.token_id("<|endoftext|>");
  if (prompt.empty()) {
    MARROW_CHECK(eos.has_value(), "the prompt is empty and the tokenizer has no <|endoftext|> to start from");
    prompt.push_back(*eos);
  }
  for (int32_t id : prompt)
    MARROW_CHECK(id < vocab, "the prompt encodes to token {} but the model's vocab_size is {}: {} is not its tokenizer", id, vocab,
                 source.tokenizer);
  check_length(int64_t(prompt.size()), o.tokens, config.json.value("max_position_embeddings", int64_t(0)));
  const int64_t drawn = std::min(vocab, tokenizer.vocab_size());
  for (int64_t k = 0; k < o.samples; ++k) {
    std::mt19937_64 rng(o.seed + uint64_t(k));
    std::vector<int32_t> ids = prompt;
    for (int64_t t = 0; t < o.tokens; ++t) {
      const int64_t S = int64_t(ids.size());
      Buffer input(DType::i32, Device::cpu, {S}), targets(DType::i32, Device::cpu, {S}), positions(DType::i32, Device::cpu, {S});
      for (int64_t s = 0; s < S; ++s) {
        input.ptr<int32_t>()[s] = ids[size_t(s)];
        targets.ptr<int32_t>()[s] = kIgnoreIndex;
        positions.ptr<int32_t>()[s] = int32_t(s);
      }
      const typename M::Batch batch{1, S, std::move(input), std::move(targets), std::move(positions)};
      MicroBatch<M> mb;
      forward(mb, model, w, batch);
      const int32_t next = pick(mb.epilog.logits.template ptr<float>() + (S - 1) * vocab, drawn, o.temperature, rng);
      if (eos && next == *eos) break;
      ids.push_back(next);
    }
    if (o.samples > 1) std::printf("--- sample %lld\n", (long long)k + 1);
    std::printf("%s\n", printable(tokenizer.decode(ids)).c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int sample_command(int argc, char** argv) {
  CLI::App app{"Continue a prompt with a trained model (CPU, fp32).", "marrow sample"};
  std::string from;
  SampleOptions o;
  app.add_option("model", from, "checkpoint, run directory (its newest checkpoint) or Hugging Face model directory")->required();
  app.add_option("--prompt", o.prompt, "text to continue")->required();
  app.add_option("--tokens", o.tokens, "new tokens per sample at most (an end-of-text token stops earlier)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--temperature", o.temperature, "softmax temperature; 0 picks the most likely token")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            char* end = nullptr;
            const double t = std::strtod(v.c_str(), &end);
            return !v.empty() && *end == '\0' && std::isfinite(t) && t >= 0 ? "" : "must be a finite number, 0 or more, got " + v;
          },
          "NUMBER"))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "random seed of the first sample (sample k uses seed + k - 1)")->capture_default_str();
  app.add_option("--samples", o.samples, "continuations to print")->check(CLI::PositiveNumber)->capture_default_str();
  if (const int code = parse_command_line(app, argc, argv); code >= 0) return code;
  const ModelSource source = find_model(from);
  MARROW_CHECK(!source.tokenizer.empty(), "{} has no tokenizer.json: sample needs the tokenizer the model was trained with", source.dir);
  const Tokenizer tokenizer = Tokenizer::load(source.tokenizer);
  with_model(source.config, source.config_path,
             [&]<class M>(const typename M::Config& config) { sample<M>(source, config, tokenizer, o); });
  return 0;
}

}  // namespace marrow
