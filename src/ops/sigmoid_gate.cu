// The GPU's sums are deterministic: delta_gates' parameter gradients a block per head (each thread
// its rows in order, then a fixed tree in shared memory), the row gate's a warp per row (each lane
// its packs in order, then warp_sum's tree).
#include "ops/sigmoid_gate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr double kThreshold = 20;  // torch's softplus passes x above it through (gradient 1)

template <typename T> T sigmoid(T v) { return T(1) / (T(1) + std::exp(-v)); }
template <typename T> T softplus(T v) { return v > T(kThreshold) ? v : std::log1p(std::exp(v)); }

template <typename T> void delta_forward_cpu(T* g, T* beta, const T* ba, const T* a_log, const T* dt_bias, int64_t t, int64_t hv) {
  for (int64_t i = 0; i < t * hv; ++i) {
    const int64_t h = i % hv, b = i / hv * 2 * hv + h;
    beta[i] = sigmoid(ba[b]);
    g[i] = -std::exp(a_log[h]) * softplus(ba[b + hv] + dt_bias[h]);
  }
}

// db = dbeta s (1 - s) for s = sigmoid(b); da = -dg exp(A_log) softplus'(x), x = a + dt_bias, summed
// over tokens into ddt_bias; dg g summed into dA_log.
template <typename T> void delta_backward_cpu(T* dba, T* da_log, T* ddt_bias, const T* dg, const T* dbeta, const T* ba, const T* a_log,
                                              const T* dt_bias, int64_t t, int64_t hv) {
  for (int64_t h = 0; h < hv; ++h) {
    T sum_a = 0, sum_dt = 0;
    for (int64_t i = h, b = h; i < t * hv; i += hv, b += 2 * hv) {
      const T s = sigmoid(ba[b]), x = ba[b + hv] + dt_bias[h], e = std::exp(a_log[h]);
      dba[b] = dbeta[i] * s * (1 - s);
      dba[b + hv] = -dg[i] * e * (x > T(kThreshold) ? T(1) : sigmoid(x));
      sum_dt += dba[b + hv];
      sum_a += dg[i] * (-e * softplus(x));
    }
    da_log[h] += sum_a;
    ddt_bias[h] += sum_dt;
  }
}

// gate has gd = d columns or one (a row's). dx may alias dy: a row's gate sum comes first.
template <typename T> void gate_cpu(T* y, T* dgate, const T* dy, const T* x, const T* gate, int64_t n, int64_t d, int64_t gd) {
  for (int64_t r = 0; r < n; ++r) {
    T sum = 0;
    for (int64_t j = 0; dgate && gd == 1 && j < d; ++j) sum += dy[r * d + j] * x[r * d + j];
    for (int64_t i = r * d; i < (r + 1) * d; ++i) {
      const T s = sigmoid(gate[gd == 1 ? r : i]);
      if (dgate && gd != 1) dgate[i] = dy[i] * x[i] * s * (1 - s);
      y[i] = dgate ? dy[i] * s : x[i] * s;
    }
    if (dgate && gd == 1) dgate[r] = sum * sigmoid(gate[r]) * (1 - sigmoid(gate[r]));
  }
}

#ifdef __CUDACC__
constexpr int kThreads = 256;

__device__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }
__device__ float softplusf(float v) { return v > float(kThreshold) ? v : log1pf(expf(v)); }

__global__ void delta_gates_forward_kernel(float* g, float* beta, const bf16* ba, const bf16* a_log, const bf16* dt_bias, int64_t t, int64_t hv) {
  begin_after_previous_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < t * hv; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = i % hv, b = i / hv * 2 * hv + h;
    beta[i] = float(bf16(sigmoidf(float(ba[b]))));  // torch's b.sigmoid() in bf16
    g[i] = -expf(float(a_log[h])) * softplusf(float(ba[b + hv]) + float(dt_bias[h]));
  }
}

