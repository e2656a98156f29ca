// Casts between floating dtypes, element by element: f32 <-> bf16 (round to nearest even) and
// f32 <-> f64. Used to make the bf16 working copy of weights and to move data between the fp32
// CPU reference and the bf16 GPU path.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out and in have equal element counts (shapes may differ) and live on the same device.
void cast(Tensor out, Tensor in, Stream stream = {});

}  // namespace marrow
