// The norm of global gradient-norm clipping. Gradients live in one flat arena, so the engine takes
// the norm of the whole arena (or, later, combines per-rank sums of squares); the scaling by
// min(1, max_norm / norm) happens inside the AdamW step (AdamWHyper::grad_scale).
#pragma once
#include "core/tensor.h"

namespace marrow {

// sqrt(sum x^2), accumulated in double in index order, so the result is deterministic. A NaN or
// Inf in x gives a NaN or Inf norm, which the caller must see rather than a clipped-away step. On
// the GPU (f32) the order is a fixed tree instead, and the call waits for the stream.
double l2_norm(Tensor x, Stream stream = {});

}  // namespace marrow