// A block a head h: thread k takes tokens k, k + kThreads, ... (dba, and its sums of dA_log's and
// ddt_bias's terms), then the block adds the threads' sums in a fixed tree.
__global__ void delta_gates_backward_kernel(bf16* dba, float* da_log, float* ddt_bias, const float* dg, const float* dbeta, const bf16* ba,
                                            const bf16* a_log, const bf16* dt_bias, int64_t t, int64_t hv) {
  begin_after_previous_grid();
  __shared__ float2 sums[kThreads];
  const int64_t h = blockIdx.x;
  if (h >= hv) return;  // hv = 0: one block, no head
  const float e = expf(float(a_log[h])), bias = float(dt_bias[h]);
  float2 sum = make_float2(0, 0);
  for (int64_t r = threadIdx.x; r < t; r += kThreads) {
    const int64_t i = r * hv + h, b = r * 2 * hv + h;
    const float s = sigmoidf(float(ba[b])), x = float(ba[b + hv]) + bias;
    const float da = -dg[i] * e * (x > float(kThreshold) ? 1.0f : sigmoidf(x));
    dba[b] = bf16(dbeta[i] * s * (1.0f - s));
    dba[b + hv] = bf16(da);
    sum = make_float2(fmaf(dg[i], -e * softplusf(x), sum.x), sum.y + da);
  }
  sums[threadIdx.x] = sum;
  for (int m = kThreads / 2; m > 0; m /= 2) {
    __syncthreads();
    if (threadIdx.x < m)
      sums[threadIdx.x] = make_float2(sums[threadIdx.x].x + sums[threadIdx.x + m].x, sums[threadIdx.x].y + sums[threadIdx.x + m].y);
  }
  if (threadIdx.x == 0) da_log[h] += sums[0].x, ddt_bias[h] += sums[0].y;
}

// A warp a row. Forward (dgate null): y = x * bf16(sigmoid(gate)) (torch's bf16 sigmoid, then the
// bf16 product). Backward: y receives dx; dgate per element, or the row's from the warp's sum.
template <int N>
__global__ void sigmoid_gate_kernel(bf16* y, bf16* dgate, const bf16* dy, const bf16* x, const bf16* gate, int64_t n, int64_t d, bool row_gate) {
  begin_after_previous_grid();
  const int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= n) return;
  const float row_s = row_gate ? sigmoidf(float(gate[r])) : 0.0f;
  float sum = 0;
  for (int64_t c = r * d + lane * N; c < (r + 1) * d; c += 32 * N) {
    const Pack<bf16, N> xp = load<N>(x + c), gp = row_gate ? Pack<bf16, N>{} : load<N>(gate + c);
    const Pack<bf16, N> dp = dy ? load<N>(dy + c) : Pack<bf16, N>{};
    Pack<bf16, N> out, dg;
    for (int l = 0; l < N; ++l) {
      const float s = row_gate ? row_s : sigmoidf(float(gp.v[l])), xv = float(xp.v[l]), g = float(dp.v[l]);
      out.v[l] = dgate ? bf16(g * s) : bf16(xv * float(bf16(s)));
      dg.v[l] = bf16(g * xv * s * (1.0f - s));
      sum = fmaf(g, xv, sum);
    }
    store<N>(y + c, out);
    if (dgate && !row_gate) store<N>(dgate + c, dg);
  }
  sum = warp_sum(sum);
  if (dgate && row_gate && lane == 0) dgate[r] = bf16(sum * row_s * (1.0f - row_s));
}

void launch_gate(Tensor y, Tensor dgate, Tensor dy, Tensor x, Tensor gate, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  const bool row_gate = gate.size(1) != d,
             packed = packable(d, {y.data, dy.data, x.data, row_gate ? nullptr : gate.data, row_gate ? nullptr : dgate.data});
  if (n > 0)
    launch_dependent(packed ? sigmoid_gate_kernel<8> : sigmoid_gate_kernel<1>, unsigned((n + 7) / 8), 256, 0, stream, bf16_ptr(y), bf16_ptr(dgate),
                     bf16_ptr(dy), bf16_ptr(x), bf16_ptr(gate), n, d, row_gate);
}
#endif

using Named = std::initializer_list<std::pair<const char*, const Tensor*>>;

