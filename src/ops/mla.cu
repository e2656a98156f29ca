#include "ops/mla.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr int64_t kMaxPairsHost = 256;  // the GPU kernels' inv_freq argument holds Dr/2 <= 256

// One token's cosines and sines, each cos(angle) * rope_scale in f32 as ops/rope.cu computes them,
// the sines times sign (-1: the transpose).
template <typename T>
void cos_sin_cpu(T* c, T* s, int32_t position, const std::vector<float>& inv_freq, float rope_scale, int sign) {
  for (size_t j = 0; j < inv_freq.size(); ++j) {
    const float angle = float(position) * inv_freq[j];
    c[j] = T(std::cos(angle) * rope_scale);
    s[j] = T(sign * (std::sin(angle) * rope_scale));
  }
}

// Interleaved pairs (x[2j], x[2j + 1]) rotated by (c[j], s[j]), then times scale, in rope.cu's
// order of operations. Each pair is read before it is written: y may alias x.
template <typename T>
void rotate_pairs_cpu(T* y, const T* x, const T* c, const T* s, int64_t pairs, T scale) {
  for (int64_t j = 0; j < pairs; ++j) {
    const T a = x[2 * j], b = x[2 * j + 1];
    y[2 * j] = (a * c[j] - b * s[j]) * scale;
    y[2 * j + 1] = (b * c[j] + a * s[j]) * scale;
  }
}

template <typename T>
void query_cpu(T* y, const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t dn, int64_t dr,
               const std::vector<float>& inv_freq, float rope_scale, int sign, T scale) {
  const int64_t d = dn + dr;
  std::vector<T> c(dr / 2), s(dr / 2);
  for (int64_t t = 0; t < tokens; ++t) {
    cos_sin_cpu(c.data(), s.data(), positions[t], inv_freq, rope_scale, sign);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * d;
      for (int64_t i = 0; i < dn; ++i) y[base + i] = x[base + i] * scale;
      rotate_pairs_cpu(y + base + dn, x + base + dn, c.data(), s.data(), dr / 2, scale);
    }
  }
}

template <typename T>
void key_value_forward_cpu(T* k, T* v, const T* kv, const T* k_pe, const int32_t* positions, int64_t tokens, int64_t heads, int64_t dn,
                           int64_t dr, int64_t dv, const std::vector<float>& inv_freq, float rope_scale) {
  std::vector<T> c(dr / 2), s(dr / 2), rotated(dr);
  for (int64_t t = 0; t < tokens; ++t) {
    cos_sin_cpu(c.data(), s.data(), positions[t], inv_freq, rope_scale, 1);
    rotate_pairs_cpu(rotated.data(), k_pe + t * dr, c.data(), s.data(), dr / 2, T(1));
    for (int64_t row = t * heads; row < (t + 1) * heads; ++row) {
      const T* in = kv + row * (dn + dv);
      std::copy(in, in + dn, k + row * (dn + dr));
      std::copy(rotated.begin(), rotated.end(), k + row * (dn + dr) + dn);
      std::copy(in + dn, in + dn + dv, v + row * dv);
    }
  }
}

template <typename T>
void key_value_backward_cpu(T* dkv, T* dk_pe, const T* dk, const T* dvalue, const int32_t* positions, int64_t tokens, int64_t heads,
                            int64_t dn, int64_t dr, int64_t dv, const std::vector<float>& inv_freq, float rope_scale) {
  std::vector<T> c(dr / 2), s(dr / 2), sum(dr);
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(sum.begin(), sum.end(), T(0));
    for (int64_t row = t * heads; row < (t + 1) * heads; ++row) {
      const T* g = dk + row * (dn + dr);
      std::copy(g, g + dn, dkv + row * (dn + dv));
      std::copy(dvalue + row * dv, dvalue + (row + 1) * dv, dkv + row * (dn + dv) + dn);
      for (int64_t i = 0; i < dr; ++i) sum[i] += g[dn + i];
    }
    cos_sin_cpu(c.data(), s.data(), positions[t], inv_freq, rope_scale, -1);
    rotate_pairs_cpu(dk_pe + t * dr, sum.data(), c.data(), s.data(), dr / 2, T(1));
  }
}

