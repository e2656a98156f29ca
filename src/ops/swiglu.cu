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
#include <cuda_bf16.h>

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

// The weighted backwards' shared checks: returns (R, I).
std::array<int64_t, 2> check_weighted(const char* op, Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up,
                                      Tensor topk_weight, Tensor copy_row) {
  const std::array<int64_t, 2> size = check_gate_up(op, gate_up);
  const int64_t n = size[0], d = size[1];
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "dgate_up", dgate_up, {n, 2 * d});
  expect_shape(op, "act", act, {n, d});
  expect_shape(op, "dact", dact, {n, d});
  expect_shape(op, "topk_weight", topk_weight, {copy_row.size(0), copy_row.size(1)});
  expect_shape(op, "dtopk_weight", dtopk_weight, {copy_row.size(0), copy_row.size(1)});
  return size;
}

// The clamped SwiGLU's checks after the shapes: one dtype, a positive limit, and the CPU.
void check_clamped(const char* op, double limit, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  MARROW_CHECK(limit > 0, "{}: limit must be positive, got {}", op, limit);
  expect_same_dtype(op, tensors);
  MARROW_CHECK(common_device(op, tensors) == Device::cpu, "{}: the clamped SwiGLU runs on the CPU only so far, but {} is on the GPU", op,
               tensors.begin()->first);
}



#ifdef __CUDACC__
using bf16 = __nv_bfloat16;

template <int N> struct alignas(2 * N) Pack {
  bf16 v[N];
};
template <int N> __device__ Pack<N> load(const bf16* p) { return *reinterpret_cast<const Pack<N>*>(p); }
template <int N> __device__ void store(bf16* p, const Pack<N>& v) { *reinterpret_cast<Pack<N>*>(p) = v; }

__device__ float sigmoidf(float g) { return 1.0f / (1.0f + expf(-g)); }

// One thread per N adjacent columns c of one row (N = 8 when I % 8 == 0 and rows are 16-byte
// aligned, else 1), grid-stride over R * I / N. Elementwise, so nothing to order.
template <int N> __global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, int64_t rows, int64_t inter) {
  begin_after_previous_grid();
  const int64_t per_row = inter / N;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < rows * per_row; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = p % per_row * N;
    const Pack<N> g = load<N>(gate_up + r * 2 * inter + c), u = load<N>(gate_up + r * 2 * inter + inter + c);
    Pack<N> o;
#pragma unroll
    for (int l = 0; l < N; ++l) {
      const float gf = float(g.v[l]);
      o.v[l] = bf16(gf * sigmoidf(gf) * float(u.v[l]));
    }
    store<N>(out + r * inter + c, o);
  }
}

template <int N>
__global__ void swiglu_backward_kernel(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows, int64_t inter) {
  begin_after_previous_grid();
  const int64_t per_row = inter / N;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < rows * per_row; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / per_row, c = p % per_row * N;
    const Pack<N> g = load<N>(gate_up + r * 2 * inter + c), u = load<N>(gate_up + r * 2 * inter + inter + c),
                  dy = load<N>(dout + r * inter + c);
    Pack<N> dg, du;
#pragma unroll
    for (int l = 0; l < N; ++l) {
      const float gf = float(g.v[l]), s = sigmoidf(gf), d = float(dy.v[l]);
      dg.v[l] = bf16(d * float(u.v[l]) * s * (1.0f + gf * (1.0f - s)));
      du.v[l] = bf16(d * gf * s);
    }
    store<N>(dgate_up + r * 2 * inter + c, dg);
    store<N>(dgate_up + r * 2 * inter + inter + c, du);
  }
}

constexpr int kWarps = 4;  // copies per block of the weighted backward

