// AdamW exactly as torch.optim.AdamW computes it, per element, with decoupled weight decay:
//   param *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g,   v = beta2 * v + (1 - beta2) * g^2
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// with g = grad * grad_scale (gradient clipping folded in: no separate pass over the gradients).
// The caller passes weight_decay = 0 for tensors that are not decayed (norms, biases). param, grad,
// exp_avg (m) and exp_avg_sq (v) are flat views of equal element count and one dtype: f32 (the
// master weights and moments), or f64 for tests. The moments may instead be bf16 (f32 param;
// optimizer.moments = "bf16", as DeepSeek-V3 keeps them): the step then computes in f32 (as torch's
// fused AdamW does; with fp32 moments it computes in double), each moment rounded to bf16 where it
// is stored and read back as stored. param_bf16, when given (a non-empty tensor of the
// same element count), receives the updated param rounded to bf16: the GPU's working weights,
// written in the same pass instead of a second read of param. Split master weights
// (core/split_f32.h; train.master_weights = "split") pass param as their u16 low halves and
// param_bf16 as their high halves: the step reads both and writes both, the same arithmetic on the
// fp32 value they hold.
// The two formulas (double with fp32 moments, f32 with bf16 ones) are each bit for bit between CPU
// and GPU (`marrow check --only elementwise`, rows "bf16 moments"). Keep the bf16 kernels' registers
// low: a two-float4 loop (80 registers) ran 12% slower. Checkpoint files hold the moments in their
// arena's dtype and loading converts (copy_converting, engine/checkpoint.cpp). GPU runs:
// tools/gpu_moments.sh <log-dir> [check|bench|long|curve|resume].
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;           // 1-based: the bias corrections divide by 1 - beta^step
  double grad_scale = 1;  // multiplies the gradient before anything else
};

// Updates param, exp_avg and exp_avg_sq in place from grad, and writes param_bf16 if it is given.
void adamw_step(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, const AdamWHyper& hyper,
                Stream stream = {});

// The same over E equal rows of the flat tensors (their element count a multiple of E), where row e
// of grad is all zeros when known_zero[e] (i32 [E], on the tensors' device) is set: those rows take
// g = 0 without reading grad (ops/known_zero.h: an expert's gradient, an embedding's rows). The bits
// of adamw_step over the same values.
void adamw_step_known_zero(Tensor param, Tensor param_bf16, Tensor exp_avg, Tensor exp_avg_sq, Tensor grad, Tensor known_zero,
                           const AdamWHyper& hyper, Stream stream = {});

}  // namespace marrow
