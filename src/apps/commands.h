// The subcommands of the marrow binary; each takes (argc, argv) with argv[0] = the command name.
#pragma once
#include <CLI/CLI.hpp>

namespace marrow {

// Parses the command line into app: the exit code when that ends the command (--help 0, a bad
// argument 2), else -1.
inline int parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return -1;
}

int train_command(int argc, char** argv);
int train_tokenizer_command(int argc, char** argv);
int tokenize_command(int argc, char** argv);
int export_command(int argc, char** argv);
int import_command(int argc, char** argv);
int sample_command(int argc, char** argv);
int check_command(int argc, char** argv);
int bench_command(int argc, char** argv);
int estimate_command(int argc, char** argv);
int plot_command(int argc, char** argv);

}  // namespace marrow
