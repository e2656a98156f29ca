// Combine: each token's weighted sum of its K expert outputs, added to the residual stream.
//   out[t] = residual[t] + sum_j topk_weight[t, j] * y_perm[copy_row[t, j]]
// y_perm[T * K, H] is in dispatch's permuted layout and copy_row[T, K] (i32) is dispatch's plan.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out[T, H]; out may alias residual[T, H] (the residual stream updated in place).
void combine_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream = {});

// dy_perm[copy_row[t, j]] = topk_weight[t, j] * dout[t] and dtopk_weight[t, j] =
// dot(dout[t], y_perm[copy_row[t, j]]), both overwritten. The residual's gradient is dout itself,
// which the caller uses as is.
void combine_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, Tensor y_perm, Tensor topk_weight, Tensor copy_row,
                      Stream stream = {});

}  // namespace marrow
