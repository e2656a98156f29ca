// Test tool for the Hugging Face parity test (tests/python/test_hf_parity.py): builds a Qwen3-MoE
// from a config.json with Marrow's initialisation, writes its weights under Hugging Face names,
// runs Marrow's fp32 forward on the given tokens and writes the logits and the loss.
//   hf_dump <config.json> <out-dir> <seed> <batch> <seq> <token> ...
#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "engine/step.h"
#include "models/qwen3_moe.h"
#include "ops/cross_entropy.h"


using namespace marrow;

int main(int argc, char** argv) try {
  MARROW_CHECK(argc >= 6, "usage: hf_dump <config.json> <out-dir> <seed> <batch> <seq> <token>...");
  const std::string out = argv[2];
  const int64_t B = std::stoll(argv[4]), S = std::stoll(argv[5]), T = B * S;
  MARROW_CHECK(argc == 6 + T, "expected {} tokens, got {}", T, argc - 6);
  Qwen3Moe model(Qwen3MoeConfig::load(argv[1]), DType::f32, Device::cpu);
  Arena params("parameters", DType::f32, Device::cpu, model.num_parameters());
  model.initialize(params, std::stoull(argv[3]));
  std::filesystem::create_directories(out);

  std::vector<SafetensorsEntry> entries;
  for (const TensorSpec& s : model.specs()) {
    Tensor t = params.slice(s.offset, {s.numel});
    t.ndim = int(s.shape.size());
    for (size_t i = 0; i < s.shape.size(); ++i) t.shape[i] = s.shape[i];
    entries.push_back({s.name, t});
  }
  write_safetensors(out + "/model.safetensors", entries, {{"format", "pt"}});
  write_json_file(out + "/config.json", model.config().json);

  Qwen3MoeBatch batch{B, S, Buffer(DType::i32, Device::cpu, {T}), Buffer(DType::i32, Device::cpu, {T}),
                      Buffer(DType::i32, Device::cpu, {T})};
  int64_t counted = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = b * S + s;
      batch.input_ids.ptr<int32_t>()[i] = int32_t(std::stol(argv[6 + i]));
      batch.positions.ptr<int32_t>()[i] = int32_t(s);
      // Hugging Face shifts labels inside the model: position s predicts token s + 1.
      batch.targets.ptr<int32_t>()[i] = s + 1 < S ? int32_t(std::stol(argv[6 + i + 1])) : kIgnoreIndex;
      counted += s + 1 < S;
    }

  const auto w = model.bind(params);
  MicroBatch<Qwen3Moe> mb;
  forward(mb, model, w, batch);
  const double loss_sum = mb.token_loss_sum;
  const Qwen3MoeEpilogActivations& epilog = mb.epilog;
  Tensor logits = epilog.logits.view().reshape({B, S, model.config().vocab_size});
  write_safetensors(out + "/marrow_outputs.safetensors", {{"logits", logits}, {"input_ids", batch.input_ids.view().reshape({B, S})}});
  std::ofstream(out + "/marrow_loss.json") << fmt::format("{{\"loss\": {:.9g}}}\n", loss_sum / double(counted));

  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "hf_dump: error: %s\n", e.what());
  return 1;
}
