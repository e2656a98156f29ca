// The subcommands of the marrow binary; each takes (argc, argv) with argv[0] = the command name.
#pragma once

namespace marrow {

int train_command(int argc, char** argv);

}  // namespace marrow
