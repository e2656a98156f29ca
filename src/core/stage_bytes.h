// What a model's stages hold on the device for one micro-batch, as the model family reports it to
// the memory estimate (engine/memory_estimate.h). The engine's own buffers between the stages
// (the residual gradient, dispatch/combine rows, expert-parallel exchanges) are not in here: the
// engine knows them from step.h.
//
// Invariants the estimate relies on, for every stage:
// - kept: what the forward stores in the stage's activation struct (its input included, e.g. the
//   residual stream a layer's attention keeps); alive from the stage's forward to the end of its
//   backward.
// - forward_scratch / backward_scratch: the largest moment of temporaries the stage function
//   allocates beyond kept (op-internal scratch included), all freed before it returns.
#pragma once
#include <cstdint>

namespace marrow {

struct StageBytes {
  int64_t kept = 0, forward_scratch = 0, backward_scratch = 0;
  // Experts only: what the input-gradient half of the backward leaves for the weight gradients
  // when they wait (a pipeline's deferred W, a micro-batch paired with the next), beyond the
  // engine's x_perm and dy_perm.
  int64_t held_for_weights = 0;
};

// The size of a model from its config alone (Config::model_size, before the parameter table exists:
// the memory guard's first check, engine/memory_guard.h), in double so that an absurd config does not
// overflow on the way to its refusal: parameters, and entries of the parameter table (which every
// process holds whole). It repeats the family's table arithmetic; MemoryGuard.ModelSizeCountsWhatTheModelHolds
// compares the two.
struct ModelSize {
  double parameters = 0;
  double tensors = 0;
};

// The heads of a layer's causal attention op: with context parallelism the engine adds the bytes
// of ring attention (parallel/ring_attention.h) that replaces the op.
struct AttentionHeads {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
};

// attention and experts are one decoder layer's; the engine multiplies by the layer count.
struct ModelActivationBytes {
  StageBytes prolog, attention, experts, epilog;
  AttentionHeads attention_heads;
};

}  // namespace marrow
