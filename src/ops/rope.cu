#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr int64_t kMaxHalfHost = 256;  // the GPU kernels' inv_freq argument holds D/2 <= 256
constexpr double kPi = 3.141592653589793;  // Python's math.pi

// theta^(2j / D) in transformers' float32 steps: arange(0, D, 2).float() / D, then theta ** that.
float position_frequency(int64_t j, int64_t head_dim, double theta) {
  return std::pow(float(theta), float(2 * j) / float(head_dim));
}

// Rotates the first 2 half = 2 inv_freq.size() elements of every head of every token by +angle
// (sign 1) or -angle (sign -1), cos and sin times scale in float32 (a scale of 1 leaves them as they
// are), and copies the rest. Each pair is read into locals before it is written, which is what lets
// the output alias the input.
template <typename T>
void rotate_cpu(T* y, const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t d,
                const std::vector<float>& inv_freq, float scale, int sign) {
  const int64_t half = int64_t(inv_freq.size());
  std::vector<T> cosines(half), sines(half);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      float angle = float(positions[t]) * inv_freq[j];
      cosines[j] = T(std::cos(angle) * scale);
      sines[j] = T(sign * (std::sin(angle) * scale));
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * d;
      for (int64_t j = 0; j < half; ++j) {
        T a = x[base + j], b = x[base + j + half];
        y[base + j] = a * cosines[j] - b * sines[j];
        y[base + j + half] = b * cosines[j] + a * sines[j];
      }
      for (int64_t j = 2 * half; j < d; ++j) y[base + j] = x[base + j];
    }
  }
}

#ifdef __CUDACC__
constexpr int kMaxHalf = int(kMaxHalfHost);  // head_dim up to 512: inv_freq travels as a kernel argument

struct InvFreq {
  float v[kMaxHalf];
};

// One thread per N adjacent slots j of one head of one token (N = 8 when half and D/2 are multiples
// of 8 and the data is 16-byte aligned, else 1), grid-stride over T * H * slots / N; half is
// rotary_dim / 2. Slot j < half rotates the pairs (j, j + half); slot j in [half, D/2) copies the
// passed-through elements [2j, 2j + 2N) (slots = half when y is x: nothing to copy). The angle is
// float(position) * inv_freq[j] in f32 and its cos/sin are the precise cosf/sinf, as on the CPU
// (rope_rotate, ops/cuda_common.cuh). Scaled (YaRN's attention factor other than 1): cos and sin
// each times scale in f32, as the CPU's cos * scale; the unscaled instances are the plain rotation.
// Each thread reads both halves of its pairs before writing them, so y may alias x.
template <int N, bool Scaled>
__global__ void rope_rotate_kernel(bf16* y, const bf16* x, const int32_t* positions, InvFreq inv_freq, int64_t tokens, int64_t heads,
                              int64_t half, int64_t d, int64_t slots, float sign, float scale) {
  begin_after_previous_grid();
  const int64_t per_head = slots / N;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < tokens * heads * per_head;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t head = p / per_head, j = p % per_head * N, base = head * d;
    if (j >= half) {
      for (int64_t e = base + 2 * j; e < base + 2 * (j + N); e += N) store<N>(y + e, load<N>(x + e));
      continue;
    }
    const float position = float(positions[head / heads]);
    const Pack<bf16, N> a = load<N>(x + base + j), b = load<N>(x + base + half + j);
    Pack<bf16, N> ya, yb;
#pragma unroll
    for (int l = 0; l < N; ++l) {
      float2 o;
      if constexpr (Scaled) {
        const float2 cs = rope_cos_sin(position, inv_freq.v[j + l], sign);
        o = rope_apply(float(a.v[l]), float(b.v[l]), make_float2(__fmul_rn(cs.x, scale), __fmul_rn(cs.y, scale)));
      } else {
        o = rope_rotate(float(a.v[l]), float(b.v[l]), position, inv_freq.v[j + l], sign);
      }
      ya.v[l] = bf16(o.x);
      yb.v[l] = bf16(o.y);
    }
    store<N>(y + base + j, ya);
    store<N>(y + base + half + j, yb);
  }
}

// One thread per (token, j): table[t, j] = (cos, sin) of positions[t] * inv_freq[j], rope_cos_sin's bits.
__global__ void rope_cos_sin_table_kernel(float2* table, const int32_t* positions, InvFreq inv_freq, int64_t tokens, int64_t half) {
  begin_after_previous_grid();
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= tokens * half) return;
  table[i] = rope_cos_sin(float(positions[i / half]), inv_freq.v[i % half], 1.0f);
}

