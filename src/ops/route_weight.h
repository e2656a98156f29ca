// The routing weights' backward inside the experts, for a combine whose expert outputs are not kept.
// Combine adds w[t, j] * y[r] with y[r] = act[r] W_down^T (r = copy_row[t, j]); by linearity
//   d loss / d w[t, j] = dot(dout[t], y[r]) = dot(dout[t] W_down, act[r]) = dot(dact[r], act[r]),
// where dact[r] = dout[t] W_down is the down projection's input gradient of the unweighted copy.
// So a backward that feeds the experts the copies of dout unweighted (dispatch_forward of dout)
// needs act (the SwiGLU output, computed again there anyway), not y_perm (R x H, the largest
// activation a layer keeps with one expert-parallel rank: 512 MiB at 16,384 tokens). The weight
// then goes onto both factors of what follows: dact *= w (the SwiGLU's input gradient) and
// act *= w (so the down projection's weight gradient, dy^T act, sees the weighted copy).
// GPU: dact and act bf16, topk_weight and dtopk_weight f32.
#pragma once
#include "core/tensor.h"

namespace marrow {

// For each copy (t, j) with r = copy_row[t, j] != -1: dtopk_weight[t, j] = dot(dact[r], act[r]),
// then dact[r] *= topk_weight[t, j] and act[r] *= topk_weight[t, j] (in place). An entry of -1 gets
// dtopk_weight = 0. copy_row[T, K] (i32) names each row of dact[R, I] and act[R, I] at most once
// (dispatch's plan); rows no entry names are left as they are.
void route_weight_backward(Tensor dtopk_weight, Tensor dact, Tensor act, Tensor topk_weight, Tensor copy_row, Stream stream = {});

}  // namespace marrow
