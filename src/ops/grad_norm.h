// The norm of global gradient-norm clipping. Gradients live in one flat arena, so the engine takes
// the norm of the whole arena (or, later, combines per-rank sums of squares); the scaling by
// min(1, max_norm / norm) happens inside the AdamW step (AdamWHyper::grad_scale).
//
// The sums can also stay on the device in parts (kSumParts f64 per piece of the gradients, a fixed
// partition of each piece), so that several pieces, and sums of squares a kernel wrote while
// producing a gradient (grouped_linear_backward_weight's squares), are added with one wait for
// the stream (sum_parts_on_host).
#pragma once
#include "core/tensor.h"

namespace marrow {

// sqrt(sum x^2), accumulated in double in index order, so the result is deterministic. A NaN or
// Inf in x gives a NaN or Inf norm, which the caller must see rather than a clipped-away step. On
// the GPU (f32) the order is a fixed tree instead, and the call waits for the stream.
// l2_norm(x) == sqrt(sum_parts_on_host(parts)) after sum_squares_parts(parts, x).
double l2_norm(Tensor x, Stream stream = {});

constexpr int64_t kSumParts = 1024;
// parts (f64 [kSumParts], on x's device) = the parts of sum x^2 (x f32; on the CPU also f64): on
// the GPU block b's sum of a fixed grid-stride partition, on the CPU the whole sum in parts[0] and
// zeros after it. Does not wait.
void sum_squares_parts(Tensor parts, Tensor x, Stream stream = {});
// Rows of x known to be zeros (ops/known_zero.h): elements [begin, begin + flags.numel() * per_row)
// of x are flags.numel() rows of per_row elements, row r all +0.0 where flags[r] (i32) is set.
struct KnownZeroRows {
  Tensor flags;
  int64_t begin = 0, per_row = 0;
};
// sum_squares_parts that does not read the flagged rows: the same parts, bit for bit (a zero row
// adds +0.0 to its partial sums wherever it falls in the partition).
void sum_squares_parts(Tensor parts, Tensor x, const KnownZeroRows& known, Stream stream = {});
// The same for the plain sum of values (x f64): sums of squares computed elsewhere.
void sum_values_parts(Tensor parts, Tensor x, Stream stream = {});
// The sum of all parts (f64, any multiple of kSumParts), added on the host in index order after
// one copy (the call waits for the stream).
double sum_parts_on_host(Tensor parts, Stream stream = {});

}  // namespace marrow
