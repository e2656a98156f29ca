// Test tool for export parity (tests/python/test_checkpoint.py, tools/gpu_export_check.py): loads a
// model from a checkpoint, a run directory or a Hugging Face directory, runs Marrow's forward on
// the given tokens and writes the logits and the mean next-token loss.
//   model_forward <model-dir> <tokens-file> <out-dir> [cpu|cuda] [--no-logits]
// tokens-file: whitespace-separated integers "B S t_0 ... t_{B*S-1}". Writes
// <out-dir>/marrow_outputs.safetensors (logits [B, S, V] f32, input_ids) and <out-dir>/marrow_loss.json.
// On cuda the model computes in bf16 from fp32 master weights, as training does.
#include <cstring>
#include <filesystem>
#include <fstream>

#include "apps/model_switch.h"
#include "core/safetensors.h"
#include "engine/checkpoint.h"
#include "engine/step.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"

using namespace marrow;

template <MoeModel M>
void run(const ModelSource& source, const typename M::Config& config, const std::vector<int32_t>& tokens, int64_t B, int64_t S,
         const std::string& out, Device device, bool logits_out) {
  M model(config, device == Device::cuda ? DType::bf16 : DType::f32, device);
  Arena params("parameters", DType::f32, device, model.num_parameters());
  load_model_weights(source, model.specs(), params);
  std::optional<Arena> working;
  if (device == Device::cuda) {
    working.emplace("bf16 weights", DType::bf16, device, model.num_parameters());
    cast(working->all(), params.all());
  }
  const auto w = model.bind(working ? *working : params);
  const int64_t T = B * S;
  Buffer ids(DType::i32, Device::cpu, {T}), targets(DType::i32, Device::cpu, {T}), positions(DType::i32, Device::cpu, {T});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = b * S + s;
      ids.ptr<int32_t>()[i] = tokens[size_t(i)];
      positions.ptr<int32_t>()[i] = int32_t(s);
      // As Hugging Face shifts labels: position s predicts token s + 1; the last position has no target.
      targets.ptr<int32_t>()[i] = s + 1 < S ? tokens[size_t(i + 1)] : kIgnoreIndex;
    }
  typename M::Batch batch{B, S, Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T})};
  copy(batch.input_ids, ids);
  copy(batch.targets, targets);
  copy(batch.positions, positions);
  MicroBatch<M> mb;
  forward(mb, model, w, batch);
  std::filesystem::create_directories(out);
  std::ofstream(out + "/marrow_loss.json") << fmt::format("{{\"loss\": {:.9g}}}\n", mb.token_loss.value() / double(B * (S - 1)));
  if (!logits_out) return;
  const int64_t V = config.vocab_size;
  Buffer logits32(DType::f32, device, {T, V});
  if (mb.epilog.logits.view().dtype == DType::f32) copy(logits32, mb.epilog.logits);
  else cast(logits32, mb.epilog.logits);
  Buffer host = to_host(logits32);
  write_safetensors(out + "/marrow_outputs.safetensors",
                    {{"logits", host.view().reshape({B, S, V})}, {"input_ids", ids.view().reshape({B, S})}});
}

int main(int argc, char** argv) try {
  MARROW_CHECK(argc >= 4, "usage: model_forward <model-dir> <tokens-file> <out-dir> [cpu|cuda] [--no-logits]");
  const Device device = argc >= 5 && !std::strcmp(argv[4], "cuda") ? Device::cuda : Device::cpu;
  const bool logits_out = !(argc >= 6 && !std::strcmp(argv[5], "--no-logits"));
  std::ifstream in(argv[2]);
  MARROW_CHECK(in.good(), "cannot open {}", argv[2]);
  int64_t B = 0, S = 0;
  in >> B >> S;
  std::vector<int32_t> tokens(size_t(B * S));
  for (auto& t : tokens) in >> t;
  MARROW_CHECK(B > 0 && S > 1 && !in.fail(), "{}: expected 'B S' and B*S token ids", argv[2]);
  const ModelSource source = find_model(argv[1]);
  with_model(source.config, source.config_path, [&]<class M>(const typename M::Config& config) {
    run<M>(source, config, tokens, B, S, argv[3], device, logits_out);
  });
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "model_forward: error: %s\n", e.what());
  return 1;
}