// One warp per copy; lanes own the packs p = lane + 32 i of the row. Two passes over the row: the
// first computes the SwiGLU output and its dot with dact (the dot must be whole before anything is
// weighted), the second reads the row again (from L2: a row is a few KiB, just read) and writes.
// Keeping the row in registers instead held a warp at ~150 registers and the kernel at ~1.9 TB/s.
// The dot sums in pack order then by a fixed butterfly, as route weights were summed before this
// fusion: deterministic. Rows outside [0, R) other than -1 (copy_row is not checked on the GPU)
// get dtopk_weight = NaN and are not touched.
template <int N>
__global__ void swiglu_weighted_backward_kernel(bf16* dgate_up, bf16* act, float* dtopk_weight, const bf16* dact, const bf16* gate_up,
                                                const float* topk_weight, const int32_t* copy_row, int64_t copies, int64_t rows,
                                                int64_t inter) {
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
    const Pack<N> g = load<N>(gu + col), u = load<N>(gu + inter + col), dy = load<N>(dy_row + col);
#pragma unroll
    for (int l = 0; l < N; ++l) {
      const float gf = float(g.v[l]);
      dot += float(dy.v[l]) * float(bf16(gf * sigmoidf(gf) * float(u.v[l])));
    }
  }
  for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (lane == 0) dtopk_weight[c] = dot;
  const float w = topk_weight[c];
  for (int64_t col = int64_t(lane) * N; col < inter; col += 32 * N) {
    const Pack<N> g = load<N>(gu + col), u = load<N>(gu + inter + col), dy = load<N>(dy_row + col);
    Pack<N> aw, dg, du;
#pragma unroll
    for (int l = 0; l < N; ++l) {
      const float gf = float(g.v[l]), s = sigmoidf(gf), d = float(bf16(w * float(dy.v[l])));
      aw.v[l] = bf16(w * float(bf16(gf * s * float(u.v[l]))));
      dg.v[l] = bf16(d * float(u.v[l]) * s * (1.0f + gf * (1.0f - s)));
      du.v[l] = bf16(d * gf * s);
    }
    store<N>(act + r * inter + col, aw);
    store<N>(dgate_up + r * 2 * inter + col, dg);
    store<N>(dgate_up + r * 2 * inter + inter + col, du);
  }
}

template <int N>
void launch_weighted_backward(Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up, Tensor topk_weight,
                              Tensor copy_row, Stream stream) {
  const int64_t copies = copy_row.numel(), rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const unsigned blocks = unsigned((copies + kWarps - 1) / kWarps);
  launch_dependent(swiglu_weighted_backward_kernel<N>, blocks, 32 * kWarps, 0, static_cast<cudaStream_t>(stream.handle), 
      static_cast<bf16*>(dgate_up.data), static_cast<bf16*>(act.data), dtopk_weight.ptr<float>(), static_cast<const bf16*>(dact.data),
      static_cast<const bf16*>(gate_up.data), topk_weight.ptr<float>(), copy_row.ptr<int32_t>(), copies, rows, inter);
  MARROW_CUDA_CHECK_LAUNCH();
}

bool aligned16(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return bits % 16 == 0;
}

// Launches kernel<8> when rows of inter columns split into 16-byte packs, else kernel<1>.
template <typename K8, typename K1, typename... Args>
void launch(K8 kernel8, K1 kernel1, bool packed, int64_t rows, int64_t inter, Stream stream, Args... args) {
  const int64_t work = rows * (packed ? inter / 8 : inter);
  if (work == 0) return;
  const int threads = 256, blocks = int(std::min<int64_t>((work + threads - 1) / threads, 8192));
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (packed) launch_dependent(kernel8, blocks, threads, 0, s, args..., rows, inter);
  else launch_dependent(kernel1, blocks, threads, 0, s, args..., rows, inter);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

}  // namespace

void swiglu_forward(Tensor out, Tensor gate_up, Stream stream) {
  const char* op = "swiglu_forward";
  const std::array<int64_t, 2> size = check_gate_up(op, gate_up);
  const int64_t n = size[0], d = size[1];
  expect_shape(op, "out", out, {n, d});
  expect_same_dtype(op, {{"gate_up", &gate_up}, {"out", &out}});
  if (common_device(op, {{"gate_up", &gate_up}, {"out", &out}}) == Device::cuda) {
    expect_dtype(op, "gate_up", gate_up, DType::bf16);
#ifdef __CUDACC__
    const bool packed = d % 8 == 0 && aligned16({out.data, gate_up.data});
    return launch(swiglu_forward_kernel<8>, swiglu_forward_kernel<1>, packed, n, d, stream, static_cast<bf16*>(out.data),
                  static_cast<const bf16*>(gate_up.data));
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), gate_up.ptr<T>(), n, d);
  });
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, Stream stream) {
  const char* op = "swiglu_backward";
  const std::array<int64_t, 2> size = check_gate_up(op, gate_up);
  const int64_t n = size[0], d = size[1];
  expect_shape(op, "dgate_up", dgate_up, {n, 2 * d});
  expect_shape(op, "dout", dout, {n, d});
  expect_same_dtype(op, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"dout", &dout}});
  if (common_device(op, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"dout", &dout}}) == Device::cuda) {
    expect_dtype(op, "gate_up", gate_up, DType::bf16);
#ifdef __CUDACC__
    const bool packed = d % 8 == 0 && aligned16({dgate_up.data, dout.data, gate_up.data});
    return launch(swiglu_backward_kernel<8>, swiglu_backward_kernel<1>, packed, n, d, stream, static_cast<bf16*>(dgate_up.data),
                  static_cast<const bf16*>(dout.data), static_cast<const bf16*>(gate_up.data));
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dgate_up.ptr<T>(), dout.ptr<T>(), gate_up.ptr<T>(), n, d);
  });
}