// inv_freq [rotary_dim / 2] and scale as rope_inverse_frequencies and rope_attention_scaling give them: the CPU's very floats.
void launch_rotate(Tensor y, Tensor x, Tensor positions, const std::vector<float>& frequencies, float scale, int sign, Stream stream) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = int64_t(frequencies.size());
  const int64_t slots = y.data == x.data ? half : d / 2;
  InvFreq inv_freq{};
  std::copy(frequencies.begin(), frequencies.end(), inv_freq.v);
  const bool packed = packable(half, {x.data, y.data}) && (d / 2) % 8 == 0;
  const int64_t work = tokens * heads * (packed ? slots / 8 : slots);
  if (work == 0) return;
  auto* kernel = scale != 1.0f ? (packed ? rope_rotate_kernel<8, true> : rope_rotate_kernel<1, true>)
                               : (packed ? rope_rotate_kernel<8, false> : rope_rotate_kernel<1, false>);
  launch_dependent(kernel, grid_stride_blocks(work, 256, 8192), 256, 0, stream, bf16_ptr(y), bf16_ptr(x), positions.ptr<int32_t>(), inv_freq,
                   tokens, heads, half, d, slots, float(sign), scale);
}

void launch_table(Tensor table, Tensor positions, int64_t head_dim, double theta, Stream stream) {
  const int64_t tokens = positions.size(0), half = head_dim / 2;
  if (tokens == 0) return;
  InvFreq inv_freq{};
  for (int64_t j = 0; j < half; ++j) inv_freq.v[j] = rope_inverse_frequency(j, head_dim, theta);
  launch_dependent(rope_cos_sin_table_kernel, unsigned((tokens * half + 255) / 256), 256, 0, stream, static_cast<float2*>(table.data),
                   positions.ptr<int32_t>(), inv_freq, tokens, half);
}
#endif

// The YaRN fields are read only with yarn set; the logarithms of theta, the betas and the original
// context length must be finite and ln theta nonzero.
void check_rope(const char* op, const RopeParameters& rope) {
  MARROW_CHECK(rope.theta > 0, "{}: theta must be positive, got {}", op, rope.theta);
  if (!rope.yarn) return;
  MARROW_CHECK(rope.theta != 1, "{}: yarn needs a theta other than 1 (its correction range divides by ln theta)", op);
  MARROW_CHECK(rope.factor > 0, "{}: the yarn factor must be positive, got {}", op, rope.factor);
  MARROW_CHECK(rope.beta_fast > 0 && rope.beta_slow > 0, "{}: yarn's beta_fast and beta_slow must be positive, got {} and {}", op,
               rope.beta_fast, rope.beta_slow);
  MARROW_CHECK(rope.original_max_positions > 0, "{}: yarn's original_max_positions must be positive, got {}", op,
               rope.original_max_positions);
  MARROW_CHECK(rope.attention_factor >= 0, "{}: yarn's attention_factor must be positive (or 0 for Hugging Face's default), got {}",
               op, rope.attention_factor);
}

// rope_inverse_frequencies without the checks: rope_parameters' float and double steps as
// transformers takes them. Python computes low, high and their span in double; torch rounds them to
// float32 where they meet the float32 arange, and every step after is a float32 operation.
std::vector<float> inverse_frequencies(int64_t d, const RopeParameters& rope) {
  const int64_t half = d / 2;
  std::vector<float> inv_freq(half);
  if (!rope.yarn) {
    for (int64_t j = 0; j < half; ++j) inv_freq[j] = rope_inverse_frequency(j, d, rope.theta);
    return inv_freq;
  }
  // The pair index at which a frequency turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return double(d) * std::log(double(rope.original_max_positions) / (rotations * 2 * kPi)) / (2 * std::log(rope.theta));
  };
  double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(d - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero span
  const float span = float(high - low), factor = float(rope.factor);
  for (int64_t j = 0; j < half; ++j) {
    const float p = position_frequency(j, d, rope.theta);
    const float extrapolation = 1.0f - std::clamp((float(j) - float(low)) / span, 0.0f, 1.0f);
    inv_freq[j] = 1.0f / (factor * p) * (1.0f - extrapolation) + 1.0f / p * extrapolation;
  }
  return inv_freq;
}

double attention_scaling(const RopeParameters& rope) {
  if (!rope.yarn) return 1.0;
  if (rope.attention_factor > 0) return rope.attention_factor;
  return rope.factor <= 1 ? 1.0 : 0.1 * std::log(rope.factor) + 1.0;
}