#ifdef __CUDACC__
struct InvFreq {
  float v[kMaxPairsHost];
};

InvFreq inv_freq_argument(const std::vector<float>& frequencies) {
  InvFreq inv_freq{};
  std::copy(frequencies.begin(), frequencies.end(), inv_freq.v);
  return inv_freq;
}

// N bf16 values at p: one 16-byte access for N = 8 (aligned, the packed paths), else one at a time.
template <int N> __device__ __forceinline__ Pack<bf16, N> load_n(const bf16* p) {
  if constexpr (N == 8) {
    return load<8>(p);
  } else {
    Pack<bf16, N> v;
#pragma unroll
    for (int l = 0; l < N; ++l) v.v[l] = p[l];
    return v;
  }
}
template <int N> __device__ __forceinline__ void store_n(bf16* p, const Pack<bf16, N>& v) {
  if constexpr (N == 8) {
    store<8>(p, v);
  } else {
#pragma unroll
    for (int l = 0; l < N; ++l) p[l] = v.v[l];
  }
}

// R / 2 interleaved pairs of x (f32) from pair j0 on, rotated by sign * position * inv_freq
// (rope_cos_sin and rope_apply: rope.cu's bits), cos and sin each times rope_scale, the results
// times scale, rounded once to bf16.
template <int R>
__device__ __forceinline__ Pack<bf16, R> rotate_pairs(const float* x, const float* inv_freq, int j0, float position, float sign, float rope_scale,
                                                      float scale) {
  Pack<bf16, R> y;
#pragma unroll
  for (int l = 0; l < R; l += 2) {
    const float2 cs = rope_cos_sin(position, inv_freq[j0 + l / 2], sign);
    const float2 o = rope_apply(x[l], x[l + 1], make_float2(__fmul_rn(cs.x, rope_scale), __fmul_rn(cs.y, rope_scale)));
    y.v[l] = bf16(__fmul_rn(o.x, scale));
    y.v[l + 1] = bf16(__fmul_rn(o.y, scale));
  }
  return y;
}

template <int R> __device__ __forceinline__ void load_f32(float (&out)[R], const bf16* p) {
  const Pack<bf16, R> v = load_n<R>(p);
#pragma unroll
  for (int l = 0; l < R; ++l) out[l] = float(v.v[l]);
}

// Packed: 8 elements a thread (Dn, Dr and Dv multiples of 8, the data 16-byte aligned), else one
// element of a copy or one pair of a rotation.
template <bool Packed> constexpr int kCopyUnit = Packed ? 8 : 1;
template <bool Packed> constexpr int kPairUnit = Packed ? 8 : 2;

// Grid-stride over the query rows [T * H] in units of N nope elements (times scale) or R rope
// elements (R / 2 pairs rotated). A thread reads its unit whole before writing it: y may alias x.
template <bool Packed>
__global__ void mla_query_kernel(bf16* y, const bf16* x, const int32_t* positions, InvFreq inv_freq, int64_t rows, int heads, int dn, int dr,
                                 float sign, float rope_scale, float scale) {
  begin_after_previous_grid();
  constexpr int N = kCopyUnit<Packed>, R = kPairUnit<Packed>;
  const int nope_units = dn / N, units = nope_units + dr / R;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < rows * units; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p / units;
    const int u = int(p % units);
    if (u < nope_units) {
      bf16* out = y + row * (dn + dr) + u * N;
      Pack<bf16, N> v = load_n<N>(x + row * (dn + dr) + u * N);
#pragma unroll
      for (int l = 0; l < N; ++l) v.v[l] = bf16(__fmul_rn(float(v.v[l]), scale));
      store_n<N>(out, v);
    } else {
      const int j = (u - nope_units) * R;
      const int64_t at = row * (dn + dr) + dn + j;
      float in[R];
      load_f32<R>(in, x + at);
      store_n<R>(y + at, rotate_pairs<R>(in, inv_freq.v, j / 2, float(positions[row / heads]), sign, rope_scale, scale));
    }
  }
}

