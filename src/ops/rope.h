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
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace marrow {

// y[T, H, D] from x[T, H, D] and positions[T] (i32); D must be even and theta positive. y may alias x.
void rope_forward(Tensor y, Tensor x, Tensor positions, double theta, Stream stream = {});

// dx[T, H, D], overwritten, from dy[T, H, D]. dx may alias dy.
void rope_backward(Tensor dx, Tensor dy, Tensor positions, double theta, Stream stream = {});

// Partial rotation (Qwen3.5's partial_rotary_factor; its mrope sections, with the three position
// rows equal for text, are this plain rotation): the first rotary_dim elements of each head rotate as
// a head of rotary_dim would (pairs j, j + rotary_dim/2; inv_freq_j = 1 / theta^(2j / rotary_dim)),
// the other D - rotary_dim pass through unchanged. rotary_dim is even, positive and at most D; at D
// these are the overloads above, bit for bit. y may alias x.
void rope_forward(Tensor y, Tensor x, Tensor positions, double theta, int64_t rotary_dim, Stream stream = {});
void rope_backward(Tensor dx, Tensor dy, Tensor positions, double theta, int64_t rotary_dim, Stream stream = {});

// Rotary frequencies of Hugging Face's rope_parameters: "default" (theta^(-2j/D)) or "yarn".
// YaRN (transformers' _compute_yarn_parameters; GPT-OSS: theta 150000, factor 32, beta_fast 32,
// beta_slow 1, original_max_positions 4096, truncate false) blends, per pair j, the default
// frequency p_j^-1 (p_j = theta^(2j/D)) with the interpolated one (factor * p_j)^-1:
//   low/high = D ln(original_max_positions / (2 pi beta_fast/beta_slow)) / (2 ln theta),
//              floored/ceiled when truncate, then clipped to [0, D - 1]
//   ramp_j = clamp((j - low) / (high - low), 0, 1)   (high + 0.001 when low == high)
//   e_j = 1 - ramp_j,  inv_freq_j = (factor p_j)^-1 (1 - e_j) + p_j^-1 e_j
// and multiplies cos and sin by attention_factor, 0.1 ln(factor) + 1 when not given (1 for
// factor <= 1). rope_parameters' mscale / mscale_all_dim (DeepSeek's attention factor) and
// partial_rotary_factor have no field here: a config that sets them is not one of these.
struct RopeParameters {
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0, beta_fast = 32.0, beta_slow = 1.0, attention_factor = 0.0;  // attention_factor 0: HF's default for yarn
  int64_t original_max_positions = 0;
  bool truncate = true;
};

// inv_freq[j], j < D/2, in float as Hugging Face computes them (match torch's float32 arithmetic where it matters), and the scale applied to cos and sin.
// Python's steps (low, high, their span, the attention factor) run in double, torch's (j - low,
// the ramp, the blend) in float32 with the doubles rounded to float where they meet the tensors.
// theta^(2j/D) is rope_inverse_frequency's std::pow, correctly rounded; torch's vectorized float
// pow (Sleef) is not always, so an entry can differ from transformers' by an ulp (GPT-OSS: j = 6
// and 10, 1e-7 relative), which turns into ~1e-3 rad of angle at position 131071. With such a pow
// in transformers' function, the results are its bits.
std::vector<float> rope_inverse_frequencies(int64_t head_dim, const RopeParameters& rope);
double rope_attention_scaling(const RopeParameters& rope);

// rope_forward / rope_backward above with rope's frequencies, cos and sin each float32
// cos(angle) * float(rope_attention_scaling(rope)) as transformers' GPT-OSS rotary embedding
// computes them; the backward is the transpose (the rotation by -angle, scaled the same). Without
// yarn: the theta overloads, bit for bit, on either device. The GPU takes these very inv_freq and
// scale from the host and multiplies its f32 cos and sin by the scale (when it is not 1).
void rope_forward(Tensor y, Tensor x, Tensor positions, const RopeParameters& rope, Stream stream = {});
void rope_backward(Tensor dx, Tensor dy, Tensor positions, const RopeParameters& rope, Stream stream = {});

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
