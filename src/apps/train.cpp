// marrow train <run-config> [--section.key=value ...] [--resume <checkpoint>]
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_switch.h"
#include "core/json.h"
#include "engine/trainer.h"

namespace marrow {

int train_command(int argc, char** argv) {
  // --resume <dir> (or --resume=<dir>) is short for --checkpoint.resume=<dir>.
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--resume" && i + 1 < argc) args.push_back(std::string("--checkpoint.resume=") + argv[++i]);
    else if (a.starts_with("--resume=")) args.push_back("--checkpoint.resume=" + a.substr(9));
    else args.push_back(a);
  }
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  const RunConfig rc = parse_run_config(int(pointers.size()), pointers.data());
  const Json model_json = read_json_file(rc.model_config);
  with_model(model_json, rc.model_config, [&]<class M>(const typename M::Config& config) { train<M>(rc, config); });
  return 0;
}

}  // namespace marrow
