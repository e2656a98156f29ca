// Token embedding lookup, the prolog of every model: out[t, :] = table[ids[t], :].
// Its backward scatters rows back into the table; repeated ids sum their gradients, in token order,
// so the result is deterministic.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out[T, H] from ids[T] (i32) and table[V, H]. An id outside [0, V) is an Error naming the id and
// its position, checked before anything is written. On the GPU (table, out bf16; dtable f32) ids
// stay on the device unchecked: a bad id gives a NaN row and is skipped by the backward.
void embedding_forward(Tensor out, Tensor ids, Tensor table, Stream stream = {});

// dtable[V, H] is accumulated (+=), as every weight gradient in Marrow is; dout is [T, H].
// known_zero (i32 [V], ops/known_zero.h), when given: the flags of dtable's rows known to be zeros;
// the rows this call adds to have theirs cleared (a flagged row's old value is not read: it is zero).
void embedding_backward(Tensor dtable, Tensor dout, Tensor ids, Tensor known_zero = {}, Stream stream = {});

}  // namespace marrow
