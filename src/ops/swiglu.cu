#include "ops/swiglu.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "ops/common.h"
#include "ops/dispatch.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

// 1 / (1 + exp(-g)) saturates cleanly at both ends: exp overflows to inf for g << 0, giving 0.
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

template <typename T>
void forward_cpu(T* out, const T* gate_up, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const double g = gate_up[r * 2 * d + c], u = gate_up[r * 2 * d + d + c];
      out[r * d + c] = T(g * sigmoid(g) * u);
    }
}

template <typename T>
void backward_cpu(T* dgate_up, const T* dout, const T* gate_up, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const double g = gate_up[r * 2 * d + c], u = gate_up[r * 2 * d + d + c], s = sigmoid(g), dy = dout[r * d + c];
      dgate_up[r * 2 * d + c] = T(dy * u * s * (1 + g * (1 - s)));
      dgate_up[r * 2 * d + d + c] = T(dy * g * s);
    }
}

// GPT-OSS's clamped activation of one (gate, up) pair, in double; pass_gate and pass_up say where
// torch's clamp backward lets the gradient through.
struct ClampedPair {
  double g, u, s;
  bool pass_gate, pass_up;
  ClampedPair(double gate, double up, double alpha, double limit)
      : g(std::min(gate, limit)), u(std::clamp(up, -limit, limit)), s(sigmoid(alpha * g)), pass_gate(gate <= limit),
        pass_up(-limit <= up && up <= limit) {}
};

template <typename T>
void clamped_forward_cpu(T* out, const T* gate_up, int64_t n, int64_t d, double alpha, double limit) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const ClampedPair p(gate_up[r * 2 * d + 2 * c], gate_up[r * 2 * d + 2 * c + 1], alpha, limit);
      out[r * d + c] = T((p.u + 1) * (p.g * p.s));
    }
}

template <typename T>
void clamped_backward_cpu(T* dgate_up, const T* dout, const T* gate_up, int64_t n, int64_t d, double alpha, double limit) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const ClampedPair p(gate_up[r * 2 * d + 2 * c], gate_up[r * 2 * d + 2 * c + 1], alpha, limit);
      const double dy = dout[r * d + c];
      dgate_up[r * 2 * d + 2 * c] = p.pass_gate ? T(dy * (p.u + 1) * p.s * (1 + alpha * p.g * (1 - p.s))) : T(0);
      dgate_up[r * 2 * d + 2 * c + 1] = p.pass_up ? T(dy * p.g * p.s) : T(0);
    }
}

// gate_up[R, 2I]: returns (R, I).
std::array<int64_t, 2> check_gate_up(const char* op, const Tensor& gate_up) {
  MARROW_CHECK(gate_up.ndim == 2 && gate_up.size(1) % 2 == 0, "{}: gate_up must be [rows, 2 * intermediate], got {}", op,
               gate_up.shape_string());
  return {gate_up.size(0), gate_up.size(1) / 2};
}

// The shapes of an op over R rows of gate_up[R, 2I] and its devices (all bf16 on the GPU).
struct Rows {
  int64_t n, d;
  bool gpu;
};
Rows check_forward(const char* op, const Tensor& out, const Tensor& gate_up) {
  const auto [n, d] = check_gate_up(op, gate_up);
  expect_shape(op, "out", out, {n, d});
  return {n, d, on_gpu(op, {{"gate_up", &gate_up, DType::bf16}, {"out", &out, DType::bf16}})};
}
Rows check_backward(const char* op, const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  const auto [n, d] = check_gate_up(op, gate_up);
  expect_shape(op, "dgate_up", dgate_up, {n, 2 * d});
  expect_shape(op, "dout", dout, {n, d});
  return {n, d, on_gpu(op, {{"gate_up", &gate_up, DType::bf16}, {"dgate_up", &dgate_up, DType::bf16}, {"dout", &dout, DType::bf16}})};
}

// The clamped SwiGLU's bounds [-limit, limit] need a positive limit.
void check_limit(const char* op, double limit) { MARROW_CHECK(limit > 0, "{}: limit must be positive, got {}", op, limit); }

