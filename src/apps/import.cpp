// marrow import <hf-dir> <checkpoint-dir> [--overwrite] [--quiet]: a Hugging Face model directory
// to a checkpoint for continued pretraining (weights only: AdamW's moments start at zero).
#include <filesystem>

#include "apps/commands.h"
#include "apps/model_switch.h"
#include "core/sha256.h"
#include "engine/checkpoint.h"
#include "engine/hf_format.h"

namespace fs = std::filesystem;

namespace marrow {

int import_command(int argc, char** argv) {
  CLI::App app{"Import a Hugging Face model directory as a checkpoint for continued pretraining.", "marrow import"};
  std::string from, out;
  bool overwrite = false, quiet = false;
  app.add_option("hf-dir", from, "Hugging Face model directory (config.json + safetensors)")->required();
  app.add_option("checkpoint-dir", out, "the checkpoint directory to write")->required();
  app.add_flag("--overwrite", overwrite, "replace an existing checkpoint at checkpoint-dir");
  app.add_flag("--quiet", quiet, "no progress line");
  if (const int code = parse_command_line(app, argc, argv); code >= 0) return code;
  // "out/" would put the checkpoint's staging directory out/.tmp inside out.
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  MARROW_CHECK(fs::is_directory(from), "{} is not a directory", from);
  MARROW_CHECK(is_hf_model_dir(from), "{} is not a Hugging Face model directory: it needs config.json and model.safetensors or "
               "model.safetensors.index.json", from);
  if (fs::exists(out)) {
    MARROW_CHECK(overwrite, "{} already exists (pass --overwrite to replace it)", out);
    MARROW_CHECK(fs::exists(out + "/meta.json"), "{} exists and is not a checkpoint: refusing to replace it", out);
  }
  const std::string config_path = from + "/config.json";
  const Json config_json = read_json_file(config_path);
  std::string eos_token;
  if (fs::exists(from + "/tokenizer_config.json")) {
    const Json t = read_json_file(from + "/tokenizer_config.json");
    if (t.contains("eos_token") && t["eos_token"].is_string()) eos_token = t["eos_token"];
    if (t.contains("eos_token") && t["eos_token"].is_object()) eos_token = t["eos_token"].value("content", "");
  }
  const std::string tokenizer = fs::exists(from + "/tokenizer.json") ? from + "/tokenizer.json" : "";
  if (config_json.value("model_type", "") == "qwen3_5_moe")
    std::printf("import: %s is a multimodal Qwen3.5-MoE: its text tower is imported (text_config, model.language_model.*); "
                "the vision tower and the MTP head are left out\n", from.c_str());
  with_model(config_json, config_path, [&]<class M>(const typename M::Config& config) {
    M model(config, DType::f32, Device::cpu);
    Arena params("parameters", DType::f32, Device::cpu, model.num_parameters());
    read_hf_weights(from, model.specs(), params, !quiet);
    Json meta = {{"step", 0},
                 {"samples_seen", 0},
                 {"tokens_seen", 0},
                 {"imported_from", fs::absolute(from).string()},
                 {"model_config", config_json},
                 {"data", {{"eos_token", eos_token}}}};
    // Continued training compares it with the corpus's tokenizer (engine/config_changes.h).
    if (!tokenizer.empty()) meta["data"]["tokenizer_sha256"] = sha256_file(tokenizer);
    write_checkpoint(out, model.specs(), {&params}, meta, config_json, tokenizer);
    std::printf("import: %s -> %s: %.2fM parameters (no optimizer state)%s\n", from.c_str(), out.c_str(),
                model.num_parameters() / 1e6, tokenizer.empty() ? "" : ", with tokenizer");
    std::printf("continue pretraining with: marrow train <run-config> --model.config=%s/config.json --checkpoint.resume=%s\n",
                out.c_str(), out.c_str());
  });
  return 0;
}

}  // namespace marrow
