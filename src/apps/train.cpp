// marrow train <run-config> [--section.key=value ...] [--resume <checkpoint>]
#include <cstdio>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_switch.h"
#include "core/json.h"
#include "engine/memory_guard.h"
#include "engine/trainer.h"

namespace marrow {

namespace {

// Hugging Face accepts sequences beyond max_position_embeddings (RoPE has no table to run past), so
// training on longer ones is allowed, with one warning: the exported model will claim a shorter context.
void warn_beyond_positions(const RunConfig& rc, const Json& model) {
  const int64_t max_positions = model.value("max_position_embeddings", int64_t(0));
  if (max_positions > 0 && rc.seq_len > max_positions)
    std::fprintf(stderr, "warning: train.seq_len = %lld exceeds max_position_embeddings = %lld of %s; raise it there if the model "
                 "is meant for such lengths\n", (long long)rc.seq_len, (long long)max_positions, rc.model_config.c_str());
}

}  // namespace

int train_command(int argc, char** argv) {
  if (print_run_config_help(argc, argv)) return 0;
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
  check_run_paths(rc);
  const Json model_json = read_json_file(rc.model_config);
  warn_beyond_positions(rc, model_json);
  with_model(model_json, rc.model_config, [&]<class M>(const typename M::Config& config) {
    check_state_fits(config.model_size(), process::size(), choose_device(rc.device), process::local_rank(),
                   int(dtype_size(moments_dtype(rc))));
    train<M>(rc, config);
  });
  return 0;
}

}  // namespace marrow
