// Elementwise sum, out = a + b, for residual connections and for summing the gradients of a
// residual branch. Only element counts must match, so a [tokens, hidden] activation can be added to
// the same memory seen as [batch, seq, hidden].
#pragma once
#include "core/tensor.h"

namespace marrow {

// out may alias a or b: each element is read before it is written.
void add(Tensor out, Tensor a, Tensor b, Stream stream = {});

}  // namespace marrow
