// Dispatch: group each token's K copies by expert so that every expert sees one contiguous block
// of rows (the permuted layout that the grouped GEMM runs on).
//   Copy (t, j), token t in top-k slot j, goes to row copy_row[t, j]. Rows are ordered by expert,
//   then token, then slot; expert e owns rows [expert_offsets[e], expert_offsets[e + 1]), so
//   expert_offsets[0] = 0, expert_offsets[E] = T * K, and copy_row is a permutation of [0, T * K).
// The plan is a counting sort: deterministic, and a pure function of topk_index. On the GPU the
// plan is a stable radix sort with the same result; expert_offsets stays a host tensor, so
// dispatch_plan waits for the stream (the one sync per layer the grouped GEMM needs).
#pragma once
#include "core/tensor.h"

namespace marrow {

// expert_offsets[E + 1] and copy_row[T, K] (both i32) from topk_index[T, K] (i32). An expert
// index outside [0, E) is an error.
void dispatch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream = {});

// x_perm[copy_row[t, j]] = x[t]: x_perm[T * K, H] from x[T, H].
void dispatch_forward(Tensor x_perm, Tensor x, Tensor copy_row, Stream stream = {});

// dx[t] = sum_j dx_perm[copy_row[t, j]], summed in slot order j; dx[T, H] is overwritten.
void dispatch_backward(Tensor dx, Tensor dx_perm, Tensor copy_row, Stream stream = {});

}  // namespace marrow
