// The first check of a run, before anything is allocated: can the training state fit at all?
// A config of absurd size (num_experts = 1e9) would otherwise grow the parameter table and the
// arenas until the kernel kills the process without a word. This is a floor, not the bill
// (`marrow estimate` has that): the fp32 state spread as thinly as any layout could spread it, so a
// refusal is always right and a run that passes may still not fit.
#pragma once
#include <cstdint>

#include "core/memory.h"

namespace marrow {

struct ModelSize {
  double parameters = 0;  // in double: an absurd config must not overflow on the way to its refusal
  double tensors = 0;     // entries of the parameter table, which every process holds whole
};

// The size of a decoder of MoE layers from its config (the fields of the families in src/models/):
// embeddings and LM head, per layer attention, router, experts and norms.
template <class Config> ModelSize model_size(const Config& c) {
  const double H = double(c.hidden_size), D = double(c.head_dim), E = double(c.num_experts), L = double(c.num_layers);
  const double attention = H * D * (2.0 * double(c.num_heads) + 2.0 * double(c.num_kv_heads));
  const double layer = attention + E * H + 3.0 * E * H * double(c.expert_intermediate_size) + 2.0 * H + 2.0 * D;
  return {L * layer + 2.0 * double(c.vocab_size) * H + H, L * (9.0 + 3.0 * E) + 3.0};
}

// Fails with the numbers when the parameter table (host memory) or the training state (fp32 weights
// and gradients, two AdamW moments of moment_bytes each: 16 bytes per parameter, 12 with bf16
// moments) over `processes` exceed the memory that holds them: the machine's for the table and CPU
// runs, the GPU's for GPU runs (when it can be read).
void check_state_fits(const ModelSize& size, int64_t processes, Device device, int gpu, int moment_bytes = 4);

}  // namespace marrow
