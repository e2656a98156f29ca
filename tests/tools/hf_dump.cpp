// Test tool for the Hugging Face parity tests: builds the model of a config.json (any family) with
// Marrow's initialisation, writes its fp32 weights under Hugging Face names, runs Marrow's forward on
// the given tokens and writes the logits and the loss; with --grads also the parameters' gradients
// of the mean token loss (marrow_grads.safetensors); with --random-biases every bias is drawn as the
// matrices are instead of starting at zero, and with --random-norms every norm weight (Qwen3.5's
// zero-centred norms start at zero, where an error in their offset's gradient would hide).
//   hf_dump [--device=cuda] [--grads] [--random-biases] [--random-norms] <config.json> <out-dir> <seed> <batch> <seq> <token> ...
// On the CPU the forward is fp32 (tests/python/test_hf_parity.py); with --device=cuda it is the GPU
// path in bf16 (tools/gpu_hf_parity.py).
#include <filesystem>
#include <fstream>
#include <optional>

#include "gpu_check/check.h"
#include "apps/model_switch.h"
#include "core/safetensors.h"
#include "engine/step.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/init.h"

using namespace marrow;

namespace {

// The model's parameters under Hugging Face names as one safetensors file (the arena on any device).
template <class M> void write_named(const std::string& path, const M& model, const Arena& arena) {
  Buffer host = to_host(arena.all());
  std::vector<SafetensorsEntry> entries;
  for (const TensorSpec& s : model.specs()) {
    Tensor t = host.view().rows(s.offset, s.offset + s.numel);
    t.ndim = int(s.shape.size());
    for (size_t i = 0; i < s.shape.size(); ++i) t.shape[i] = s.shape[i];
    entries.push_back({s.name, t});
  }
  write_safetensors(path, entries, {{"format", "pt"}});
}

struct Args {
  Device device = Device::cpu;
  bool grads = false, random_biases = false, random_norms = false;
  std::string config, out;
  uint64_t seed = 0;
  int64_t B = 0, S = 0;
  std::vector<int32_t> ids;
};

template <class M> void dump(const typename M::Config& config, const Args& args) {
  const int64_t B = args.B, S = args.S, T = B * S;
  const Device device = args.device;
  M model(config, device == Device::cuda ? DType::bf16 : DType::f32, device);
  Arena params("parameters", DType::f32, device, model.num_parameters());
  model.initialize(params, args.seed);
  // Biases start at zero; a parity test that checks their forward gives them values.
  for (const TensorSpec& s : model.specs())
    if ((args.random_biases && s.name.ends_with("bias")) || (args.random_norms && s.is_norm))
      fill_normal(params.slice(s.offset, {s.numel}), args.seed, s.name, model.config().initializer_range);
  std::filesystem::create_directories(args.out);
  write_named(args.out + "/model.safetensors", model, params);
  write_json_file(args.out + "/config.json", model.config().json);

  std::vector<int32_t> targets(static_cast<size_t>(T)), positions(static_cast<size_t>(T));
  int64_t counted = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = b * S + s;
      positions[size_t(i)] = int32_t(s);
      // Hugging Face shifts labels inside the model: position s predicts token s + 1.
      targets[size_t(i)] = s + 1 < S ? args.ids[size_t(i + 1)] : kIgnoreIndex;
      counted += s + 1 < S;
    }
  typename M::Batch batch{B, S, Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T})};
  copy(batch.input_ids, Tensor(const_cast<int32_t*>(args.ids.data()), DType::i32, Device::cpu, {T}));
  copy(batch.targets, Tensor(targets.data(), DType::i32, Device::cpu, {T}));
  copy(batch.positions, Tensor(positions.data(), DType::i32, Device::cpu, {T}));

  std::optional<Arena> working;
  if (device == Device::cuda) {
    working.emplace("bf16 weights", DType::bf16, device, model.num_parameters());
    cast(working->all(), params.all());
  }
  const auto w = model.bind(working ? *working : params);
  MicroBatch<M> mb;
  forward(mb, model, w, batch);
  Buffer logits = to_host_f32(mb.epilog.logits);
  write_safetensors(args.out + "/marrow_outputs.safetensors",
                    {{"logits", logits.view().reshape({B, S, model.config().vocab_size})},
                     {"input_ids", Tensor(const_cast<int32_t*>(args.ids.data()), DType::i32, Device::cpu, {B, S})}});
  std::ofstream(args.out + "/marrow_loss.json") << fmt::format("{{\"loss\": {:.9g}}}\n", mb.token_loss.value() / double(counted));
  if (!args.grads) return;
  // The gradients of the mean token loss alone (Hugging Face adds no load-balance loss unless asked).
  Arena grads("gradients", DType::f32, device, model.num_parameters());
  grads.fill_zero();
  backward(mb, model, w, model.bind(grads), batch, 1.0 / double(counted), 0.0);
  write_named(args.out + "/marrow_grads.safetensors", model, grads);
}

}  // namespace

int main(int argc, char** argv) try {
  Args args;
  int i = 1;
  for (; i < argc && std::string(argv[i]).starts_with("--"); ++i) {
    const std::string flag = argv[i];
    if (flag == "--device=cuda") args.device = Device::cuda;
    else if (flag == "--grads") args.grads = true;
    else if (flag == "--random-biases") args.random_biases = true;
    else if (flag == "--random-norms") args.random_norms = true;
    else fail("hf_dump: unknown flag {}", flag);
  }
  MARROW_CHECK(argc - i >= 5, "usage: hf_dump [--device=cuda] [--grads] [--random-biases] [--random-norms] <config.json> <out-dir> <seed> <batch> <seq> <token>...");
  args.config = argv[i];
  args.out = argv[i + 1];
  args.seed = std::stoull(argv[i + 2]);
  args.B = std::stoll(argv[i + 3]);
  args.S = std::stoll(argv[i + 4]);
  MARROW_CHECK(argc - i - 5 == args.B * args.S, "expected {} tokens, got {}", args.B * args.S, argc - i - 5);
  for (int j = i + 5; j < argc; ++j) args.ids.push_back(int32_t(std::stol(argv[j])));
  with_model(read_json_file(args.config), args.config, [&]<class M>(const typename M::Config& config) { dump<M>(config, args); });
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "hf_dump: error: %s\n", e.what());
  return 1;
}
