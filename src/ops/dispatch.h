// Dispatch: group each token's K copies by expert so that every expert sees one contiguous block
// of rows (the permuted layout that the grouped GEMM runs on).
//   Copy (t, j), token t in top-k slot j, goes to row copy_row[t, j]. Rows are ordered by expert,
//   then token, then slot; expert e owns rows [expert_offsets[e], expert_offsets[e + 1]), so
//   expert_offsets[0] = 0, expert_offsets[E] = T * K, and copy_row is a permutation of [0, T * K).
// The plan is a counting sort: deterministic, and a pure function of topk_index. On the GPU the
// plan is the same stable counting sort in one block (at most 1,023 experts). expert_offsets may be a host tensor (the plan
// then waits for the stream to copy them back, and checks the indices) or, on the GPU, a device
// tensor: no wait, and the grouped GEMMs build their schedules from it on the device; the indices
// are then not checked (they come from the router's top-k).
//
// dispatch_forward/backward (and combine) take any copy_row[T, K] (i32) and rows tensor [R, H]
// with R >= 0, of which the plan's (R = T * K, a permutation) is one case. Expert parallelism
// hands them a rank's part of the plan: an entry is -1 when the copy is not here (another rank
// holds it), else a row in [0, R); no two entries name the same row. Rows that no entry names are
// neither read nor written. The CPU references check the entries (an error names the entry); the
// GPU kernels cannot without a sync, so a row outside [0, R) other than -1 is skipped by the
// forward and makes the backward's sum NaN.
#pragma once
#include <array>

#include "core/tensor.h"

namespace marrow {

// expert_offsets[E + 1] and copy_row[T, K] (both i32) from topk_index[T, K] (i32). An entry of -1
// is a copy that is not here (expert parallelism's receiver, parallel/expert_parallel.h): it gets
// copy_row -1 and no row, so expert_offsets[E] counts the other entries. Any other index outside
// [0, E) is an error (not detected when expert_offsets is in GPU memory: it is taken as -1 there).
void dispatch_plan(Tensor expert_offsets, Tensor copy_row, Tensor topk_index, Stream stream = {});

// x_perm[copy_row[t, j]] = x[t] for every entry other than -1: x_perm[R, H] from x[T, H]. GPU: bf16
// or f32 tensors (activations, or the routing weights [T, K] as rows of H = K).
void dispatch_forward(Tensor x_perm, Tensor x, Tensor copy_row, Stream stream = {});

// dx[t] = sum_j dx_perm[copy_row[t, j]] over the entries other than -1, summed in slot order j (f32
// on the GPU); a token whose entries are all -1 gets zeros. dx[T, H] is overwritten. GPU: bf16 or f32.
void dispatch_backward(Tensor dx, Tensor dx_perm, Tensor copy_row, Stream stream = {});

// The shapes dispatch and combine check: copy_row[T, K] (i32), tokens[T, H] and rows[R, H]; returns
// (T, K, H).
std::array<int64_t, 3> check_token_rows(const char* op, const char* tokens_name, const Tensor& tokens, const char* rows_name,
                                        const Tensor& rows, const Tensor& copy_row);

// The CPU check of copy_row[T, K] (host i32) against a rows tensor of `rows` rows: every entry is
// -1 or inside [0, rows); the error names op and the entry. Combine shares it.
void expect_copy_rows(const char* op, const Tensor& copy_row, int64_t rows);

}  // namespace marrow