// One copy at a time: the unweighted activation of row r (forward(a, gate_up row)), its dot with
// dact, then the weighted act and the gradient of the weighted dact (backward(dgate_up row, da,
// gate_up row)), each rounded to T where the separate ops would store it; row_weight, when given,
// receives w.
template <typename T, typename Forward, typename Backward>
void weighted_backward_cpu(T* dgate_up, T* act, T* row_weight, T* dtopk_weight, const T* dact, const T* gate_up, const T* topk_weight,
                           const int32_t* copy_row, int64_t copies, int64_t d, Forward forward, Backward backward) {
  std::vector<T> a(static_cast<size_t>(d)), da(static_cast<size_t>(d));
  for (int64_t c = 0; c < copies; ++c) {
    const int64_t r = copy_row[c];
    if (r == -1) {
      dtopk_weight[c] = T(0);
      continue;
    }
    forward(a.data(), gate_up + r * 2 * d);
    double dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += double(dact[r * d + i]) * a[size_t(i)];
    dtopk_weight[c] = T(dot);
    const T w = topk_weight[c];
    if (row_weight) row_weight[r] = w;
    for (int64_t i = 0; i < d; ++i) {
      act[r * d + i] = T(w * a[size_t(i)]);
      da[size_t(i)] = T(w * dact[r * d + i]);
    }
    backward(dgate_up + r * 2 * d, da.data(), gate_up + r * 2 * d);
  }
}

// The weighted backwards' shared shape checks: returns (R, I).
std::array<int64_t, 2> check_weighted(const char* op, Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up,
                                      Tensor topk_weight, Tensor copy_row) {
  const std::array<int64_t, 2> size = check_gate_up(op, gate_up);
  const int64_t n = size[0], d = size[1];
  expect_ndim(op, "copy_row", copy_row, 2, "[tokens, k]");
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "dgate_up", dgate_up, {n, 2 * d});
  expect_shape(op, "act", act, {n, d});
  expect_shape(op, "dact", dact, {n, d});
  expect_shape(op, "topk_weight", topk_weight, {copy_row.size(0), copy_row.size(1)});
  expect_shape(op, "dtopk_weight", dtopk_weight, {copy_row.size(0), copy_row.size(1)});
  return size;
}

#ifdef __CUDACC__
__device__ float sigmoidf(float g) { return 1.0f / (1.0f + expf(-g)); }

// The activations the kernels below take as a template parameter: where a gate_up row holds the
// (gate, up) pairs of columns [c, c + N), and one pair's math in f32 as the CPU reference associates
// it, each intermediate rounded to bf16 where the separate ops store it (swiglu.h): forward's value
// (unrounded), dot_term = dy * bf16(forward) (a term of dtopk_weight's dot), backward's (dgate, dup)
// for the output gradient dy, weighted_backward's act = w * bf16(forward) and the backward of bf16(w * dy).

// Qwen3's SwiGLU: gate in columns [0, I), up in [I, 2I). Each method is one of the kernels' loop
// bodies as written before the clamped SwiGLU shared the kernels, statement order included: nvcc
// schedules by it, and the kernels' machine code stays the same.
struct Swiglu {
  template <int N> __device__ void load_pairs(const bf16* row, int64_t inter, int64_t c, Pack<bf16, N>& g, Pack<bf16, N>& u) const {
    g = load<N>(row + c);
    u = load<N>(row + inter + c);
  }
  template <int N> __device__ void store_pairs(bf16* row, int64_t inter, int64_t c, const Pack<bf16, N>& dg, const Pack<bf16, N>& du) const {
    store<N>(row + c, dg);
    store<N>(row + inter + c, du);
  }
  __device__ float forward(bf16 g, bf16 u) const {
    const float gf = float(g);
    return gf * sigmoidf(gf) * float(u);
  }
  __device__ float dot_term(bf16 g, bf16 u, bf16 dy) const {
    const float gf = float(g);
    return float(dy) * float(bf16(gf * sigmoidf(gf) * float(u)));
  }
  __device__ void backward(bf16 g, bf16 u, bf16 dy, bf16& dg, bf16& du) const {
    const float gf = float(g), s = sigmoidf(gf), d = float(dy);
    dg = bf16(d * float(u) * s * (1.0f + gf * (1.0f - s)));
    du = bf16(d * gf * s);
  }
  __device__ void weighted_backward(bf16 g, bf16 u, bf16 dy, float w, bf16& aw, bf16& dg, bf16& du) const {
    const float gf = float(g), s = sigmoidf(gf), d = float(bf16(w * float(dy)));
    aw = bf16(w * float(bf16(gf * s * float(u))));
    dg = bf16(d * float(u) * s * (1.0f + gf * (1.0f - s)));
    du = bf16(d * gf * s);
  }
};

