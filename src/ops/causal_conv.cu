// On the GPU a thread walks kTile tokens of one sequence for N channels (a 16-byte pack when C % 8
// == 0), holding the last K inputs in registers: each x is read once a tile plus K - 1 halo tokens.
// The backward writes dx and its tile's dweight partials in one walk; the partials are then summed
// over (sequence, tile) in order: deterministic.
#include "ops/causal_conv.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr int64_t kMaxTaps = 8;

template <typename T> T sigmoid(T v) { return T(1) / (T(1) + std::exp(-v)); }

// The pre-activation of token s of a sequence whose channel at token 0 is x (tokens c apart).
template <typename T> T pre_cpu(const T* x, const T* w, int64_t s, int64_t c, int64_t k) {
  T acc = 0;
  for (int64_t j = 0; j < k; ++j)
    if (s - k + 1 + j >= 0) acc += w[j] * x[(s - k + 1 + j) * c];
  return acc;
}

// Rows r are the B * S tokens; r - r % s is the first token of r's sequence.
template <typename T> void forward_cpu(T* y, const T* x, const T* w, int64_t rows, int64_t s, int64_t c, int64_t k) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ch = 0; ch < c; ++ch) {
      const T p = pre_cpu(x + (r - r % s) * c + ch, w + ch * k, r % s, c, k);
      y[r * c + ch] = p / (1 + std::exp(-p));  // torch's silu
    }
}

template <typename T> void backward_cpu(T* dx, T* dw, const T* dy, const T* x, const T* w, int64_t rows, int64_t s, int64_t c, int64_t k) {
  std::vector<T> dpre(size_t(rows * c)), sums(size_t(c * k), T(0));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ch = 0; ch < c; ++ch) {
      const T p = pre_cpu(x + (r - r % s) * c + ch, w + ch * k, r % s, c, k), sg = sigmoid(p);
      dpre[size_t(r * c + ch)] = dy[r * c + ch] * sg * (1 + p * (1 - sg));
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ch = 0; ch < c; ++ch) {
      T acc = 0;
      for (int64_t j = 0; j < k; ++j) {
        if (r % s + k - 1 - j < s) acc += w[ch * k + j] * dpre[size_t((r + k - 1 - j) * c + ch)];
        if (r % s - k + 1 + j >= 0) sums[size_t(ch * k + j)] += dpre[size_t(r * c + ch)] * x[(r - k + 1 + j) * c + ch];
      }
      dx[r * c + ch] = acc;
    }
  for (int64_t i = 0; i < c * k; ++i) dw[i] += sums[size_t(i)];
}

#ifdef __CUDACC__
constexpr int64_t kTile = 64;  // tokens a thread walks

// The last K tokens' values of N channels, oldest first (or the taps, v[j] = weight[c + l, j]).
template <int N, int K> struct Window {
  float v[K][N] = {};
  __device__ void push(const float (&in)[N]) {
    for (int j = 0; j + 1 < K; ++j)
      for (int l = 0; l < N; ++l) v[j][l] = v[j + 1][l];
    for (int l = 0; l < N; ++l) v[K - 1][l] = in[l];
  }
  __device__ float dot(const Window& other, int l, bool reversed) const {  // in j order, f32
    float acc = 0;
    for (int j = 0; j < K; ++j) acc = fmaf(v[j][l], other.v[reversed ? K - 1 - j : j][l], acc);
    return acc;
  }
};

// N values at p as floats, zeros when !inside.
template <int N> __device__ void load_f32(float (&out)[N], const bf16* p, bool inside) {
  const Pack<bf16, N> in = inside ? load<N>(p) : Pack<bf16, N>{};
  for (int l = 0; l < N; ++l) out[l] = inside ? float(in.v[l]) : 0.0f;
}

