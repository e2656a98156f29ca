// Gated DeltaNet's output norm (transformers' Qwen3_5MoeRMSNormGated, norm before gate), per row of D:
//   rstd = 1 / sqrt(mean(x^2) + eps),   y = weight * round(x * rstd) * silu(z)
// On the GPU torch's bf16 roundings: x * rstd to bf16 (hidden_states.to(input_dtype)), its product
// with the bf16 weight to bf16 (a bf16 tensor op), that times silu(z) in f32, rounded to y. The
// backward is the exact f32 derivative at the bf16 inputs (nothing rounded between), one rounding
// a result. GPU: bf16 x, z, weight, y, dx, dz; f32 rstd, dweight. CPU: f32 or f64 (no rounding).
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[N, D], rstd[N] from x[N, D], z[N, D] and weight[D].
void gated_rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor z, Tensor weight, double eps, Stream stream = {});

// dx[N, D] and dz[N, D] overwritten, dweight[D] accumulated (+=) from dy[N, D]; dx and dz alias
// none of dy, x, z (dweight's pass reads them after dx is written).
void gated_rmsnorm_backward(Tensor dx, Tensor dz, Tensor dweight, Tensor dy, Tensor x, Tensor z, Tensor weight, Tensor rstd,
                            Stream stream = {});

}  // namespace marrow
