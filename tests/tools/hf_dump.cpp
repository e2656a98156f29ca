// Test tool for the Hugging Face parity tests: builds a Qwen3-MoE from a config.json with Marrow's
// initialisation, writes its fp32 weights under Hugging Face names, runs Marrow's forward on the
// given tokens and writes the logits and the loss.
//   hf_dump [--device=cuda] <config.json> <out-dir> <seed> <batch> <seq> <token> ...
// On the CPU the forward is fp32 (tests/python/test_hf_parity.py); with --device=cuda it is the GPU
// path in bf16 (tools/gpu_hf_parity.py).
#include <filesystem>
#include <fstream>
#include <optional>

#include "apps/check.h"
#include "core/safetensors.h"
#include "engine/step.h"
#include "models/qwen3_moe.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"

using namespace marrow;

int main(int argc, char** argv) try {
  Device device = Device::cpu;
  if (argc > 1 && std::string(argv[1]) == "--device=cuda") {
    device = Device::cuda;
    --argc, ++argv;
  }
  MARROW_CHECK(argc >= 6, "usage: hf_dump [--device=cuda] <config.json> <out-dir> <seed> <batch> <seq> <token>...");
  const std::string out = argv[2];
  const int64_t B = std::stoll(argv[4]), S = std::stoll(argv[5]), T = B * S;
  MARROW_CHECK(argc == 6 + T, "expected {} tokens, got {}", T, argc - 6);
  Qwen3Moe model(Qwen3MoeConfig::load(argv[1]), device == Device::cuda ? DType::bf16 : DType::f32, device);
  Arena params("parameters", DType::f32, device, model.num_parameters());
  model.initialize(params, std::stoull(argv[3]));
  std::filesystem::create_directories(out);

  Buffer host_params = to_host(params.all());
  std::vector<SafetensorsEntry> entries;
  for (const TensorSpec& s : model.specs()) {
    Tensor t = host_params.view().rows(s.offset, s.offset + s.numel);
    t.ndim = int(s.shape.size());
    for (size_t i = 0; i < s.shape.size(); ++i) t.shape[i] = s.shape[i];
    entries.push_back({s.name, t});
  }
  write_safetensors(out + "/model.safetensors", entries, {{"format", "pt"}});
  write_json_file(out + "/config.json", model.config().json);

  std::vector<int32_t> ids(static_cast<size_t>(T)), targets(static_cast<size_t>(T)), positions(static_cast<size_t>(T));
  int64_t counted = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = b * S + s;
      ids[size_t(i)] = int32_t(std::stol(argv[6 + i]));
      positions[size_t(i)] = int32_t(s);
      // Hugging Face shifts labels inside the model: position s predicts token s + 1.
      targets[size_t(i)] = s + 1 < S ? int32_t(std::stol(argv[6 + i + 1])) : kIgnoreIndex;
      counted += s + 1 < S;
    }
  Qwen3MoeBatch batch{B, S, Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T})};
  copy(batch.input_ids, Tensor(ids.data(), DType::i32, Device::cpu, {T}));
  copy(batch.targets, Tensor(targets.data(), DType::i32, Device::cpu, {T}));
  copy(batch.positions, Tensor(positions.data(), DType::i32, Device::cpu, {T}));

  std::optional<Arena> working;
  if (device == Device::cuda) {
    working.emplace("bf16 weights", DType::bf16, device, model.num_parameters());
    cast(working->all(), params.all());
  }
  MicroBatch<Qwen3Moe> mb;
  forward(mb, model, model.bind(working ? *working : params), batch);
  Buffer logits = to_host_f32(mb.epilog.logits);
  write_safetensors(out + "/marrow_outputs.safetensors",
                    {{"logits", logits.view().reshape({B, S, model.config().vocab_size})},
                     {"input_ids", Tensor(ids.data(), DType::i32, Device::cpu, {B, S})}});
  std::ofstream(out + "/marrow_loss.json") << fmt::format("{{\"loss\": {:.9g}}}\n", mb.token_loss.value() / double(counted));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "hf_dump: error: %s\n", e.what());
  return 1;
}
