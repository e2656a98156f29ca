// marrow train <run-config> [--section.key=value ...]
#include "apps/commands.h"
#include "core/json.h"
#include "engine/trainer.h"
#include "models/qwen3_moe.h"

namespace marrow {

int train_command(int argc, char** argv) {
  const RunConfig rc = parse_run_config(argc, argv);
  const Json model_json = read_json_file(rc.model_config);
  const std::string model_type = JsonFields(model_json, rc.model_config).string("model_type");
  // The one model switch of the application (DESIGN.md §1.3).
  if (model_type == Qwen3Moe::model_type) {
    train<Qwen3Moe>(rc, Qwen3MoeConfig::from_json(model_json, rc.model_config));
  } else {
    fail("{}: unknown model_type '{}' (supported: qwen3_moe)", rc.model_config, model_type);
  }
  return 0;
}

}  // namespace marrow