// ba [T, 2 Hv] (returns Hv), the tensors shaped like g [T, Hv], the parameters [Hv].
int64_t check_delta(const char* op, const Tensor& ba, Named like_g, Named params) {
  MARROW_CHECK(ba.ndim == 2 && ba.size(1) % 2 == 0, "{}: ba must be [tokens, 2 * value_heads], got {}", op, ba.shape_string());
  for (auto [name, t] : like_g) expect_shape(op, name, *t, {ba.size(0), ba.size(1) / 2});
  for (auto [name, t] : params) expect_shape(op, name, *t, {ba.size(1) / 2});
  return ba.size(1) / 2;
}

// The split (q, gate from qg) or its transpose (merge: dqg from dq, dgate): pitched copies of rows of D elements.
void copy_halves(const char* op, bool merge, Tensor qg, Tensor q, Tensor gate, Stream stream) {
  static const char* const names[2][3] = {{"q", "gate", "qg"}, {"dq", "dgate", "dqg"}};
  const char* const* name = names[merge];
  expect_ndim(op, name[0], q, 3, "[tokens, heads, head_dim]");
  expect_shape(op, name[1], gate, {q.size(0), q.size(1), q.size(2)});
  expect_shape(op, name[2], qg, {q.size(0), q.size(1), 2 * q.size(2)});
  const bool gpu = on_gpu(op, {{name[2], &qg, DType::bf16}, {name[0], &q, DType::bf16}, {name[1], &gate, DType::bf16}});
  if (!gpu) with_cpu_scalar(op, qg, [](auto) {});  // the CPU reference's dtypes
  const size_t width = size_t(q.size(2)) * dtype_size(q.dtype), rows = size_t(q.size(0) * q.size(1));
  for (int k = 0; k < 2 && width * rows > 0; ++k) {
    char *half = static_cast<char*>(k ? gate.data : q.data), *whole = static_cast<char*>(qg.data) + k * width;
    char* dst = merge ? whole : half;
    const char* src = merge ? half : whole;
    const size_t dst_pitch = merge ? 2 * width : width, src_pitch = merge ? width : 2 * width;
#ifdef __CUDACC__
    if (gpu) {
      MARROW_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, cuda_stream(stream)));
      continue;
    }
#else
    if (gpu) (void)stream, no_cuda_kernel(op);
#endif
    for (size_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_pitch, src + r * src_pitch, width);
  }
}

// x [N, D], the tensors shaped like it, and gate [N, D] or [N, 1].
void check_gate(const char* op, const Tensor& x, Named like_x, const Tensor& gate) {
  expect_ndim(op, "x", x, 2, "[rows, dim]");
  for (auto [name, t] : like_x) expect_shape(op, name, *t, {x.size(0), x.size(1)});
  MARROW_CHECK(gate.ndim == 2 && gate.size(0) == x.size(0) && (gate.size(1) == x.size(1) || gate.size(1) == 1),
               "{}: gate has shape {} but expected [{}, {}] or [{}, 1]", op, gate.shape_string(), x.size(0), x.size(1), x.size(0));
}

}  // namespace

