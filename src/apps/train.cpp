#include "apps/commands.h"
#include "core/errors.h"

namespace marrow {

int train_command(int, char**) { fail("train: not built yet"); }

}  // namespace marrow
