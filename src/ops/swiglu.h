// SwiGLU, the expert MLP's activation, on the fused gate/up projection:
//   gate_up[R, 2I] holds gate in columns [0, I) and up in [I, 2I);  out = silu(gate) * up,
//   silu(g) = g * sigmoid(g).
// The backward recomputes the activation from gate_up, so the forward saves nothing.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out[R, I] from gate_up[R, 2I].
void swiglu_forward(Tensor out, Tensor gate_up, Stream stream = {});

// dgate_up[R, 2I] (overwritten) from dout[R, I]:
//   dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dout * silu(g).
void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, Stream stream = {});

}  // namespace marrow
