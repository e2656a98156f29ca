// The first check of a run, before anything is allocated: can the training state fit at all?
// A config of absurd size (num_experts = 1e9) would otherwise grow the parameter table and the
// arenas until the kernel kills the process without a word. This is a floor, not the bill
// (`marrow estimate` has that): the fp32 state spread as thinly as any layout could spread it, so a
// refusal is always right and a run that passes may still not fit.
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "core/stage_bytes.h"

namespace marrow {

// Fails with the numbers when the parameter table (host memory) or the training state (fp32 weights
// and gradients, two AdamW moments of moment_bytes each: 16 bytes per parameter, 12 with bf16
// moments) over `processes` exceed the memory that holds them: the machine's for the table and CPU
// runs, the GPU's for GPU runs (when it can be read).
void check_state_fits(const ModelSize& size, int64_t processes, Device device, int gpu, int moment_bytes = 4);

}  // namespace marrow
