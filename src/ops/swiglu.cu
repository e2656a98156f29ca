#include "ops/swiglu.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
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

// gate_up[R, 2I]: returns (R, I).
std::array<int64_t, 2> check_gate_up(const char* op, const Tensor& gate_up) {
  MARROW_CHECK(gate_up.ndim == 2 && gate_up.size(1) % 2 == 0, "{}: gate_up must be [rows, 2 * intermediate], got {}", op,
               gate_up.shape_string());
  return {gate_up.size(0), gate_up.size(1) / 2};
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
  if (packed) kernel8<<<blocks, threads, 0, s>>>(args..., rows, inter);
  else kernel1<<<blocks, threads, 0, s>>>(args..., rows, inter);
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

}  // namespace marrow
