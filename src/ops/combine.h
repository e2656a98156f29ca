// Combine: each token's weighted sum of its K expert outputs, added to the residual stream.
//   out[t] = residual[t] + sum_j topk_weight[t, j] * y_perm[copy_row[t, j]]
// y_perm[R, H] is in dispatch's permuted layout and copy_row[T, K] (i32) is dispatch's plan or, under
// expert parallelism, a rank's part of it (ops/dispatch.h): an entry of -1 is a copy that is not
// here and contributes nothing, any other entry is a row in [0, R), no two the same. The CPU
// references check the entries; on the GPU a row outside [0, R) other than -1 makes the results
// that read it NaN.
#pragma once
#include "core/tensor.h"

namespace marrow {

// out[T, H]; out may alias residual[T, H] (the residual stream updated in place). residual may be
// an empty Tensor{} (no residual): then out is the weighted sum alone. A token whose entries are
// all -1 gets out = residual (zeros without one).
void combine_forward(Tensor out, Tensor residual, Tensor y_perm, Tensor topk_weight, Tensor copy_row, Stream stream = {});

// dy_perm[copy_row[t, j]] = topk_weight[t, j] * dout[t] and dtopk_weight[t, j] =
// dot(dout[t], y_perm[copy_row[t, j]]), both overwritten; an entry of -1 gets dtopk_weight = 0
// and writes no row, and rows no entry names are left as they are. The residual's gradient is dout
// itself, which the caller uses as is.
void combine_backward(Tensor dy_perm, Tensor dtopk_weight, Tensor dout, Tensor y_perm, Tensor topk_weight, Tensor copy_row,
                      Stream stream = {});

}  // namespace marrow