// Grid-stride over T * H * (Dn + Dv) / N copies between kv's rows and k's nope part or v (Backward:
// into kv), then T * Dr / R rope units of one token: forward, k_pe's pairs rotated and written to
// every head of k; backward, dk's rope parts summed over heads in head order (f32), then rotated
// back into dk_pe.
template <bool Packed, bool Backward>
__global__ void mla_key_value_kernel(bf16* kv, bf16* k, bf16* v, bf16* k_pe, const int32_t* positions, InvFreq inv_freq, int64_t tokens,
                                     int heads, int dn, int dr, int dv, float rope_scale) {
  begin_after_previous_grid();
  constexpr int N = kCopyUnit<Packed>, R = kPairUnit<Packed>;
  const int copy_units = (dn + dv) / N, rope_units = dr / R;
  const int64_t copies = tokens * heads * copy_units;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < copies + tokens * rope_units; p += int64_t(gridDim.x) * blockDim.x) {
    if (p < copies) {
      const int64_t row = p / copy_units;
      const int c = int(p % copy_units) * N;
      bf16* packed = kv + row * (dn + dv) + c;
      bf16* split = c < dn ? k + row * (dn + dr) + c : v + row * dv + (c - dn);
      if constexpr (Backward) store_n<N>(packed, load_n<N>(split));
      else store_n<N>(split, load_n<N>(packed));
      continue;
    }
    const int64_t t = (p - copies) / rope_units;
    const int j = int((p - copies) % rope_units) * R;
    const float position = float(positions[t]);
    bf16* head0 = k + t * heads * (dn + dr) + dn + j;
    float in[R] = {};
    if constexpr (Backward) {
      for (int h = 0; h < heads; ++h) {
        float g[R];
        load_f32<R>(g, head0 + h * (dn + dr));
#pragma unroll
        for (int l = 0; l < R; ++l) in[l] = __fadd_rn(in[l], g[l]);
      }
      store_n<R>(k_pe + t * dr + j, rotate_pairs<R>(in, inv_freq.v, j / 2, position, -1.0f, rope_scale, 1.0f));
    } else {
      load_f32<R>(in, k_pe + t * dr + j);
      const Pack<bf16, R> out = rotate_pairs<R>(in, inv_freq.v, j / 2, position, 1.0f, rope_scale, 1.0f);
      for (int h = 0; h < heads; ++h) store_n<R>(head0 + h * (dn + dr), out);
    }
  }
}

void launch_query(Tensor y, Tensor x, Tensor positions, int64_t dr, const std::vector<float>& inv_freq, float rope_scale, int sign, float scale,
                  Stream stream) {
  const int64_t rows = x.size(0) * x.size(1), dn = x.size(2) - dr;
  const bool packed = dr % 8 == 0 && packable(dn, {x.data, y.data});
  const int64_t work = rows * (packed ? (dn + dr) / 8 : dn + dr / 2);
  if (work == 0) return;
  launch_dependent(packed ? mla_query_kernel<true> : mla_query_kernel<false>, grid_stride_blocks(work, 256, 8192), 256, 0, stream,
                   bf16_ptr(y), bf16_ptr(x), positions.ptr<int32_t>(), inv_freq_argument(inv_freq), rows, int(x.size(1)), int(dn),
                   int(dr), float(sign), rope_scale, scale);
}