void delta_gates_forward(Tensor g, Tensor beta, Tensor ba, Tensor A_log, Tensor dt_bias, Stream stream) {
  const char* op = "delta_gates_forward";
  const int64_t t = ba.size(0), hv = check_delta(op, ba, {{"g", &g}, {"beta", &beta}}, {{"A_log", &A_log}, {"dt_bias", &dt_bias}});
  if (on_gpu(op, {{"ba", &ba, DType::bf16}, {"g", &g, DType::f32}, {"beta", &beta, DType::f32}, {"A_log", &A_log, DType::bf16},
                  {"dt_bias", &dt_bias, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, launch_dependent(delta_gates_forward_kernel, grid_stride_blocks(t * hv, 256, 8192), 256, 0, stream,
                                                   g.ptr<float>(), beta.ptr<float>(), bf16_ptr(ba), bf16_ptr(A_log), bf16_ptr(dt_bias), t, hv));
  with_cpu_scalar(op, ba, [&](auto s) {
    using T = decltype(s);
    delta_forward_cpu<T>(g.ptr<T>(), beta.ptr<T>(), ba.ptr<T>(), A_log.ptr<T>(), dt_bias.ptr<T>(), t, hv);
  });
}

void delta_gates_backward(Tensor dba, Tensor dA_log, Tensor ddt_bias, Tensor dg, Tensor dbeta, Tensor ba, Tensor A_log, Tensor dt_bias,
                          Stream stream) {
  const char* op = "delta_gates_backward";
  const int64_t t = ba.size(0), hv = check_delta(op, ba, {{"dg", &dg}, {"dbeta", &dbeta}},
                                                 {{"A_log", &A_log}, {"dt_bias", &dt_bias}, {"dA_log", &dA_log}, {"ddt_bias", &ddt_bias}});
  expect_shape(op, "dba", dba, {t, 2 * hv});
  if (on_gpu(op, {{"ba", &ba, DType::bf16}, {"dba", &dba, DType::bf16}, {"dg", &dg, DType::f32}, {"dbeta", &dbeta, DType::f32},
                  {"A_log", &A_log, DType::bf16}, {"dt_bias", &dt_bias, DType::bf16}, {"dA_log", &dA_log, DType::f32},
                  {"ddt_bias", &ddt_bias, DType::f32}}))
    MARROW_GPU_RETURN(op, stream, launch_dependent(delta_gates_backward_kernel, unsigned(std::max<int64_t>(hv, 1)), kThreads, 0, stream,
                                                   bf16_ptr(dba), dA_log.ptr<float>(), ddt_bias.ptr<float>(), dg.ptr<float>(), dbeta.ptr<float>(),
                                                   bf16_ptr(ba), bf16_ptr(A_log), bf16_ptr(dt_bias), t, hv));
  with_cpu_scalar(op, ba, [&](auto s) {
    using T = decltype(s);
    delta_backward_cpu<T>(dba.ptr<T>(), dA_log.ptr<T>(), ddt_bias.ptr<T>(), dg.ptr<T>(), dbeta.ptr<T>(), ba.ptr<T>(), A_log.ptr<T>(),
                          dt_bias.ptr<T>(), t, hv);
  });
}

void split_query_gate_forward(Tensor q, Tensor gate, Tensor qg, Stream stream) {
  copy_halves("split_query_gate_forward", false, qg, q, gate, stream);
}
void split_query_gate_backward(Tensor dqg, Tensor dq, Tensor dgate, Stream stream) {
  copy_halves("split_query_gate_backward", true, dqg, dq, dgate, stream);
}

void sigmoid_gate_forward(Tensor y, Tensor x, Tensor gate, Stream stream) {
  const char* op = "sigmoid_gate_forward";
  check_gate(op, x, {{"y", &y}}, gate);
  if (on_gpu(op, {{"x", &x, DType::bf16}, {"y", &y, DType::bf16}, {"gate", &gate, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, launch_gate(y, Tensor{}, Tensor{}, x, gate, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    gate_cpu<T>(y.ptr<T>(), nullptr, nullptr, x.ptr<T>(), gate.ptr<T>(), x.size(0), x.size(1), gate.size(1));
  });
}

void sigmoid_gate_backward(Tensor dx, Tensor dgate, Tensor dy, Tensor x, Tensor gate, Stream stream) {
  const char* op = "sigmoid_gate_backward";
  check_gate(op, x, {{"dy", &dy}, {"dx", &dx}}, gate);
  expect_shape(op, "dgate", dgate, {gate.size(0), gate.size(1)});
  if (on_gpu(op, {{"x", &x, DType::bf16}, {"dx", &dx, DType::bf16}, {"dy", &dy, DType::bf16}, {"gate", &gate, DType::bf16},
                  {"dgate", &dgate, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, launch_gate(dx, dgate, dy, x, gate, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    gate_cpu<T>(dx.ptr<T>(), dgate.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), gate.ptr<T>(), x.size(0), x.size(1), gate.size(1));
  });
}

}  // namespace marrow
