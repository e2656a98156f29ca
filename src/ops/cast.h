// Casts between floating dtypes, element by element: f32 <-> bf16 (round to nearest even) and
// f32 <-> f64. Used to make the bf16 working copy of weights and to move data between the fp32
// CPU reference and the bf16 GPU path. split_f32 / join_f32 convert fp32 master weights to and from
// their split form (core/split_f32.h): bf16 high halves and u16 low halves.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out and in have equal element counts (shapes may differ) and live on the same device.
void cast(Tensor out, Tensor in, Stream stream = {});

// high (bf16), low (u16) <- value (f32); join_f32 the reverse. All of one element count and device.
void split_f32(Tensor high, Tensor low, Tensor value, Stream stream = {});
void join_f32(Tensor value, Tensor high, Tensor low, Stream stream = {});

}  // namespace marrow