// kv [T, H, Dn + Dv], k [T, H, Dn + Dr], v [T, H, Dv], k_pe [T, Dr]: the forward's inputs (kv, k_pe)
// or the backward's outputs (dkv, dk_pe).
template <bool Backward>
void launch_key_value(Tensor kv, Tensor k, Tensor v, Tensor k_pe, Tensor positions, const std::vector<float>& inv_freq, float rope_scale,
                      Stream stream) {
  const int64_t tokens = k.size(0), heads = k.size(1), dr = k_pe.size(1), dn = k.size(2) - dr, dv = v.size(2);
  const bool packed = dr % 8 == 0 && dv % 8 == 0 && packable(dn, {kv.data, k.data, v.data, k_pe.data});
  const int64_t work = tokens * (heads * (packed ? (dn + dv) / 8 : dn + dv) + (packed ? dr / 8 : dr / 2));
  if (work == 0) return;
  launch_dependent(packed ? mla_key_value_kernel<true, Backward> : mla_key_value_kernel<false, Backward>, grid_stride_blocks(work, 256, 8192),
                   256, 0, stream, bf16_ptr(kv), bf16_ptr(k), bf16_ptr(v), bf16_ptr(k_pe), positions.ptr<int32_t>(),
                   inv_freq_argument(inv_freq), tokens, int(heads), int(dn), int(dr), int(dv), rope_scale);
}
#endif

void check_positions(const char* op, const Tensor& positions, int64_t tokens) {
  expect_shape(op, "positions", positions, {tokens});
  expect_dtype(op, "positions", positions, DType::i32);
}

void check_gpu_pairs(const char* op, int64_t dr) {
  MARROW_CHECK(dr / 2 <= kMaxPairsHost, "{}: the rope dimension is {}, but the GPU kernels take at most {}", op, dr, 2 * kMaxPairsHost);
}

void query(const char* op, Tensor y, const char* y_name, Tensor x, const char* x_name, Tensor positions, int64_t dr, const RopeParameters& rope,
           double scale, int sign, Stream stream) {
  expect_ndim(op, x_name, x, 3, "[tokens, heads, nope + rope dims]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  MARROW_CHECK(dr > 0 && dr % 2 == 0 && dr <= d, "{}: rope_dim must be even and in [2, {}] ({}'s last dimension), got {}", op, d, x_name, dr);
  expect_shape(op, y_name, y, {tokens, heads, d});
  check_positions(op, positions, tokens);
  const std::vector<float> inv_freq = rope_inverse_frequencies(dr, rope);
  const float rope_scale = float(rope_attention_scaling(rope));
  if (on_gpu(op, {{x_name, &x, DType::bf16}, {y_name, &y, DType::bf16}, {"positions", &positions, DType::i32}})) {
    check_gpu_pairs(op, dr);
    MARROW_GPU_RETURN(op, stream, launch_query(y, x, positions, dr, inv_freq, rope_scale, sign, float(scale), stream));
  }
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    query_cpu<T>(y.ptr<T>(), x.ptr<T>(), positions.ptr<int32_t>(), tokens, heads, d - dr, dr, inv_freq, rope_scale, sign, T(scale));
  });
}

// The shape checks of the key/value ops, names in (k, v, kv, k_pe) order; returns (T, H, Dn, Dr, Dv).
std::array<int64_t, 5> key_value_sizes(const char* op, std::array<const char*, 4> names, const Tensor& k, const Tensor& v, const Tensor& kv,
                                       const Tensor& k_pe, const Tensor& positions) {
  expect_ndim(op, names[0], k, 3, "[tokens, heads, nope + rope dims]");
  expect_ndim(op, names[1], v, 3, "[tokens, heads, value dims]");
  expect_ndim(op, names[3], k_pe, 2, "[tokens, rope dims]");
  const int64_t tokens = k.size(0), heads = k.size(1), dr = k_pe.size(1), dn = k.size(2) - dr, dv = v.size(2);
  MARROW_CHECK(dr > 0 && dr % 2 == 0, "{}: the rope dimension of {} must be even and positive, got {}", op, names[3], dr);
  MARROW_CHECK(dn >= 0, "{}: {}'s last dimension {} is smaller than {}'s rope dimension {}", op, names[0], k.size(2), names[3], dr);
  expect_shape(op, names[1], v, {tokens, heads, dv});
  expect_shape(op, names[2], kv, {tokens, heads, dn + dv});
  expect_shape(op, names[3], k_pe, {tokens, dr});
  check_positions(op, positions, tokens);
  return {tokens, heads, dn, dr, dv};
}

}  // namespace

