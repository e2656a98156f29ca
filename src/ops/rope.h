// Rotary position embedding in the Hugging Face Qwen3 convention ("rotate_half"): within each head,
// element j < D/2 pairs with element j + D/2 and the pair is rotated by the angle
//   position * inv_freq_j,   inv_freq_j = 1 / theta^(2j / D),
//   y[j]       = x[j] * cos - x[j + D/2] * sin
//   y[j + D/2] = x[j + D/2] * cos + x[j] * sin.
// inv_freq, the angle and its cos/sin are computed in float32 exactly as transformers does, whatever
// the tensor dtype: at positions in the thousands a double-precision angle differs from the float32
// one by ~1e-3 rad, enough to break parity with the reference model. The rotation is orthogonal,
// so the backward is the rotation by the negative angle.
#pragma once
#include "core/tensor.h"

namespace marrow {

// y[T, H, D] from x[T, H, D] and positions[T] (i32); D must be even and theta positive. y may alias x.
void rope_forward(Tensor y, Tensor x, Tensor positions, double theta, Stream stream = {});

// dx[T, H, D], overwritten, from dy[T, H, D]. dx may alias dy.
void rope_backward(Tensor dx, Tensor dy, Tensor positions, double theta, Stream stream = {});

// table[T, D/2, 2] (f32): the cosine and sine of each position's angles, position * inv_freq_j, as
// the rotation computes them on that device (the GPU's from rope_cos_sin, the CPU's from std::cos
// and std::sin). rmsnorm_rope_forward / _backward read them from here when given one: a micro-batch
// computes them once for every layer's queries and keys, where each warp computed its token's again.
void rope_cos_sin_table(Tensor table, Tensor positions, int64_t head_dim, double theta, Stream stream = {});

// inv_freq_j for head_dim d, in transformers' float32 steps: arange(0, D, 2).float() / D, theta ** that,
// 1.0 / that. The GPU kernels take these very floats from the host (rmsnorm_rope_* too), so every
// path rotates by identical angles.
float rope_inverse_frequency(int64_t j, int64_t head_dim, double theta);

}  // namespace marrow