// GPT-OSS's clamped SwiGLU, pairs interleaved (gate in column 2i, up in 2i + 1): the N pairs of
// columns [c, c + N) are the 2N values from 2c on, moved as two packs of N (16 bytes each when N = 8).
struct ClampedSwiglu {
  float alpha, limit;  // limit: clamp_limit's float

  template <int N> __device__ void load_pairs(const bf16* row, int64_t, int64_t c, Pack<bf16, N>& g, Pack<bf16, N>& u) const {
    const Pack<bf16, N> half[2] = {load<N>(row + 2 * c), load<N>(row + 2 * c + N)};
#pragma unroll
    for (int l = 0; l < N; ++l) {
      g.v[l] = half[2 * l / N].v[2 * l % N];
      u.v[l] = half[(2 * l + 1) / N].v[(2 * l + 1) % N];
    }
  }
  template <int N> __device__ void store_pairs(bf16* row, int64_t, int64_t c, const Pack<bf16, N>& dg, const Pack<bf16, N>& du) const {
    Pack<bf16, N> half[2];
#pragma unroll
    for (int l = 0; l < N; ++l) {
      half[2 * l / N].v[2 * l % N] = dg.v[l];
      half[(2 * l + 1) / N].v[(2 * l + 1) % N] = du.v[l];
    }
    store<N>(row + 2 * c, half[0]);
    store<N>(row + 2 * c + N, half[1]);
  }
  // One pair as the CPU's ClampedPair takes it, in f32: std::min(gate, limit) and std::clamp(up,
  // -limit, limit) written out, so that a NaN passes through as there (fminf would return the limit).
  // The weighted backward takes act and the gradient from one Pair: with the bf16 values converted
  // twice, nvcc computed the sigmoid twice.
  struct Pair {
    float g, u, s;
    bool pass_gate, pass_up;
  };
  __device__ Pair pair(bf16 gate_bf16, bf16 up_bf16) const {
    const float gate = float(gate_bf16), up = float(up_bf16), g = limit < gate ? limit : gate;
    return {g, up < -limit ? -limit : limit < up ? limit : up, sigmoidf(alpha * g), gate <= limit, -limit <= up && up <= limit};
  }
  __device__ float value(const Pair& p) const { return (p.u + 1.0f) * (p.g * p.s); }
  __device__ void gradient(const Pair& p, float d, bf16& dg, bf16& du) const {
    dg = bf16(p.pass_gate ? d * (p.u + 1.0f) * p.s * (1.0f + alpha * p.g * (1.0f - p.s)) : 0.0f);
    du = bf16(p.pass_up ? d * p.g * p.s : 0.0f);
  }

  __device__ float forward(bf16 gate, bf16 up) const { return value(pair(gate, up)); }
  __device__ float dot_term(bf16 gate, bf16 up, bf16 dy) const { return float(dy) * float(bf16(forward(gate, up))); }
  __device__ void backward(bf16 gate, bf16 up, bf16 dy, bf16& dg, bf16& du) const { gradient(pair(gate, up), float(dy), dg, du); }
  __device__ void weighted_backward(bf16 gate, bf16 up, bf16 dy, float w, bf16& aw, bf16& dg, bf16& du) const {
    const Pair p = pair(gate, up);
    aw = bf16(w * float(bf16(value(p))));
    gradient(p, float(bf16(w * float(dy))), dg, du);
  }
};

// The largest float <= limit: a bf16 value (exact in float) passes a clamp on the GPU exactly where
// it does on the CPU, which compares with the double limit (a float rounded up could let one more through).
float clamp_limit(double limit) {
  const float f = float(limit);
  return double(f) > limit ? std::nextafter(f, 0.0f) : f;
}

ClampedSwiglu clamped_swiglu(double alpha, double limit) { return {float(alpha), clamp_limit(limit)}; }

// One thread per N adjacent columns c of one row (N = 8 when I % 8 == 0 and rows are 16-byte
// aligned, else 1), grid-stride over R * I / N. Elementwise, so nothing to order.
template <int N, class Act>
__device__ __forceinline__ void forward_rows(Act activation, bf16* out, const bf16* gate_up, int64_t rows, int64_t inter) {
  begin_after_previous_grid();
  const int64_t per_row = inter / N;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < rows * per_row; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = p % per_row * N;
    Pack<bf16, N> g, u, o;
    activation.load_pairs(gate_up + r * 2 * inter, inter, c, g, u);
#pragma unroll
    for (int l = 0; l < N; ++l) o.v[l] = bf16(activation.forward(g.v[l], u.v[l]));
    store<N>(out + r * inter + c, o);
  }
}