// The first rotary_dim elements of each head rotate (the whole head when not given), the rest pass through.
void rotate(const char* op, Tensor y, const char* y_name, Tensor x, const char* x_name, Tensor positions,
            const RopeParameters& rope, std::optional<int64_t> rotary_dim, int sign, Stream stream) {
  expect_ndim(op, x_name, x, 3, "[tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), rotated = rotary_dim.value_or(d);
  MARROW_CHECK(d % 2 == 0, "{}: head_dim of {} must be even, got {}", op, x_name, d);
  MARROW_CHECK(rotated > 0 && rotated % 2 == 0 && rotated <= d,
               "{}: rotary_dim must be even, positive and at most the head_dim of {} ({}), got {}", op, x_name, d, rotated);
  check_rope(op, rope);
  expect_shape(op, y_name, y, {tokens, heads, d});
  expect_shape(op, "positions", positions, {tokens});
  expect_dtype(op, "positions", positions, DType::i32);
  const std::vector<float> inv_freq = inverse_frequencies(rotated, rope);
  const float scale = float(attention_scaling(rope));
  if (on_gpu(op, {{x_name, &x, DType::bf16}, {y_name, &y, DType::bf16}, {"positions", &positions, DType::i32}})) {
    MARROW_CHECK(rotated / 2 <= kMaxHalfHost, "{}: {} rotates {} elements of a head, but the GPU kernel takes at most {}", op, x_name,
                 rotated, 2 * kMaxHalfHost);
    MARROW_GPU_RETURN(op, stream, launch_rotate(y, x, positions, inv_freq, scale, sign, stream));
  }
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    rotate_cpu<T>(y.ptr<T>(), x.ptr<T>(), positions.ptr<int32_t>(), tokens, heads, d, inv_freq, scale, sign);
  });
}

}  // namespace

float rope_inverse_frequency(int64_t j, int64_t head_dim, double theta) { return 1.0f / position_frequency(j, head_dim, theta); }

std::vector<float> rope_inverse_frequencies(int64_t head_dim, const RopeParameters& rope) {
  const char* op = "rope_inverse_frequencies";
  MARROW_CHECK(head_dim > 0 && head_dim % 2 == 0, "{}: head_dim must be even and positive, got {}", op, head_dim);
  check_rope(op, rope);
  return inverse_frequencies(head_dim, rope);
}

double rope_attention_scaling(const RopeParameters& rope) {
  check_rope("rope_attention_scaling", rope);
  return attention_scaling(rope);
}

void rope_cos_sin_table(Tensor table, Tensor positions, int64_t head_dim, double theta, Stream stream) {
  const char* op = "rope_cos_sin_table";
  MARROW_CHECK(head_dim > 0 && head_dim % 2 == 0, "{}: head_dim must be even and positive, got {}", op, head_dim);
  MARROW_CHECK(theta > 0, "{}: theta must be positive, got {}", op, theta);
  expect_ndim(op, "positions", positions, 1, "[tokens]");
  const int64_t tokens = positions.size(0), half = head_dim / 2;
  expect_dtype(op, "positions", positions, DType::i32);
  expect_shape(op, "table", table, {tokens, half, 2});
  expect_dtype(op, "table", table, DType::f32);
  if (common_device(op, {{"table", &table}, {"positions", &positions}}) == Device::cuda) {
    MARROW_CHECK(half <= kMaxHalfHost, "{}: head_dim is {}, but the GPU kernel takes at most {}", op, head_dim, 2 * kMaxHalfHost);
    MARROW_GPU_RETURN(op, stream, launch_table(table, positions, head_dim, theta, stream));
  }
  float* out = table.ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < half; ++j) {
      const float angle = float(positions.ptr<int32_t>()[t]) * rope_inverse_frequency(j, head_dim, theta);
      out[2 * (t * half + j)] = std::cos(angle);
      out[2 * (t * half + j) + 1] = std::sin(angle);
    }
}

void rope_forward(Tensor y, Tensor x, Tensor positions, double theta, Stream stream) {
  rotate("rope_forward", y, "y", x, "x", positions, RopeParameters{theta}, std::nullopt, 1, stream);
}

void rope_backward(Tensor dx, Tensor dy, Tensor positions, double theta, Stream stream) {
  rotate("rope_backward", dx, "dx", dy, "dy", positions, RopeParameters{theta}, std::nullopt, -1, stream);
}

void rope_forward(Tensor y, Tensor x, Tensor positions, double theta, int64_t rotary_dim, Stream stream) {
  rotate("rope_forward", y, "y", x, "x", positions, RopeParameters{theta}, rotary_dim, 1, stream);
}

void rope_backward(Tensor dx, Tensor dy, Tensor positions, double theta, int64_t rotary_dim, Stream stream) {
  rotate("rope_backward", dx, "dx", dy, "dy", positions, RopeParameters{theta}, rotary_dim, -1, stream);
}

void rope_forward(Tensor y, Tensor x, Tensor positions, const RopeParameters& rope, Stream stream) {
  rotate("rope_forward", y, "y", x, "x", positions, rope, std::nullopt, 1, stream);
}

void rope_backward(Tensor dx, Tensor dy, Tensor positions, const RopeParameters& rope, Stream stream) {
  rotate("rope_backward", dx, "dx", dy, "dy", positions, rope, std::nullopt, -1, stream);
}

}  // namespace marrow