// Thread p's N channels from c of tokens [s0, s1) of the sequence from token base walk u from
// s0 - K + 1: x[u] joins the window (zeros outside the sequence); the forward writes y[u] for u >=
// s0. The backward goes on to s1 + K - 2: dpre[u] (zero before s0 and past the sequence) joins its
// window, the tile's own tokens add dpre[u] x[u - K + 1 + j] to tap j's partial, and dx[u - K + 1] =
// sum_j w[j] dpre[u - j] is written once u - K + 1 >= s0.
template <int N, int K, bool Backward> __global__ void causal_conv_kernel(bf16* out, float* partial, const bf16* dy, const bf16* x,
                                                                          const bf16* weight, int64_t batch, int64_t seq, int64_t channels) {
  begin_after_previous_grid();
  const int64_t packs = channels / N, tiles = (seq + kTile - 1) / kTile;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < batch * tiles * packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = p % packs * N, base = p / packs / tiles * seq, s0 = p / packs % tiles * kTile, s1 = min(seq, s0 + kTile);
    Window<N, K> w, xs, dpre, sums;
    for (int j = 0; j < K; ++j)
      for (int l = 0; l < N; ++l) w.v[j][l] = float(weight[(c + l) * K + j]);
    for (int64_t u = s0 - K + 1; u < s1 + (Backward ? K - 1 : 0); ++u) {
      const bool inside = u >= 0 && u < seq;
      float in[N], d[N];
      load_f32<N>(in, x + (base + u) * channels + c, inside);
      xs.push(in);
      load_f32<N>(d, dy + (base + u) * channels + c, Backward && inside && u >= s0);
      Pack<bf16, N> o;
      for (int l = 0; l < N; ++l) {
        const float pre = w.dot(xs, l, false), rounded = float(bf16(pre)), sg = 1.0f / (1.0f + expf(-pre));
        o.v[l] = bf16(rounded / (1.0f + expf(-rounded)));  // torch's bf16 conv output, then its silu
        d[l] *= sg * (1.0f + pre * (1.0f - sg));
      }
      if (!Backward) {
        if (u >= s0) store<N>(out + (base + u) * channels + c, o);
        continue;
      }
      dpre.push(d);
      for (int j = 0; j < K && u < s1; ++j)
        for (int l = 0; l < N; ++l) sums.v[j][l] = fmaf(d[l], xs.v[j][l], sums.v[j][l]);
      if (u - K + 1 < s0) continue;
      for (int l = 0; l < N; ++l) o.v[l] = bf16(w.dot(dpre, l, true));
      store<N>(out + (base + u - K + 1) * channels + c, o);
    }
    for (int l = 0; Backward && l < N; ++l)
      for (int j = 0; j < K; ++j) partial[(p / packs) * channels * K + (c + l) * K + j] = sums.v[j][l];
  }
}

// dst[i] += sum over chunks of partial[chunk, i], in chunk order.
__global__ void causal_conv_sum_kernel(float* dst, const float* partial, int64_t chunks, int64_t n) {
  begin_after_previous_grid();
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  float acc = 0;
  for (int64_t k = 0; i < n && k < chunks; ++k) acc += partial[k * n + i];
  if (i < n) dst[i] += acc;
}

// f(integral_constant<int, K>) for the weight's k taps (1 <= k <= kMaxTaps).
template <int K = 1, class F> void with_taps(int64_t k, F&& f) {
  if constexpr (K <= kMaxTaps) {
    if (k == K) return f(std::integral_constant<int, K>{});
    with_taps<K + 1>(k, f);
  }
}