template <int N, class Act>
__device__ __forceinline__ void backward_rows(Act activation, bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows,
                                              int64_t inter) {
  begin_after_previous_grid();
  const int64_t per_row = inter / N;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < rows * per_row; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = p % per_row * N;
    Pack<bf16, N> g, u, dg, du;
    activation.load_pairs(gate_up + r * 2 * inter, inter, c, g, u);
    const Pack<bf16, N> dy = load<N>(dout + r * inter + c);
#pragma unroll
    for (int l = 0; l < N; ++l) activation.backward(g.v[l], u.v[l], dy.v[l], dg.v[l], du.v[l]);
    activation.store_pairs(dgate_up + r * 2 * inter, inter, c, dg, du);
  }
}

// Thin kernels over the bodies above, so that each has its own name in kernel traces.
template <int N> __global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, int64_t rows, int64_t inter) {
  forward_rows<N>(Swiglu{}, out, gate_up, rows, inter);
}
template <int N>
__global__ void swiglu_backward_kernel(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows, int64_t inter) {
  backward_rows<N>(Swiglu{}, dgate_up, dout, gate_up, rows, inter);
}
template <int N>
__global__ void clamped_swiglu_forward_kernel(ClampedSwiglu activation, bf16* out, const bf16* gate_up, int64_t rows, int64_t inter) {
  forward_rows<N>(activation, out, gate_up, rows, inter);
}
template <int N>
__global__ void clamped_swiglu_backward_kernel(ClampedSwiglu activation, bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows,
                                               int64_t inter) {
  backward_rows<N>(activation, dgate_up, dout, gate_up, rows, inter);
}

constexpr int kWarps = 4;  // copies per block of the weighted backward

// One warp per copy; lanes own the packs p = lane + 32 i of the row. Two passes over the row: the
// first computes the SwiGLU output and its dot with dact (the dot must be whole before anything is
// weighted), the second reads the row again (from L2: a row is a few KiB, just read) and writes.
// Keeping the row in registers instead held a warp at ~150 registers and the kernel at ~1.9 TB/s.
// The dot sums in pack order then by a fixed butterfly, as route weights were summed before this
// fusion: deterministic. Rows outside [0, R) other than -1 (copy_row is not checked on the GPU)
// get dtopk_weight = NaN and are not touched. row_weight (nullptr: none) receives each named row's w.
template <int N, class Act>
__device__ __forceinline__ void weighted_backward_copy(Act activation, float* row_weight, bf16* dgate_up, bf16* act, float* dtopk_weight,
                                                       const bf16* dact, const bf16* gate_up, const float* topk_weight,
                                                       const int32_t* copy_row, int64_t copies, int64_t rows, int64_t inter) {
  begin_after_previous_grid();
  const int64_t c = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (c >= copies) return;
  const int64_t r = copy_row[c];
  if (r < 0 || r >= rows) {
    if (lane == 0) dtopk_weight[c] = r == -1 ? 0.0f : NAN;
    return;
  }
  const bf16 *gu = gate_up + r * 2 * inter, *dy_row = dact + r * inter;
  float dot = 0;
  for (int64_t col = int64_t(lane) * N; col < inter; col += 32 * N) {
    Pack<bf16, N> g, u;
    activation.load_pairs(gu, inter, col, g, u);
    const Pack<bf16, N> dy = load<N>(dy_row + col);
#pragma unroll
    for (int l = 0; l < N; ++l) dot += activation.dot_term(g.v[l], u.v[l], dy.v[l]);
  }
  dot = warp_sum(dot);
  if (lane == 0) dtopk_weight[c] = dot;
  const float w = topk_weight[c];
  if (row_weight != nullptr && lane == 0) row_weight[r] = w;
  for (int64_t col = int64_t(lane) * N; col < inter; col += 32 * N) {
    Pack<bf16, N> g, u, aw, dg, du;
    activation.load_pairs(gu, inter, col, g, u);
    const Pack<bf16, N> dy = load<N>(dy_row + col);
#pragma unroll
    for (int l = 0; l < N; ++l) activation.weighted_backward(g.v[l], u.v[l], dy.v[l], w, aw.v[l], dg.v[l], du.v[l]);
    store<N>(act + r * inter + col, aw);
    activation.store_pairs(dgate_up + r * 2 * inter, inter, col, dg, du);
  }
}

