// The subcommands of the marrow binary; each takes (argc, argv) with argv[0] = the command name.
#pragma once

namespace marrow {

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