// The kernel for x's shape: a thread a (sequence, tile, pack of 8 channels or one channel).
template <bool Backward> void launch(Tensor out, float* partial, Tensor dy, Tensor x, Tensor weight, Stream stream) {
  const int64_t c = x.size(2), tiles = (x.size(1) + kTile - 1) / kTile;
  const bool packed = packable(c, {out.data, dy.data, x.data});
  const int64_t threads = x.size(0) * tiles * (packed ? c / 8 : c);
  if (threads == 0) return;
  with_taps(weight.size(1), [&](auto k) {
    constexpr int K = decltype(k)::value;
    launch_dependent(packed ? causal_conv_kernel<8, K, Backward> : causal_conv_kernel<1, K, Backward>, grid_stride_blocks(threads, 128, 8192), 128,
                     0, stream, bf16_ptr(out), partial, bf16_ptr(dy), bf16_ptr(x), bf16_ptr(weight), x.size(0), x.size(1), c);
  });
}

void launch_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Stream stream) {
  const int64_t chunks = x.size(0) * ((x.size(1) + kTile - 1) / kTile), n = weight.numel();
  if (n == 0) return;
  Buffer partial(DType::f32, Device::cuda, {chunks, n}, stream);
  launch<true>(dx, partial.ptr<float>(), dy, x, weight, stream);
  launch_dependent(causal_conv_sum_kernel, unsigned((n + 255) / 256), 256, 0, stream, dweight.ptr<float>(), partial.ptr<float>(), chunks, n);
}
#endif

// x [B, S, C] and weight [C, K] (K >= 1); `tensors` shaped like x, the first (the output) aliasing
// none of the others (a token's output reads the K - 1 tokens around it).
void check_shapes(const char* op, const Tensor& x, const Tensor& weight, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  expect_ndim(op, "x", x, 3, "[batch, seq, channels]");
  expect_ndim(op, "weight", weight, 2, "[channels, taps]");
  expect_shape(op, "weight", weight, {x.size(2), weight.size(1)});
  MARROW_CHECK(weight.size(1) >= 1, "{}: weight needs at least one tap, got {}", op, weight.shape_string());
  const auto [out_name, out] = *tensors.begin();
  for (auto [name, t] : tensors) {
    expect_shape(op, name, *t, {x.size(0), x.size(1), x.size(2)});
    MARROW_CHECK(t == out || t->data != out->data || x.numel() == 0, "{}: {} may not alias {}", op, out_name, name);
  }
}

// Whether the operands are on the GPU, whose kernels take up to kMaxTaps.
bool on_gpu_taps(const char* op, std::initializer_list<Operand> operands, const Tensor& weight) {
  const bool gpu = on_gpu(op, operands);
  MARROW_CHECK(!gpu || weight.size(1) <= kMaxTaps, "{}: the GPU kernels take up to {} taps, weight has {}", op, kMaxTaps, weight.size(1));
  return gpu;
}

}  // namespace

void causal_conv_forward(Tensor y, Tensor x, Tensor weight, Stream stream) {
  const char* op = "causal_conv_forward";
  check_shapes(op, x, weight, {{"y", &y}, {"x", &x}});
  if (on_gpu_taps(op, {{"x", &x, DType::bf16}, {"y", &y, DType::bf16}, {"weight", &weight, DType::bf16}}, weight))
    MARROW_GPU_RETURN(op, stream, launch<false>(y, nullptr, Tensor{}, x, weight, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(y.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), x.size(0) * x.size(1), x.size(1), x.size(2), weight.size(1));
  });
}

void causal_conv_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Stream stream) {
  const char* op = "causal_conv_backward";
  check_shapes(op, x, weight, {{"dx", &dx}, {"dy", &dy}, {"x", &x}});
  expect_shape(op, "dweight", dweight, {weight.size(0), weight.size(1)});
  if (on_gpu_taps(op, {{"x", &x, DType::bf16}, {"dx", &dx, DType::bf16}, {"dy", &dy, DType::bf16}, {"weight", &weight, DType::bf16},
                       {"dweight", &dweight, DType::f32}}, weight))
    MARROW_GPU_RETURN(op, stream, launch_backward(dx, dweight, dy, x, weight, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), x.size(0) * x.size(1), x.size(1), x.size(2),
                    weight.size(1));
  });
}

}  // namespace marrow