template <int N>
__global__ void swiglu_weighted_backward_kernel(bf16* dgate_up, bf16* act, float* dtopk_weight, const bf16* dact, const bf16* gate_up,
                                                const float* topk_weight, const int32_t* copy_row, int64_t copies, int64_t rows,
                                                int64_t inter) {
  weighted_backward_copy<N>(Swiglu{}, nullptr, dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row, copies, rows, inter);
}
template <int N>
__global__ void clamped_swiglu_weighted_backward_kernel(ClampedSwiglu activation, float* row_weight, bf16* dgate_up, bf16* act,
                                                        float* dtopk_weight, const bf16* dact, const bf16* gate_up, const float* topk_weight,
                                                        const int32_t* copy_row, int64_t copies, int64_t rows, int64_t inter) {
  weighted_backward_copy<N>(activation, row_weight, dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row, copies, rows, inter);
}

// The weighted backward's kernel<8> when rows of I columns split into 16-byte packs, else kernel<1>;
// `leading` are the kernel's arguments before the common ones.
template <typename Kernel, typename... Leading>
void launch_weighted_backward(Kernel kernel8, Kernel kernel1, Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up,
                              Tensor topk_weight, Tensor copy_row, Stream stream, Leading... leading) {
  const int64_t copies = copy_row.numel(), rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  if (copies == 0) return;
  launch_dependent(packable(inter, {dgate_up.data, act.data, dact.data, gate_up.data}) ? kernel8 : kernel1,
                   unsigned((copies + kWarps - 1) / kWarps), 32 * kWarps, 0, stream, leading..., bf16_ptr(dgate_up), bf16_ptr(act),
                   dtopk_weight.ptr<float>(), bf16_ptr(dact), bf16_ptr(gate_up), topk_weight.ptr<float>(), copy_row.ptr<int32_t>(), copies, rows,
                   inter);
}

// Launches kernel<8> when rows of inter columns split into 16-byte packs (every tensor in `data`
// 16-byte aligned), else kernel<1>.
template <typename Kernel, typename... Args>
void launch(Kernel kernel8, Kernel kernel1, std::initializer_list<const void*> data, int64_t rows, int64_t inter, Stream stream, Args... args) {
  const bool packed = packable(inter, data);
  const int64_t work = rows * (packed ? inter / 8 : inter);
  if (work > 0) launch_dependent(packed ? kernel8 : kernel1, grid_stride_blocks(work, 256, 8192), 256, 0, stream, args..., rows, inter);
}
#endif

}  // namespace

void swiglu_forward(Tensor out, Tensor gate_up, Stream stream) {
  const char* op = "swiglu_forward";
  const Rows r = check_forward(op, out, gate_up);
  if (r.gpu)
    MARROW_GPU_RETURN(op, stream, launch(swiglu_forward_kernel<8>, swiglu_forward_kernel<1>, {out.data, gate_up.data}, r.n, r.d, stream,
                                         bf16_ptr(out), bf16_ptr(gate_up)));
  with_cpu_scalar(op, gate_up, [&](auto s) { using T = decltype(s); forward_cpu<T>(out.ptr<T>(), gate_up.ptr<T>(), r.n, r.d); });
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, Stream stream) {
  const char* op = "swiglu_backward";
  const Rows r = check_backward(op, dgate_up, dout, gate_up);
  if (r.gpu)
    MARROW_GPU_RETURN(op, stream, launch(swiglu_backward_kernel<8>, swiglu_backward_kernel<1>, {dgate_up.data, dout.data, gate_up.data}, r.n,
                                         r.d, stream, bf16_ptr(dgate_up), bf16_ptr(dout), bf16_ptr(gate_up)));
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dgate_up.ptr<T>(), dout.ptr<T>(), gate_up.ptr<T>(), r.n, r.d);
  });
}

