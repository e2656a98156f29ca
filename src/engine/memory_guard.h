// The first check of a run, before anything is allocated: can the training state fit at all? (An
// absurd config would otherwise grow the table and arenas until the kernel kills the process.) A
// floor, not the bill: the fp32 state spread as thinly as any layout could, so a refusal is always
// right.
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "core/stage_bytes.h"

namespace marrow {

// Fails with the numbers when the parameter table (host memory) or the training state (16 bytes a
// parameter, 12 with bf16 moments) over `processes` exceed the machine's or the GPU's memory.
void check_state_fits(const ModelSize& size, int64_t processes, Device device, int gpu, int moment_bytes = 4);

}  // namespace marrow