void mla_query_forward(Tensor q_out, Tensor q, Tensor positions, int64_t rope_dim, const RopeParameters& rope, double scale, Stream stream) {
  query("mla_query_forward", q_out, "q_out", q, "q", positions, rope_dim, rope, scale, 1, stream);
}

void mla_query_backward(Tensor dq, Tensor dq_out, Tensor positions, int64_t rope_dim, const RopeParameters& rope, double scale, Stream stream) {
  query("mla_query_backward", dq, "dq", dq_out, "dq_out", positions, rope_dim, rope, scale, -1, stream);
}

void mla_key_value_forward(Tensor k, Tensor v, Tensor kv, Tensor k_pe, Tensor positions, const RopeParameters& rope, Stream stream) {
  const char* op = "mla_key_value_forward";
  const std::array<int64_t, 5> size = key_value_sizes(op, {"k", "v", "kv", "k_pe"}, k, v, kv, k_pe, positions);
  const int64_t tokens = size[0], heads = size[1], dn = size[2], dr = size[3], dv = size[4];
  const std::vector<float> inv_freq = rope_inverse_frequencies(dr, rope);
  const float rope_scale = float(rope_attention_scaling(rope));
  if (on_gpu(op, {{"kv", &kv, DType::bf16}, {"k_pe", &k_pe, DType::bf16}, {"k", &k, DType::bf16}, {"v", &v, DType::bf16},
                  {"positions", &positions, DType::i32}})) {
    check_gpu_pairs(op, dr);
    MARROW_GPU_RETURN(op, stream, launch_key_value<false>(kv, k, v, k_pe, positions, inv_freq, rope_scale, stream));
  }
  with_cpu_scalar(op, kv, [&](auto s) {
    using T = decltype(s);
    key_value_forward_cpu<T>(k.ptr<T>(), v.ptr<T>(), kv.ptr<T>(), k_pe.ptr<T>(), positions.ptr<int32_t>(), tokens, heads, dn, dr, dv, inv_freq,
                             rope_scale);
  });
}

void mla_key_value_backward(Tensor dkv, Tensor dk_pe, Tensor dk, Tensor dv, Tensor positions, const RopeParameters& rope, Stream stream) {
  const char* op = "mla_key_value_backward";
  const std::array<int64_t, 5> size = key_value_sizes(op, {"dk", "dv", "dkv", "dk_pe"}, dk, dv, dkv, dk_pe, positions);
  const int64_t tokens = size[0], heads = size[1], dn = size[2], dr = size[3], dv_dim = size[4];
  const std::vector<float> inv_freq = rope_inverse_frequencies(dr, rope);
  const float rope_scale = float(rope_attention_scaling(rope));
  if (on_gpu(op, {{"dk", &dk, DType::bf16}, {"dv", &dv, DType::bf16}, {"dkv", &dkv, DType::bf16}, {"dk_pe", &dk_pe, DType::bf16},
                  {"positions", &positions, DType::i32}})) {
    check_gpu_pairs(op, dr);
    MARROW_GPU_RETURN(op, stream, launch_key_value<true>(dkv, dk, dv, dk_pe, positions, inv_freq, rope_scale, stream));
  }
  with_cpu_scalar(op, dk, [&](auto s) {
    using T = decltype(s);
    key_value_backward_cpu<T>(dkv.ptr<T>(), dk_pe.ptr<T>(), dk.ptr<T>(), dv.ptr<T>(), positions.ptr<int32_t>(), tokens, heads, dn, dr, dv_dim,
                              inv_freq, rope_scale);
  });
}

}  // namespace marrow