void swiglu_weighted_backward(Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up, Tensor topk_weight,
                              Tensor copy_row, Stream stream) {
  const char* op = "swiglu_weighted_backward";
  const int64_t n = check_weighted(op, dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row)[0];
  const int64_t d = gate_up.size(1) / 2, copies = copy_row.numel();
  if (on_gpu(op, {{"gate_up", &gate_up, DType::bf16}, {"dgate_up", &dgate_up, DType::bf16}, {"act", &act, DType::bf16},
                  {"dact", &dact, DType::bf16}, {"topk_weight", &topk_weight, DType::f32}, {"dtopk_weight", &dtopk_weight, DType::f32},
                  {"copy_row", &copy_row, DType::i32}}))
    MARROW_GPU_RETURN(op, stream, launch_weighted_backward(swiglu_weighted_backward_kernel<8>, swiglu_weighted_backward_kernel<1>, dgate_up,
                                                           act, dtopk_weight, dact, gate_up, topk_weight, copy_row, stream));
  expect_copy_rows(op, copy_row, n);
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    weighted_backward_cpu<T>(dgate_up.ptr<T>(), act.ptr<T>(), nullptr, dtopk_weight.ptr<T>(), dact.ptr<T>(), gate_up.ptr<T>(),
                             topk_weight.ptr<T>(), copy_row.ptr<int32_t>(), copies, d,
                             [&](T* out, const T* row) { forward_cpu<T>(out, row, 1, d); },
                             [&](T* dg, const T* dout, const T* row) { backward_cpu<T>(dg, dout, row, 1, d); });
  });
}

void clamped_swiglu_forward(Tensor out, Tensor gate_up, double alpha, double limit, Stream stream) {
  const char* op = "clamped_swiglu_forward";
  check_limit(op, limit);
  const Rows r = check_forward(op, out, gate_up);
  if (r.gpu)
    MARROW_GPU_RETURN(op, stream, launch(clamped_swiglu_forward_kernel<8>, clamped_swiglu_forward_kernel<1>, {out.data, gate_up.data}, r.n, r.d,
                                         stream, clamped_swiglu(alpha, limit), bf16_ptr(out), bf16_ptr(gate_up)));
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    clamped_forward_cpu<T>(out.ptr<T>(), gate_up.ptr<T>(), r.n, r.d, alpha, limit);
  });
}

void clamped_swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, double alpha, double limit, Stream stream) {
  const char* op = "clamped_swiglu_backward";
  check_limit(op, limit);
  const Rows r = check_backward(op, dgate_up, dout, gate_up);
  if (r.gpu)
    MARROW_GPU_RETURN(op, stream, launch(clamped_swiglu_backward_kernel<8>, clamped_swiglu_backward_kernel<1>,
                                         {dgate_up.data, dout.data, gate_up.data}, r.n, r.d, stream, clamped_swiglu(alpha, limit),
                                         bf16_ptr(dgate_up), bf16_ptr(dout), bf16_ptr(gate_up)));
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    clamped_backward_cpu<T>(dgate_up.ptr<T>(), dout.ptr<T>(), gate_up.ptr<T>(), r.n, r.d, alpha, limit);
  });
}

void clamped_swiglu_weighted_backward(Tensor dgate_up, Tensor act, Tensor row_weight, Tensor dtopk_weight, Tensor dact, Tensor gate_up,
                                      Tensor topk_weight, Tensor copy_row, double alpha, double limit, Stream stream) {
  const char* op = "clamped_swiglu_weighted_backward";
  const int64_t n = check_weighted(op, dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row)[0];
  const int64_t d = gate_up.size(1) / 2, copies = copy_row.numel();
  expect_shape(op, "row_weight", row_weight, {n});
  check_limit(op, limit);
  if (on_gpu(op, {{"gate_up", &gate_up, DType::bf16}, {"dgate_up", &dgate_up, DType::bf16}, {"act", &act, DType::bf16},
                  {"row_weight", &row_weight, DType::f32}, {"dact", &dact, DType::bf16}, {"topk_weight", &topk_weight, DType::f32},
                  {"dtopk_weight", &dtopk_weight, DType::f32}, {"copy_row", &copy_row, DType::i32}}))
    MARROW_GPU_RETURN(op, stream, launch_weighted_backward(clamped_swiglu_weighted_backward_kernel<8>, clamped_swiglu_weighted_backward_kernel<1>,
                                                           dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row, stream,
                                                           clamped_swiglu(alpha, limit), row_weight.ptr<float>()));
  expect_copy_rows(op, copy_row, n);
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    weighted_backward_cpu<T>(dgate_up.ptr<T>(), act.ptr<T>(), row_weight.ptr<T>(), dtopk_weight.ptr<T>(), dact.ptr<T>(), gate_up.ptr<T>(),
                             topk_weight.ptr<T>(), copy_row.ptr<int32_t>(), copies, d,
                             [&](T* out, const T* row) { clamped_forward_cpu<T>(out, row, 1, d, alpha, limit); },
                             [&](T* dg, const T* dout, const T* row) { clamped_backward_cpu<T>(dg, dout, row, 1, d, alpha, limit); });
  });
}

}  // namespace marrow
