// The expert linear layer (grouped GEMM): rows [expert_offsets[e], expert_offsets[e + 1]) of x
// belong to expert e and use its weight in Hugging Face's layout [O, I]:
//   y[r, :] = weight[e] @ x[r, :]   (y = x W_e^T per group)
// The groups are consecutive, cover all R rows, and may be empty (an expert no token chose).
// expert_offsets[E + 1] is i32, on the host, or on the GPU when the data is there: the wgmma kernels
// then build their tile schedules on the device, so nothing waits for the GPU (the offsets are not
// checked then); cuBLAS's grouped call copies them to the host first.
// GPU: x, weight, y, dy, dx bf16; dweight f32. Forward and backward_input run an own Hopper kernel
// (ops/wgmma.cuh: TMA + wgmma, fp32 accumulation, persistent tiles of 128 rows x 256 columns of one
// expert; 2.1x cuBLAS's grouped call at the bench shapes) when O and I are multiples of 8 and the
// tensors 16-byte aligned (TMA's rule), else a plain one-thread-per-output kernel (odd test shapes).
// cublasGemmGroupedBatchedEx (SM80 mma.sync inside) stays selectable for comparisons
// (set_grouped_gemm_backend). backward_weight runs an own Hopper kernel too (ops/wgmma_dw.cuh: TMA +
// wgmma with both operands transposed, persistent tiles of 128 x 256 of one expert's dW, each summed
// over the expert's rows in order by one block, read-modify-write of the fp32 gradient from
// registers) under the same shape rule, else a plain one-thread-per-dW-element kernel. All of them
// are deterministic (no atomics on data).
// The pair kernel must stay the two calls' bits: accumulators start from the old dW, then the first
// source's k-steps, then the second's. A dW kernel that sums first and adds the old value later
// breaks marrow check's "pair = two calls" rows and the reference losses.
#pragma once
#include "core/tensor.h"

namespace marrow {

class Buffer;

// The kernel behind the GPU forward and backward_input where O and I are multiples of 8: the own
// wgmma kernel (the default) or cuBLAS's grouped call (`marrow bench --kernels` times both). For the
// whole process; set it before a run, not while other threads call the ops.
enum class GroupedGemmBackend { wgmma, cublas };
void set_grouped_gemm_backend(GroupedGemmBackend backend);
// The most experts the wgmma kernel serves (each block keeps their first tiles in shared memory,
// beside its stages); more experts run on cuBLAS's grouped call.
constexpr int64_t kWgmmaMaxExperts = 479;

// y[R, O] from x[R, I] and weight[E, O, I].
void grouped_linear_forward(Tensor y, Tensor x, Tensor weight, Tensor expert_offsets, Stream stream = {});

// dx[R, I] = dy W_e per group, overwritten.
void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor weight, Tensor expert_offsets, Stream stream = {});

// dweight[e] += dy_e^T x_e, accumulated (+=) as every weight gradient in Marrow is; an expert with
// no rows leaves its slice untouched. overwrite = true writes dweight[e] = dy_e^T x_e instead (zero
// for an expert without rows): the first micro-batch of a step, which saves zeroing the expert
// gradients and reading those zeros back.
//
// squares (f64 [grouped_weight_squares_count(E, O, I)]), when given, receives sums of squares of
// the resulting dweight, so that the gradient norm need not read the expert gradients again:
// expert e's [O, I] is cut into bands of kSquaresBandRows rows x kSquaresBandCols columns (the last
// ones cut at O and I), band (b, c) at e * ceil(O / 16) * ceil(I / 256) + b * ceil(I / 256) + c.
// The bands of every expert the call writes (every expert when overwriting, else those with rows)
// are set from its new dweight; an expert the call leaves alone keeps its bands (the GPU's other
// paths set them again from the same dweight). So when every call of a step passes the same
// squares and the first overwrites, after the last call they describe the final gradient without
// any extra read. The GPU computes a band in the wgmma kernel's epilogue (groups of 8 squares added
// in f32, the groups in f64) and the CPU in f64 in row-major order: they agree to about 1e-7
// relative, and each is deterministic.
//
// known_zero (i32 [E], on dweight's device), when given, records which experts' dweight is all zeros,
// so that an overwriting call need not write those zeros again: it skips an expert without rows
// whose flag is set (the caller's promise: nothing else wrote that slice since), writes zeros where
// it is not, and leaves the flag set exactly for the experts without rows; an accumulating call
// clears the flags of the experts with rows. Start it at zero (nothing known). The results are the
// same bits either way; under an untrained router most experts of a layer get no rows, and their
// zeros were most of an overwriting call's stores.
constexpr int64_t kSquaresBandRows = 16, kSquaresBandCols = 256;
int64_t grouped_weight_squares_count(int64_t experts, int64_t o, int64_t i);
void grouped_linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, bool overwrite = false,
                                    Tensor squares = {}, Tensor known_zero = {}, Stream stream = {});

// Two micro-batches' rows at once: the same, bit for bit, as grouped_linear_backward_weight of
// `first` (with overwrite) followed by that of `second` (accumulating), both with squares. On the
// GPU one pass of the wgmma kernel, each tile summing first's rows then second's in the k-steps the
// two calls would run: dweight is read and written once instead of twice, the traffic that bounds
// the kernel at the bench shapes (elsewhere, and on the CPU, the two calls). The offsets of both
// must be on the same device.
struct ExpertRows {
  Tensor dy, x, expert_offsets;
};
void grouped_linear_backward_weight_pair(Tensor dweight, const ExpertRows& first, const ExpertRows& second, bool overwrite = false,
                                         Tensor squares = {}, Tensor known_zero = {}, Stream stream = {});

// For the other grouped ops (ops/grouped_linear_fp8.h): the checks of expert_offsets above (on the
// host: from 0 to rows, not decreasing), and the offsets in GPU memory, uploaded in stream order into
// holder when they are on the host (GPU builds only).
void check_expert_offsets(const char* op, const Tensor& expert_offsets, int64_t experts, int64_t rows);
const int32_t* expert_offsets_on_device(Tensor expert_offsets, Buffer& holder, Stream stream);

}  // namespace marrow
