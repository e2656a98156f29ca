// Elementwise sum, out = a + b, for residual connections and for summing the gradients of a
// residual branch. Only element counts must match, so a [tokens, hidden] activation can be added to
// the same memory seen as [batch, seq, hidden].
#pragma once
#include "core/tensor.h"

namespace marrow {

// out may alias a or b: each element is read before it is written.
void add(Tensor out, Tensor a, Tensor b, Stream stream = {});

// acc += x elementwise, acc f32 and x f32 or bf16 (read as f32), equal element counts: bf16 partial
// results summed in f32 (cuDNN's query-chunked attention backward, ops/attention_cudnn.h).
void add_into(Tensor acc, Tensor x, Stream stream = {});

}  // namespace marrow
