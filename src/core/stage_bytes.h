// What a model's stages hold on the device for one micro-batch, as the family reports it to the
// memory estimate (engine/memory_estimate.h; the engine's own buffers are not in here). For every
// stage: kept is what the forward stores in its activation struct (its input included), alive until
// the end of its backward; forward_scratch / backward_scratch the largest moment of temporaries the
// stage function allocates beyond kept (op scratch included), all freed before it returns.
#pragma once
#include <cstdint>

namespace marrow {

struct StageBytes {
  int64_t kept = 0, forward_scratch = 0, backward_scratch = 0;
  // Experts only: what the input-gradient half leaves for weight gradients that wait (beyond x_perm, dy_perm).
  int64_t held_for_weights = 0;
};

// The size of a model from its config alone (engine/memory_guard.h's first check), in double so an
// absurd config does not overflow on the way to its refusal: parameters and table entries.
// MemoryGuard.ModelSizeCountsWhatTheModelHolds compares it with the family's table.
struct ModelSize {
  double parameters = 0;
  double tensors = 0;
};

// The heads of a layer's attention op (the engine adds ring attention's bytes under context parallelism).
struct AttentionHeads {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
};

// attention and experts are one decoder layer's; the engine multiplies by the layer count.
struct ModelActivationBytes {
  StageBytes prolog, attention, experts, epilog;
  AttentionHeads attention_heads;
  int64_t chain_kept = 0;  // what stage 1 keeps besides under context parallelism (the SequenceChain's states)
};

}  // namespace marrow