void swiglu_weighted_backward(Tensor dgate_up, Tensor act, Tensor dtopk_weight, Tensor dact, Tensor gate_up, Tensor topk_weight,
                              Tensor copy_row, Stream stream) {
  const char* op = "swiglu_weighted_backward";
  const int64_t n = check_weighted(op, dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row)[0];
  const int64_t d = gate_up.size(1) / 2, copies = copy_row.numel();
  if (common_device(op, {{"gate_up", &gate_up},
                         {"dgate_up", &dgate_up},
                         {"act", &act},
                         {"dact", &dact},
                         {"topk_weight", &topk_weight},
                         {"dtopk_weight", &dtopk_weight},
                         {"copy_row", &copy_row}}) == Device::cuda) {
    for (auto [name, t] : {std::pair{"gate_up", &gate_up}, std::pair{"dgate_up", &dgate_up}, std::pair{"act", &act}, std::pair{"dact", &dact}})
      expect_dtype(op, name, *t, DType::bf16);
    for (auto [name, t] : {std::pair{"topk_weight", &topk_weight}, std::pair{"dtopk_weight", &dtopk_weight}}) expect_dtype(op, name, *t, DType::f32);
#ifdef __CUDACC__
    if (copies == 0) return;
    const bool packed = d % 8 == 0 && aligned16({dgate_up.data, act.data, dact.data, gate_up.data});
    if (packed) return launch_weighted_backward<8>(dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row, stream);
    return launch_weighted_backward<1>(dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"act", &act}, {"dact", &dact}, {"topk_weight", &topk_weight},
                         {"dtopk_weight", &dtopk_weight}});
  (void)stream;
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
  const std::array<int64_t, 2> size = check_gate_up(op, gate_up);
  const int64_t n = size[0], d = size[1];
  expect_shape(op, "out", out, {n, d});
  check_clamped(op, limit, {{"gate_up", &gate_up}, {"out", &out}});
  (void)stream;
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    clamped_forward_cpu<T>(out.ptr<T>(), gate_up.ptr<T>(), n, d, alpha, limit);
  });
}

void clamped_swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up, double alpha, double limit, Stream stream) {
  const char* op = "clamped_swiglu_backward";
  const std::array<int64_t, 2> size = check_gate_up(op, gate_up);
  const int64_t n = size[0], d = size[1];
  expect_shape(op, "dgate_up", dgate_up, {n, 2 * d});
  expect_shape(op, "dout", dout, {n, d});
  check_clamped(op, limit, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"dout", &dout}});
  (void)stream;
  with_cpu_scalar(op, gate_up, [&](auto s) {
    using T = decltype(s);
    clamped_backward_cpu<T>(dgate_up.ptr<T>(), dout.ptr<T>(), gate_up.ptr<T>(), n, d, alpha, limit);
  });
}

void clamped_swiglu_weighted_backward(Tensor dgate_up, Tensor act, Tensor row_weight, Tensor dtopk_weight, Tensor dact, Tensor gate_up,
                                      Tensor topk_weight, Tensor copy_row, double alpha, double limit, Stream stream) {
  const char* op = "clamped_swiglu_weighted_backward";
  const int64_t n = check_weighted(op, dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row)[0];
  const int64_t d = gate_up.size(1) / 2, copies = copy_row.numel();
  expect_shape(op, "row_weight", row_weight, {n});
  check_clamped(op, limit, {{"gate_up", &gate_up}, {"dgate_up", &dgate_up}, {"act", &act}, {"row_weight", &row_weight}, {"dact", &dact},
                            {"topk_weight", &topk_weight}, {"dtopk_weight", &dtopk_weight}});
  (void)stream;
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
