// marrow: one binary, one subcommand per job, like git. Each subcommand lives in its own file in
// src/apps/ and exists only once it works.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "apps/commands.h"
#include "core/errors.h"
#include "parallel/process.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int argc, char** argv);
  const char* help;
};

const Command kCommands[] = {
    {"train", marrow::train_command, "train a model: marrow train <run-config> [--section.key=value ...] [--profile-steps=A:B]"},
    {"train-tokenizer", marrow::train_tokenizer_command, "train a byte-level BPE tokenizer.json on raw text"},
    {"tokenize", marrow::tokenize_command, "tokenize raw text (txt, jsonl, jsonl.zst) into a training corpus"},
    {"export", marrow::export_command, "export a checkpoint as a Hugging Face model: marrow export <checkpoint> <out-dir>"},
    {"import", marrow::import_command, "import a Hugging Face model as a checkpoint: marrow import <hf-dir> <checkpoint-dir>"},
    {"plot", marrow::plot_command, "plot loss against tokens seen for runs: marrow plot <run-dir>... [--out plot.svg]"},
    {"sample", marrow::sample_command, "continue a prompt: marrow sample <checkpoint-or-hf-dir> --prompt \"...\""},
    {"check", marrow::check_command, "compare every CUDA op and the model with the CPU reference (needs a GPU) [--only <group>]"},
    {"bench", marrow::bench_command, "measure training speed: marrow bench <run-config> [--warmup=N --steps=M] [--profile-steps=A:B] | --kernels"},
    {"estimate", marrow::estimate_command,
     "GPU memory per process, without a GPU: marrow estimate <run-config> [--section.key=value ...] [--world N] [--gpu-memory GiB] [--layouts]"},
};

void usage() {
  std::printf("marrow %s: training for Mixture-of-Experts language models\n\nusage: marrow <command> [args]\n\n", MARROW_VERSION);
  for (const Command& c : kCommands) std::printf("  %-16s %s\n", c.name, c.help);
}

}  // namespace

// A job of several processes (mpirun, srun; parallel/process.h): world rank 0 alone prints to
// stdout; an error on any rank names the rank and ends the whole job at once.
int main(int argc, char** argv) {
  marrow::process::start(&argc, &argv);
  if (marrow::process::rank() != 0 && !std::freopen("/dev/null", "w", stdout)) return 1;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    marrow::process::finish();
    return argc < 2 ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    int code = 1;
    // No exception leaves main: a library's (std::filesystem, std::thread, ...) becomes a sentence too.
    try {
      code = c.run(argc - 1, argv + 1);
    } catch (const std::exception& e) {
      if (marrow::process::size() > 1) {
        std::fprintf(stderr, "marrow %s: error on rank %d of %d: %s\n", c.name, marrow::process::rank(), marrow::process::size(), e.what());
        marrow::process::abort_job(1);
      }
      std::fprintf(stderr, "marrow %s: error: %s\n", c.name, e.what());
    }
    marrow::process::finish();
    return code;
  }
  std::fprintf(stderr, "marrow: unknown command '%s' (run 'marrow --help' for the list)\n", argv[1]);
  marrow::process::finish();
  return 2;
}
