// marrow export <checkpoint> <out-dir> [--dtype float32|bfloat16] [--shard-mib N] [--overwrite] [--quiet]:
// a checkpoint to a Hugging Face model directory (engine/hf_format.h) that transformers loads as is.
#include <filesystem>

#include "apps/commands.h"
#include "apps/model_switch.h"
#include "engine/checkpoint.h"
#include "engine/hf_format.h"

namespace fs = std::filesystem;

namespace marrow {

namespace {

// The files an export writes, from an earlier export in out (--overwrite); the rest stays.
void remove_model_files(const std::string& out) {
  if (!fs::exists(out)) return;
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".safetensors") || name == "model.safetensors.index.json" || name == "config.json" ||
        name == "generation_config.json" || name == "tokenizer.json" || name == "tokenizer_config.json")
      fs::remove(entry.path());
  }
}

}  // namespace

int export_command(int argc, char** argv) {
  CLI::App app{"Export a checkpoint as a Hugging Face model directory.", "marrow export"};
  std::string from, out, dtype = "float32";
  int64_t shard_mib = 2048;
  bool overwrite = false, quiet = false;
  app.add_option("checkpoint", from, "checkpoint directory (step-XXXXXXXX), or a run directory for its newest")->required();
  app.add_option("out-dir", out, "the Hugging Face model directory to write")->required();
  app.add_option("--dtype", dtype, "dtype of the exported weights")->check(CLI::IsMember({"float32", "bfloat16"}))->capture_default_str();
  app.add_option("--shard-mib", shard_mib, "largest safetensors shard, in MiB")->check(CLI::Range(int64_t(1), int64_t(1) << 30))->capture_default_str();
  app.add_flag("--overwrite", overwrite, "replace the model files of an existing out-dir");
  app.add_flag("--quiet", quiet, "no progress line");
  if (const int code = parse_command_line(app, argc, argv); code >= 0) return code;
  const ModelSource source = find_model(from);
  const std::string run_data = enclosing_run_data(out);
  MARROW_CHECK(run_data.empty(), "refusing to export into {}: it is or lies inside the checkpoint or run directory {}, whose files an "
               "export would replace; choose an out-dir outside it", out, run_data);
  MARROW_CHECK(fs::weakly_canonical(fs::absolute(out)) != fs::weakly_canonical(fs::absolute(source.dir)),
               "refusing to export {} onto itself: choose another out-dir", source.dir);
  MARROW_CHECK(!fs::exists(out) || fs::is_directory(out), "{} exists and is not a directory: out-dir is the directory to write", out);
  MARROW_CHECK(overwrite || !fs::exists(out) || fs::is_empty(out), "{} exists and is not empty (pass --overwrite to replace its model files)",
               out);
  HfExportOptions options;
  options.dtype = dtype == "bfloat16" ? DType::bf16 : DType::f32;
  options.shard_bytes = size_t(shard_mib) << 20;
  options.tokenizer = source.tokenizer;
  options.progress = !quiet;
  if (source.is_checkpoint) {
    const Json meta = read_json_file(source.dir + "/meta.json");
    options.eos_token = meta.value("data", Json::object()).value("eos_token", "");
    for (const Json& b : meta.value("expert_bias", Json::array()))
      MARROW_CHECK(b.get<double>() == 0, "{} was trained with a non-zero expert bias (train.expert_bias_update), which no Hugging Face model of "
                   "this family holds, so an export would route tokens differently", source.dir);
  } else if (fs::exists(source.dir + "/tokenizer_config.json")) {
    const Json t = read_json_file(source.dir + "/tokenizer_config.json");
    if (t.contains("eos_token") && t["eos_token"].is_string()) options.eos_token = t["eos_token"];
  }
  if (options.eos_token.empty() && !options.tokenizer.empty()) options.eos_token = "<|endoftext|>";
  with_model(source.config, source.config_path, [&]<class M>(const typename M::Config& config) {
    M model(config, DType::f32, Device::cpu);
    Arena params("parameters", DType::f32, Device::cpu, model.num_parameters());
    load_model_weights(source, model.specs(), params, !quiet);
    remove_model_files(out);  // only now: a source that fails to load leaves the old export whole
    write_hf_model(out, model.specs(), params, config.json, options);
    std::printf("export: %s -> %s: %.2fM parameters as %s%s\n", source.dir.c_str(), out.c_str(), model.num_parameters() / 1e6,
                dtype.c_str(), options.tokenizer.empty() ? " (no tokenizer: the run's corpus had none)" : ", with tokenizer");
  });
  return 0;
}

}  // namespace marrow
