// Gradients whose rows are flagged as known to be all zeros: i32 flags, one per row of a gradient
// seen as [rows, per_row]; flags[r] set means row r holds +0.0 everywhere. Whoever writes a row
// clears its flag (embedding_backward's row flags; grouped_linear's expert flags keep their own
// rule), and the readers may then skip flagged rows without changing a bit of what they compute
// (adamw_step_known_zero, sum_squares_parts with KnownZeroRows). The flags live with the gradient
// from step to step; all clear is always a valid state (nothing known).
// Anything else that writes the embedding gradient must clear the flags of the rows it writes;
// Qwen3Moe.KnownZeroEmbeddingRowsKeepTheBits catches a path that does not. start_step(known)
// restarts the gradient by rows (restart_known_zero), embedding_backward clears its tokens' rows,
// and the gradient norm (sum_squares_parts with KnownZeroRows) and AdamW skip flagged rows.
#pragma once
#include "core/tensor.h"

namespace marrow {

// Before a step's first backward writes grad (f32, flags.numel() equal rows): zeroes the rows whose
// flag is clear and sets every flag, so the gradient is all zeros at the cost of the rows written
// since the last restart, not of the whole tensor (an embedding's gradient: the step's tokens).
void restart_known_zero(Tensor grad, Tensor flags, Stream stream = {});

}  // namespace marrow
