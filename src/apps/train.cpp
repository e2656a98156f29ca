// marrow train <run-config> [--section.key=value ...]
#include "apps/commands.h"
#include "apps/model_switch.h"
#include "core/json.h"
#include "engine/trainer.h"

namespace marrow {

int train_command(int argc, char** argv) {
  const RunConfig rc = parse_run_config(argc, argv);
  const Json model_json = read_json_file(rc.model_config);
  with_model(model_json, rc.model_config, [&]<class M>(const typename M::Config& config) { train<M>(rc, config); });
  return 0;
}

}  // namespace marrow
